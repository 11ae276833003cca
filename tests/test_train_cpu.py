"""End to end: ./run_train.sh trains the debug MoE model on CPU (2 gloo processes).

The GPUs are hidden from the runs, so this is the CPU path on every machine
(schedule "reference"). One run serves several tests: the baseline and UniEP
runs train STEPS steps and save a full DCP checkpoint at CHECKPOINT_STEP;
each resumed run restarts from one of those checkpoints and trains to STEPS.
On a 2-core machine a step takes about 5 s and a launch (start-up, checkpoint
load, teardown) about 20 s: launches, not steps, are what to save.
"""

import pytest
from torchtitan_release import requires_torchtitan

requires_torchtitan("0.2.2")  # the TorchTitan 0.2.2 edge

import json
import math
import os
import re
import shutil
import time
from pathlib import Path

import torch

from titan_uniep.tools.compare_loss import compare, load_run
from titan_uniep.testing import check_recorded_layers
from training import BASELINE, UNIEP, RunTimedOut, run_in_own_group, train

pytestmark = pytest.mark.slow

STEPS = 8
CHECKPOINT_STEP = 4
SMALL_BATCH = ("--training.local_batch_size", "2")
"""2 x 256 tokens per rank (the configs have 4): half the cost of a step."""
UNIEP_VS_BASELINE_RTOL = 1e-3
"""The reference schedule sums expert outputs in another order than
TorchTitan, so the curves drift apart by rounding; 10 CPU steps stay within
about 2e-5 relative."""
SAVE = ("--checkpoint.enable", "--checkpoint.interval", str(CHECKPOINT_STEP))


def assert_learns(losses: dict[int, float]) -> None:
    assert sorted(losses) == list(range(1, STEPS + 1))
    values = [losses[s] for s in sorted(losses)]
    assert all(math.isfinite(v) for v in values), values
    # Starts near ln(2048) = 7.6 and drops by more than half a nat.
    assert sum(values[-3:]) / 3 < sum(values[:3]) / 3 - 0.5, values


def resume(config: str, saved_by, dump_folder, *overrides: str, env=None):
    """Train ``config`` from ``saved_by``'s full checkpoint at CHECKPOINT_STEP
    (model, optimizer, lr scheduler, data loader, step) to STEPS, saving nothing."""
    checkpoint = saved_by.dump_folder / "checkpoint" / f"step-{CHECKPOINT_STEP}"
    return train(config, dump_folder, *SMALL_BATCH, "--checkpoint.enable", "--checkpoint.load_only",
                 "--checkpoint.initial_load_path", str(checkpoint), "--checkpoint.no_initial_load_model_only",
                 *overrides, steps=STEPS, env=env)


def resumed_steps() -> list[int]:
    return list(range(CHECKPOINT_STEP + 1, STEPS + 1))


def _train_and_save(config, dump_folder):
    run = train(config, dump_folder, *SMALL_BATCH, *SAVE, steps=STEPS)
    yield run
    shutil.rmtree(dump_folder / "checkpoint", ignore_errors=True)  # about 0.5 GB


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    yield from _train_and_save(BASELINE, tmp_path_factory.mktemp("baseline"))


@pytest.fixture(scope="module")
def uniep(tmp_path_factory):
    yield from _train_and_save(UNIEP, tmp_path_factory.mktemp("uniep"))


def test_deepseek_v3_baseline_learns_on_cpu(baseline):
    assert_learns(baseline.losses)


def test_deepseek_v3_uniep_reference_tracks_baseline(baseline, uniep):
    assert_learns(uniep.losses)
    result = compare(load_run(baseline.dump_folder), load_run(uniep.dump_folder))
    assert result.steps == list(range(1, STEPS + 1))
    assert result.max_rel <= UNIEP_VS_BASELINE_RTOL, f"max rel diff {result.max_rel:.3e}"


def test_a_cpu_run_keeps_its_logs_in_the_dump_folder_and_logs_no_gpu_only_noise(baseline, uniep):
    for run in (baseline, uniep):
        # Every rank's output under the dump folder (torchrun's --log-dir), no empty comm_traces/
        # (the flight recorder's dumps are NCCL's).
        assert [p.name for p in (run.dump_folder / "logs").glob("*/attempt_0/*/stderr.log")] == ["stderr.log"] * 2
        assert not (run.dump_folder / "comm_traces").exists()
        for noise in ("lspci", "Peak flops undefined", "may not have complete support on cpu device mesh"):
            assert noise not in run.output, noise
    # TorchTitan's build logs its standard MoE blocks; UniEP's run says what replaced them instead.
    assert "Standard MoE: num_experts=8" in baseline.output and "Standard MoE" not in uniep.output
    assert "UniEP: 5 MoE layers on schedule 'reference' (EP degree 2)" in uniep.output


