"""End to end on TorchTitan 0.3.0: ./run_train.sh with the 0.3.0 TOMLs on CPU.

The README's main job and compare flow at EP = 2 over gloo (UniEP's reference
schedule against TorchTitan's all-to-all; a rerun; a checkpoint saved at step
CHECKPOINT_STEP and resumed) and at EP = 1 with UniEP's kernels in Triton's
interpreter on the tiny flavor. GPUs are hidden from the runs.
"""

from __future__ import annotations

import pytest
from torchtitan_release import requires_torchtitan

requires_torchtitan("0.3.0")

import math  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from training import RUN_TIMEOUT_S, RunTimedOut, run_in_own_group  # noqa: E402

from titan_uniep.tools.compare_loss import compare, load_run  # noqa: E402

pytestmark = pytest.mark.slow

CONFIGS = "train_configs/torchtitan_0_3"
STEPS = 4
CHECKPOINT_STEP = 2
SMALL_BATCH = ("--training.local_batch_size", "2")
UNIEP_VS_BASELINE_RTOL = 1e-3
"""As on TorchTitan 0.2.2 (tests/test_train_cpu.py): the reference schedule sums the
expert outputs in another order than TorchTitan, so the curves drift by rounding."""


def train(config: str, dump_folder: Path, *overrides: str, steps: int, ngpu: int = 2) -> dict[int, float]:
    """./run_train.sh with this interpreter's python3 first on PATH (the 0.3.0 environment);
    ``{step: loss}`` of its loss.jsonl."""
    env = dict(os.environ, NGPU=str(ngpu), CONFIG_FILE=f"{CONFIGS}/{config}.toml", CUDA_VISIBLE_DEVICES="",
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    cmd = ["./run_train.sh", "--training.steps", str(steps), "--dump_folder", str(dump_folder), *overrides]
    try:
        returncode, output = run_in_own_group(cmd, env=env, timeout_s=RUN_TIMEOUT_S)
    except RunTimedOut as e:
        pytest.fail(f"{' '.join(cmd)} ran past {RUN_TIMEOUT_S} s:\n{e.output[-6000:]}")
    if returncode != 0:
        pytest.fail(f"{' '.join(cmd)} exited {returncode}:\n{output[-6000:]}")
    return load_run(dump_folder).losses


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Baseline and UniEP for STEPS steps; UniEP again; UniEP to CHECKPOINT_STEP saving a
    checkpoint, then resumed from it to STEPS in the same folder."""
    root = tmp_path_factory.mktemp("v0_3")
    out = {
        "baseline": train("deepseek_v3_debug_baseline", root / "baseline", *SMALL_BATCH, steps=STEPS),
        "uniep": train("deepseek_v3_debug_uniep", root / "uniep", *SMALL_BATCH, steps=STEPS),
        "again": train("deepseek_v3_debug_uniep", root / "again", *SMALL_BATCH, steps=STEPS),
    }
    saved = root / "resumed"
    save = ("--checkpoint.enable", "--checkpoint.interval", str(CHECKPOINT_STEP))
    out["saved"] = train("deepseek_v3_debug_uniep", saved, *SMALL_BATCH, *save, steps=CHECKPOINT_STEP)
    assert (saved / "checkpoint" / f"step-{CHECKPOINT_STEP}").is_dir(), "no checkpoint was saved"
    out["resumed"] = train("deepseek_v3_debug_uniep", saved, *SMALL_BATCH, *save, steps=STEPS)
    out["root"] = root
    return out


def test_uniep_reference_tracks_torchtitans_all_to_all_at_ep2(runs):
    base, uniep = runs["baseline"], runs["uniep"]
    assert sorted(base) == sorted(uniep) == list(range(1, STEPS + 1))
    assert all(math.isfinite(v) for v in [*base.values(), *uniep.values()])
    result = compare(load_run(runs["root"] / "baseline"), load_run(runs["root"] / "uniep"))
    assert result.max_rel <= UNIEP_VS_BASELINE_RTOL, result.max_rel


def test_uniep_rerun_is_bitwise_equal(runs):
    assert runs["again"] == runs["uniep"]


def test_uniep_resumes_its_own_checkpoint_bitwise(runs):
    resumed = runs["resumed"]
    assert sorted(resumed) == list(range(1, STEPS + 1)), "loss.jsonl holds every step of both parts"
    assert resumed == runs["uniep"]


def test_ep1_kernels_in_the_interpreter_track_torchtitan_on_the_tiny_flavor(tmp_path):
    # The EP = 1 TOML (a GPU configuration) with its CPU form named on the command line,
    # which wins over the file's config.
    losses = {side: train(f"qwen3_debug_moe_ep1_{side}", tmp_path / side, "--config",
                          f"qwen3_debug_moe_tiny_ep1_{side}", steps=3, ngpu=1) for side in ("baseline", "uniep")}
    result = compare(load_run(tmp_path / "baseline"), load_run(tmp_path / "uniep"))
    assert sorted(losses["uniep"]) == [1, 2, 3] and result.max_rel <= UNIEP_VS_BASELINE_RTOL, result
