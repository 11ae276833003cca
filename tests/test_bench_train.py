"""titan_uniep.tools.bench_train: options, commands, statistics and report on synthetic runs; then
the tool end to end on CPU (the EP = 1 tiny pair of test_train_ep1_cpu.py), and a failing run."""

import pytest
from torchtitan_release import requires_torchtitan

requires_torchtitan("0.2.2")  # the TorchTitan 0.2.2 edge

import json
import os
import re
import statistics
import sys
from pathlib import Path

from test_train_ep1_cpu import CPU_OVERRIDES, UNIEP_VS_BASELINE_RTOL
from training import REPO, run_in_own_group

from titan_uniep.tools import bench_train
from titan_uniep.tools.bench_train import (
    Report, loss_difference, main, parse_args, plan_runs, read_records, record_run, run_stats, side_summary,
    tps_ratio,
)

EP1_PAIR = ("--baseline", "train_configs/qwen3_debug_moe_ep1_baseline.toml",
            "--uniep", "train_configs/qwen3_debug_moe_ep1_uniep.toml")


def step(n, tps, step_time=0.1, loss=8.0, **extra):
    return {"step": n, "loss": loss, "max_loss": loss, "grad_norm": 1.0, "time": 0.1 * n, "tps": tps,
            "tflops": tps / 1000, "mfu_pct": tps / 10_000, "step_time": step_time, **extra}