# ---------------------------------------------------------------------------
# Checkpoint interchange: a resumed curve against the uninterrupted one.
# ---------------------------------------------------------------------------


def test_baseline_resumes_its_own_checkpoint_bitwise(baseline, tmp_path):
    # Same seed, deterministic mode: the harness itself (TorchTitan's own
    # resume included) must be reproducible, or no bitwise claim about UniEP
    # would mean anything.
    resumed = resume(BASELINE, baseline, tmp_path / "resumed")
    assert resumed.losses == {s: baseline.losses[s] for s in resumed_steps()}


def _link_or_copy(src, dst):
    try:
        os.link(src, dst)  # the checkpoint is only read
    except OSError:
        shutil.copy2(src, dst)


def test_a_run_resumed_into_its_dump_folder_keeps_one_loss_record_per_step(baseline, tmp_path):
    # The baseline's dump folder as a run killed after its checkpoint at CHECKPOINT_STEP
    # leaves it: loss.jsonl of steps 1..STEPS and that (full) checkpoint. Rerunning the
    # same command resumes from it and trains steps CHECKPOINT_STEP+1..STEPS again.
    dump = tmp_path / "run"
    checkpoint = f"checkpoint/step-{CHECKPOINT_STEP}"
    shutil.copytree(baseline.dump_folder / checkpoint, dump / checkpoint, copy_function=_link_or_copy)
    shutil.copyfile(baseline.dump_folder / "loss.jsonl", dump / "loss.jsonl")
    resumed = train(BASELINE, dump, *SMALL_BATCH, *SAVE, steps=STEPS)
    assert f"Loading the checkpoint from {dump / checkpoint}." in resumed.output
    logged = [json.loads(line)["step"] for line in (dump / "loss.jsonl").read_text().splitlines()]
    assert logged == list(range(1, STEPS + 1))  # not 1..8 and 5..8 again
    assert resumed.losses == baseline.losses  # the earlier run's steps, then the resumed ones: the same bits


@pytest.fixture(scope="module")
def uniep_resumed_with_planted_guard_difference(uniep, tmp_path_factory):
    """UniEP resumed from its own checkpoint with guard = "check" on every step
    and a one-bit difference planted in rank 1's recomputation at step 6
    (which leaves training's own bits alone)."""
    return resume(UNIEP, uniep, tmp_path_factory.mktemp("uniep_resumed"), "--uniep.guard", "check",
                  "--uniep.guard_interval", "1", env={"UNIEP_TEST_GUARD_FLIP": "6:1"})


def test_uniep_resumes_its_own_checkpoint_bitwise(uniep, uniep_resumed_with_planted_guard_difference):
    resumed = uniep_resumed_with_planted_guard_difference
    assert resumed.losses == {s: uniep.losses[s] for s in resumed_steps()}


def test_check_guard_names_layer_and_step_of_a_planted_difference_and_trains_on(
        uniep_resumed_with_planted_guard_difference):
    run = uniep_resumed_with_planted_guard_difference
    layer = "layers.5.moe.experts"  # guard_layer = -1: the last MoE layer
    for rank in (0, 1):
        verdicts = [line for line in run.rank_lines(rank) if "UniEP guard: layer" in line]
        # One verdict per resumed step, named with the trainer's step (not counted from the restart).
        assert [f"step {s}:" in v for s, v in zip(resumed_steps(), verdicts)] == [True] * len(resumed_steps()), verdicts
        for step, verdict in zip(resumed_steps(), verdicts):
            assert f"layer {layer} step {step}:" in verdict, verdict
            planted = rank == 1 and step == 6
            assert ("differs bitwise" in verdict and "in 1 of " in verdict) == planted, verdict
            assert ("bitwise equal" in verdict) != planted, verdict
    assert sorted(run.losses) == resumed_steps()  # trained on to the end


def test_baseline_checkpoint_resumes_under_uniep(baseline, tmp_path):
    resumed = resume(UNIEP, baseline, tmp_path / "resumed")
    result = compare(load_run(baseline.dump_folder), load_run(resumed.dump_folder))
    assert result.steps == resumed_steps()
    assert result.max_rel <= UNIEP_VS_BASELINE_RTOL, f"max rel diff {result.max_rel:.3e}"


