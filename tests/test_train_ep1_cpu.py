"""End to end at EP = 1: the NGPU=1 config pair trains on CPU through UniEP's kernels.

``train_configs/qwen3_debug_moe_ep1_{uniep,baseline}.toml`` (one process,
``expert_parallel_degree = 1``), shrunk for the CPU: the ``debugmodel_moe_tiny``
flavor (one MoE layer of dim 16) and 16 tokens per step, since the kernels run
in Triton's interpreter here. UniEP runs the config's schedule ``"fused"`` (the
op on a one-rank group, forward and backward kernels), the baseline
TorchTitan's own MoE; both runs start together (one process each, one core
each).
"""

import math
import os
import signal
import subprocess
from pathlib import Path

import pytest

from titan_uniep.compare_loss import compare, load_run
from stacks import requires_torchtitan

pytestmark = [pytest.mark.slow, requires_torchtitan("0.2")]  # TorchTitan 0.2 train configs

REPO = Path(__file__).resolve().parents[1]
STEPS = 5
RUN_TIMEOUT_S = 600
CPU_OVERRIDES = (
    "--model.flavor", "debugmodel_moe_tiny", "--training.local_batch_size", "1", "--training.seq_len", "16",
    # The interpreter's bf16 dot products are wrong; the kernels compute in fp32 here.
    "--training.mixed_precision_param", "float32",
    # A large step, so five steps of 16 tokens show learning above the batches' own spread.
    "--optimizer.lr", "5e-2",
)
UNIEP_VS_BASELINE_RTOL = 1e-5
"""fp32 on both sides: the kernels and TorchTitan's for-loop experts (the tiny
flavor turns grouped_mm off, whose GEMMs round to bf16) differ only in fp32
summation order, ~1e-7 relative per GEMM; five steps of AdamW stay far below
1e-5 (the runs measured here gave the same bits)."""


def _start(config: str, dump_folder: Path, *overrides: str) -> subprocess.Popen:
    env = dict(os.environ, NGPU="1", LOG_RANK="0", CONFIG_FILE=config, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    cmd = ["./run_train.sh", "--training.steps", str(STEPS), "--job.dump_folder", str(dump_folder), *CPU_OVERRIDES,
           *overrides]
    # Its own process group, so a timeout takes torchrun's worker too.
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _finish(proc: subprocess.Popen) -> str:
    try:
        output, _ = proc.communicate(timeout=RUN_TIMEOUT_S)
    except BaseException as exc:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        if not isinstance(exc, subprocess.TimeoutExpired):
            raise
        pytest.fail(f"{' '.join(proc.args)} ran past {RUN_TIMEOUT_S} s:\n{output[-6000:]}")
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(proc.args)} exited {proc.returncode}:\n{output[-6000:]}")
    return output


def test_ep1_pair_trains_through_the_kernels_and_tracks_the_baseline_on_cpu(tmp_path):
    runs = {
        "uniep": _start("train_configs/qwen3_debug_moe_ep1_uniep.toml", tmp_path / "uniep"),
        "baseline": _start("train_configs/qwen3_debug_moe_ep1_baseline.toml", tmp_path / "baseline"),
    }
    try:
        outputs = {name: _finish(proc) for name, proc in runs.items()}
    finally:
        for proc in runs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
    uniep, baseline = load_run(tmp_path / "uniep"), load_run(tmp_path / "baseline")
    assert sorted(uniep.losses) == list(range(1, STEPS + 1))
    values = [uniep.losses[s] for s in range(1, STEPS + 1)]
    assert all(math.isfinite(v) for v in values), values
    # Starts near 8.4 (above ln(2048) = 7.6: a random init); the last step is
    # more than half a nat lower.
    assert values[-1] < values[0] - 0.5, values
    result = compare(baseline, uniep)
    assert result.steps == list(range(1, STEPS + 1))
    assert result.max_rel <= UNIEP_VS_BASELINE_RTOL, f"max rel diff {result.max_rel:.3e}: {values} vs {baseline.losses}"
    assert "UniEP: 1 MoE layers on schedule 'fused' (EP degree 1)" in outputs["uniep"], outputs["uniep"][-3000:]