def write_loss_jsonl(folder: Path, records: list[dict]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "loss.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return folder


# ---------------------------------------------------------------- statistics


def test_run_medians_leave_out_the_warmup_steps_and_memory_takes_their_largest_peak():
    # Warm-up steps are slow and hold more memory (start-up, first allocations).
    records = [step(1, 10.0, 5.0, mem_reserved_peak_gib=9.0), step(2, 50.0, 2.0, mem_reserved_peak_gib=8.0)]
    tps = [100.0, 104.0, 98.0, 102.0, 300.0]
    for n, (t, mem) in enumerate(zip(tps, [1.0, 2.0, 3.0, 2.0, 1.0]), start=3):
        records.append(step(n, t, step_time=1.0 / t, mem_reserved_peak_gib=mem))
    stats = run_stats(records, warmup=2)
    assert stats["tps"] == 102.0
    assert statistics.median(r["tps"] for r in records) != 102.0  # so the warm-up really is left out
    assert stats["step_time"] == pytest.approx(1.0 / 102.0)
    assert stats["mem_reserved_peak_gib"] == 3.0
    assert (stats["first_step"], stats["last_step"], stats["measured_steps"]) == (3, 7, 5)


def test_the_peak_memory_adds_the_symmetric_memory_the_reserved_figure_leaves_out():
    gib = 2**30
    records = [step(1, 10.0, mem_reserved_peak_gib=9.0, mem_symmetric=0)]  # warm-up
    records += [step(n, 100.0, mem_reserved_peak_gib=mem, mem_symmetric=sym)
                for n, mem, sym in ((2, 4.0, gib // 2), (3, 3.0, 2 * gib), (4, 3.5, gib))]
    stats = run_stats(records, warmup=1)
    assert stats["mem_reserved_peak_gib"] == 4.0 and stats["mem_symmetric_gib"] == 2.0
    assert stats["mem_peak_gib"] == 5.0  # step 3: 3.0 reserved + 2.0 symmetric
    # A run without UniEP's kernels, or without a GPU, records no symmetric memory: the reserved peak alone.
    records[2]["mem_device_used"] = 6 * gib
    assert run_stats(records, warmup=1)["mem_device_used_gib"] == 6.0
    plain = run_stats([step(n, 100.0, mem_reserved_peak_gib=2.0 + n) for n in (1, 2, 3)], warmup=1)
    assert plain["mem_peak_gib"] == plain["mem_reserved_peak_gib"] == 5.0 and plain["mem_symmetric_gib"] is None


def test_with_sparse_logging_only_windows_wholly_after_the_warmup_count():
    # metrics.log_freq = 10 (TorchTitan's default): step 10's figures cover steps 2-10, warm-up included.
    records = [step(1, 5.0), step(10, 50.0)] + [step(n, 100.0 + n) for n in (20, 30, 40)]
    stats = run_stats(records, warmup=10)
    assert (stats["first_step"], stats["last_step"], stats["measured_steps"]) == (20, 40, 3)
    assert stats["tps"] == 130.0
    assert run_stats(records, warmup=9)["first_step"] == 20  # step 10's window starts at step 2


def test_fields_a_cpu_run_does_not_report_are_none():
    records = [{k: v for k, v in step(n, 100.0 + n).items() if k != "mfu_pct"} for n in range(1, 4)]
    stats = run_stats(records, warmup=1)
    assert stats["mfu_pct"] is None and stats["mem_reserved_peak_gib"] is None and stats["mem_active_peak_gib"] is None
    assert stats["mem_peak_gib"] is None
    assert stats["tps"] == 102.5


def test_a_resumed_run_keeps_the_last_record_of_a_step(tmp_path):
    folder = write_loss_jsonl(tmp_path / "run", [step(1, 1.0), step(2, 2.0), step(2, 20.0), step(3, 3.0)])
    assert [r["tps"] for r in read_records(folder)] == [1.0, 20.0, 3.0]


def test_no_step_after_the_warmup_and_a_file_without_tps_are_errors_naming_the_fix():
    with pytest.raises(ValueError, match=r"no logged step after the 3 warm-up steps .*lower --warmup"):
        run_stats([step(n, 1.0) for n in (1, 2, 3)], warmup=3)
    old = [{"step": n, "loss": 8.0, "grad_norm": 1.0, "time": 0.1} for n in (1, 2, 3)]
    with pytest.raises(ValueError, match=r"run/loss.jsonl: steps \[2, 3\] have no 'tps'.*run_train.sh"):
        run_stats(old, warmup=1, source="run/loss.jsonl")


def test_sides_are_the_median_of_their_runs_and_the_ratio_spans_the_runs_extremes():
    baseline = side_summary([run_stats([step(1, 1.0), step(2, t)], warmup=1) for t in (100.0, 110.0, 90.0)])
    uniep = side_summary([run_stats([step(1, 1.0), step(2, t)], warmup=1) for t in (130.0, 120.0, 125.0)])
    assert (baseline["tps"], baseline["tps_min"], baseline["tps_max"]) == (100.0, 90.0, 110.0)
    assert uniep["tps"] == 125.0
    ratio, low, high = tps_ratio(baseline, uniep)
    assert ratio == pytest.approx(1.25)
    assert low == pytest.approx(120.0 / 110.0) and high == pytest.approx(130.0 / 90.0)


def test_loss_difference_is_compare_loss_against_the_reference_run(tmp_path):
    losses = [8.0, 7.5, 7.0, 6.5]
    ref = write_loss_jsonl(tmp_path / "ref", [step(n, 1.0, loss=x) for n, x in enumerate(losses, 1)])
    off = [8.0, 7.5 * (1 + 2e-6), 7.0 * (1 - 4e-6), 6.5]
    run = write_loss_jsonl(tmp_path / "run", [step(n, 1.0, loss=x) for n, x in enumerate(off, 1)])
    diff = loss_difference(ref, run)
    assert diff["loss_max_rel_diff"] == pytest.approx(4e-6, rel=1e-6)
    assert diff["loss_mean_rel_diff"] == pytest.approx(6e-6 / 4, rel=1e-6)
    assert diff["loss_common_steps"] == 4 and not diff["loss_bitwise"]


# ---------------------------------------------------------------- options and commands


def _rejected(argv, match):
    with pytest.raises(ValueError, match=match):
        parse_args(list(argv))


def test_option_values_that_cannot_work_are_rejected_naming_the_option():
    _rejected(["--steps", "5", "--warmup", "5"], r"--warmup 5 with --steps 5: .*raise --steps or lower --warmup")
    _rejected(["--warmup", "-1"], r"--warmup -1 with --steps 40")
    _rejected(["--runs", "1"], r"--runs 1: give at least 2 runs per side")
    _rejected(["--ngpu", "0"], r"--ngpu 0")
    _rejected(["--tuning", "off", "--tuning-cache", "t.json"], r"--tuning-cache .* with --tuning off")


@pytest.mark.parametrize("override, option", [
    ("--training.steps", "--steps"),
    ("--job.dump_folder=x", "--out"),
    ("--debug.deterministic", "--deterministic"),
    ("--debug.no-deterministic", "--deterministic"),
    ("--compile.no_enable", "--compile"),
    ("--activation-checkpoint.mode", "--ac-mode"),
    ("--uniep.schedule", "--schedule, --tuning and --tuning-cache"),
])
def test_overrides_this_tool_sets_itself_point_to_its_option(override, option):
    _rejected(["--", override, "1"], re.escape(option))


def test_a_torchtitan_override_before_the_separator_is_told_to_go_after_it(capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(["--training.local_batch_size", "4"])
    assert exc.value.code == 2
    assert "TorchTitan overrides go after --" in capsys.readouterr().err


def test_runs_alternate_and_each_side_gets_exactly_its_overrides(tmp_path):
    args = parse_args(["--ngpu", "2", "--runs", "3", "--steps", "7", "--compile", "--ac-mode", "full",
                       "--schedule", "sequential", "--tuning", "cached", "--tuning-cache", "t.json",
                       "--out", str(tmp_path), "--", "--parallelism.expert_parallel_degree", "1"])
    runs = plan_runs(args)
    assert [(r.side, r.index, r.order) for r in runs] == [
        ("baseline", 1, 1), ("uniep", 1, 2), ("baseline", 2, 3), ("uniep", 2, 4), ("baseline", 3, 5), ("uniep", 3, 6)]
    for run in runs:
        assert run.env["NGPU"] == "2" and run.env["CONFIG_FILE"].endswith(f"qwen3_30b_a3b_4l_{run.side}.toml")
        assert run.argv[0].endswith("run_train.sh")
        tail = run.argv[1:]
        assert tail[:5] == ["--training.steps", "7", "--job.dump_folder", str(tmp_path / f"{run.side}_{run.index}"),
                            "--debug.no-deterministic"]
        assert "--compile.enable" in tail and tail[tail.index("--activation_checkpoint.mode") + 1] == "full"
        assert tail[-2:] == ["--parallelism.expert_parallel_degree", "1"]  # the user's overrides last: they win
        uniep_only = ["--uniep.schedule", "sequential", "--uniep.tuning", "cached", "--uniep.tuning_cache", "t.json"]
        assert (" ".join(uniep_only) in " ".join(tail)) == (run.side == "uniep")
        assert run.command.startswith("NGPU=2 CONFIG_FILE=") and "run_train.sh --training.steps 7" in run.command
    deterministic = plan_runs(parse_args(["--deterministic", "--out", str(tmp_path)]))
    assert all("--debug.deterministic" in r.argv and "--debug.no-deterministic" not in r.argv for r in deterministic)


def test_configs_are_checked_before_any_run_starts(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["--baseline", EP1_PAIR[3], "--uniep", EP1_PAIR[3], "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "--baseline train_configs/qwen3_debug_moe_ep1_uniep.toml has [uniep] enable = true" in err, err
    assert main([*EP1_PAIR, "--out", str(out), "--", "--parallelism.expert_parallel_degree", "2"]) == 2
    err = capsys.readouterr().err
    assert "baseline side" in err and "NGPU (WORLD_SIZE) = 1 does not fit" in err, err
    assert "Here NGPU is --ngpu" in err, err
    assert not out.exists()
    out.mkdir()
    (out / "old").write_text("")
    assert main([*EP1_PAIR, "--out", str(out)]) == 2
    assert "is not empty" in capsys.readouterr().err


# ---------------------------------------------------------------- report


def test_report_tables_json_lines_and_plots_come_from_the_runs_records(tmp_path):
    args = parse_args(["--steps", "4", "--warmup", "1", "--out", str(tmp_path)])
    report = Report(meta=bench_train.environment(args))
    tps = {("baseline", 1): 1000.0, ("uniep", 1): 1500.0, ("baseline", 2): 1100.0, ("uniep", 2): 1400.0}
    for spec in plan_runs(args):
        t = tps[spec.side, spec.index]
        records = [step(1, 1.0, loss=8.0)] + [step(n, t + n, 1.0 / t, loss=8.0 - n * 0.1, mem_reserved_peak_gib=2.0)
                                              for n in (2, 3, 4)]
        if spec.side == "uniep":
            records[-1]["loss"] *= 1 + 1e-6
        write_loss_jsonl(spec.dump_folder, records)
        row = record_run(report, spec, wall_s=12.3, warmup=1, reference=tmp_path / "baseline_1")
        assert row["tps"] == t + 3
    assert bench_train.progress_line(report.runs[1], 4) == (
        "[2/4] uniep run 1: 4 logged steps, 1,503 tok/s/device (median of steps 2-4), 2.0 GiB peak, 12 s")

    table = bench_train.markdown(report)
    assert "| baseline 1 | 1,003 |" in table and "| reference |" in table
    assert "| **baseline** (median of 2) | **1,053** (1,003-1,103) |" in table
    assert "| **uniep / baseline** | **1.38x** (1.27x-1.50x) |" in table
    assert "medians over steps 2-4 (warm-up: step 1)" in table

    lines = [json.loads(line) for line in report.json_lines()]
    assert [(r["kind"], r["side"]) for r in lines] == [("run", "baseline"), ("run", "uniep"), ("run", "baseline"),
                                                      ("run", "uniep"), ("summary", "baseline"), ("summary", "uniep")]
    for line in lines:
        for key in ("date", "git_commit", "hostname", "torch", "triton", "torchtitan", "ngpu", "steps", "warmup"):
            assert key in line, key
    uniep = lines[-1]
    assert uniep["tps"] == statistics.median([1503.0, 1403.0])
    assert uniep["tps_ratio"] == pytest.approx(1453.0 / 1053.0)
    assert uniep["loss_max_rel_diff"] == pytest.approx(1e-6, rel=1e-3)
    assert len(uniep["commands"]) == 2 and lines[-2]["loss_max_rel_diff"] == 0.0  # baseline 2 equals baseline 1

    bench_train.plot(report, tmp_path)
    for name in ("tps.png", "loss.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------- end to end (CPU)


def _bench(tmp_path, *argv, timeout_s=300):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    cmd = [sys.executable, "-m", "titan_uniep.tools.bench_train", *EP1_PAIR, "--ngpu", "1", "--out", str(tmp_path / "out"),
           *argv]
    return run_in_own_group(cmd, env=env, timeout_s=timeout_s)


@pytest.mark.slow
def test_cpu_benchmark_of_the_ep1_pair_reports_torchtitans_figures_and_equal_losses(tmp_path):
    returncode, output = _bench(tmp_path, "--steps", "3", "--warmup", "1", "--runs", "2", "--schedule", "fused",
                                "--", *CPU_OVERRIDES)
    assert returncode == 0, output[-6000:]
    out = tmp_path / "out"
    progress = re.findall(r"^\[(\d)/4\] (baseline|uniep) run (\d): 3 logged steps, [\d,]+ tok/s/device "
                          r"\(median of steps 2-3\), [\d.]+ GiB peak, \d+ s$", output, re.MULTILINE)
    alternating = [("1", "baseline", "1"), ("2", "uniep", "1"), ("3", "baseline", "2"), ("4", "uniep", "2")]
    assert progress == alternating, output
    table = (out / "bench_train.md").read_text()
    assert table in output
    for row in ("| baseline 1 |", "| uniep 1 |", "| baseline 2 |", "| uniep 2 |", "| **uniep / baseline** |"):
        assert row in table

    lines = [json.loads(line) for line in (out / "bench_train.jsonl").read_text().splitlines()]
    runs, summaries = lines[:4], {line["side"]: line for line in lines[4:]}
    assert [line["kind"] for line in lines] == ["run"] * 4 + ["summary"] * 2
    assert sorted(summaries) == ["baseline", "uniep"]
    for line in runs:
        assert line["device"].startswith("CPU") and line["torchtitan"] == "0.2.2" and line["git_commit"]
        assert line["command"].startswith("NGPU=1 CONFIG_FILE=") and "--debug.no-deterministic" in line["command"]
        assert ("--uniep.schedule fused" in line["command"]) == (line["side"] == "uniep")
        folder = Path(line["dump_folder"])
        records = read_records(folder)
        assert [r["step"] for r in records] == [1, 2, 3]
        # The figures are TorchTitan's own: its log line prints the same tps at every step.
        logged = [int(t.replace(",", "")) for t in re.findall(r"step:\s+\d+\s+loss:.*tps: ([\d,]+)",
                                                               (folder / "train.log").read_text())]
        assert logged == [round(r["tps"]) for r in records]
        assert line["tps"] == statistics.median(r["tps"] for r in records[1:])
        assert line["step_time"] == statistics.median(r["step_time"] for r in records[1:])
        assert line["mem_reserved_peak_gib"] == max(r["mem_reserved_peak_gib"] for r in records[1:])
        if (line["side"], line["run"]) != ("baseline", 1):
            assert line["loss_max_rel_diff"] <= UNIEP_VS_BASELINE_RTOL, line
    for side, summary in summaries.items():
        assert summary["tps"] == statistics.median(line["tps"] for line in runs if line["side"] == side)
    assert summaries["uniep"]["tps_ratio"] == summaries["uniep"]["tps"] / summaries["baseline"]["tps"]
    for name in ("tps.png", "loss.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_a_failing_run_stops_the_benchmark_naming_the_run_its_exit_code_and_its_log(tmp_path):
    returncode, output = _bench(tmp_path, "--steps", "2", "--warmup", "1", "--", *CPU_OVERRIDES,
                                "--training.dataset", "no_such_dataset")
    assert returncode == 2, output[-6000:]
    log = tmp_path / "out" / "baseline_1" / "train.log"
    assert f"error: [1/4] baseline run 1 exited with code 1; its log is {log}" in output, output[-6000:]
    assert "Dataset no_such_dataset is not supported" in output  # the tail of the run's own log
    assert log.is_file() and not (tmp_path / "out" / "uniep_1").exists()