def test_uniep_checkpoint_resumes_under_baseline(baseline, uniep, tmp_path):
    resumed = resume(BASELINE, uniep, tmp_path / "resumed")
    for uninterrupted in (baseline, uniep):
        result = compare(load_run(uninterrupted.dump_folder), load_run(resumed.dump_folder))
        assert result.steps == resumed_steps()
        assert result.max_rel <= UNIEP_VS_BASELINE_RTOL, f"max rel diff {result.max_rel:.3e}"


# ---------------------------------------------------------------------------
# Token-count extremes and the strict guard, in one short run: step 2 routes
# every token to experts 0..K-1 (all on EP rank 0), step 3 plants a one-bit
# difference on rank 1 under guard = "strict".
# ---------------------------------------------------------------------------

ONE_EXPERT_STEP = 2
PLANTED_STEP = 3
ORACLE_RTOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}
"""Per-token relative error against float64 (fp32: observed about 5e-7)."""


@pytest.fixture(scope="module")
def one_expert_then_strict_guard(tmp_path_factory):
    dump = tmp_path_factory.mktemp("one_expert_strict")
    env = {"UNIEP_TEST_ONE_EXPERT_STEP": str(ONE_EXPERT_STEP), "UNIEP_TEST_RECORD_DIR": str(dump / "record"),
           "UNIEP_TEST_GUARD_FLIP": f"{PLANTED_STEP}:1"}
    return train(UNIEP, dump, *SMALL_BATCH, "--uniep.guard", "strict", "--uniep.guard_interval", "1",
                 steps=PLANTED_STEP + 1, env=env, expect_failure=True)


def test_every_token_on_one_expert_drops_nothing_and_the_loss_stays_finite(one_expert_then_strict_guard):
    run = one_expert_then_strict_guard
    checked = check_recorded_layers(run.dump_folder / "record")
    # Every MoE layer of deepseek_v3 debugmodel (layer 0 is dense), both ranks.
    assert [(c.layer, c.rank) for c in checked] == [(f"layers.{i}.moe.experts", r) for i in range(1, 6) for r in (0, 1)]
    for c in checked:
        assert c.forced, f"{c.layer} rank {c.rank}: routing was not overridden"
        assert c.max_token_rel_err <= ORACLE_RTOL[c.dtype], c
    logged = [json.loads(line) for line in (run.dump_folder / "loss.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == [1, ONE_EXPERT_STEP], logged  # step 3 stopped in its forward
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in logged), logged


def test_strict_guard_stops_every_rank_at_the_planted_step(one_expert_then_strict_guard):
    run = one_expert_then_strict_guard
    message = (f"UniEP guard (strict): layer layers.5.moe.experts at step {PLANTED_STEP} is not bitwise equal to "
               "the non-overlapped schedule on at least one EP rank")
    # Every rank reaches the guard's error, rank 0 too, whose own bits matched:
    # the flag was all-reduced, so neither rank was left waiting in a
    # collective. Each logs it before raising; a rank exits 1 by itself, or is
    # stopped by torchrun (SIGTERM) once its peer has exited, after its log line.
    failures = run.failures()
    assert sorted(failures) == [0, 1], run.output[-4000:]
    for rank, failure in failures.items():
        assert any(message in line for line in run.rank_lines(rank)), f"rank {rank} never reached the guard's error"
        assert re.match(r"(exit code 1|stopped by torchrun \(SIGTERM\))", failure), f"rank {rank}: {failure}"
    assert any(f.startswith("exit code 1: ") and message in f for f in failures.values()), failures
    # The report ends with the first failed rank's error, not with torchrun's traceback.
    assert message in run.output.splitlines()[-1] and "ChildFailedError" not in run.output, run.output[-3000:]
    assert any(f"step {PLANTED_STEP}: output differs bitwise" in line for line in run.rank_lines(1))
    assert not any(f"step {PLANTED_STEP}: output differs bitwise" in line for line in run.rank_lines(0))


def _live_members(pgid: int) -> list[int]:
    """Processes of group ``pgid`` that are not zombies (Linux /proc)."""
    live = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        if int(fields[2]) == pgid and fields[0] != "Z":
            live.append(int(stat.parent.name))
    return live


def test_a_run_past_its_timeout_loses_its_whole_process_group():
    # A shell that starts two children and waits: all three must go at the timeout.
    with pytest.raises(RunTimedOut) as info:
        run_in_own_group(["bash", "-c", "sleep 300 & sleep 300 & wait"], env={}, timeout_s=1)
    deadline = time.monotonic() + 5
    while _live_members(info.value.pgid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _live_members(info.value.pgid) == []
