"""Training benchmark: TorchTitan's own MoE path against UniEP's, trained end to end.

    python -m titan_uniep.tools.bench_train [--baseline CFG] [--uniep CFG] [--ngpu N]
        [--steps 40] [--warmup 5] [--runs 2] [--compile] [--ac-mode none|selective|full]
        [--deterministic] [--schedule S] [--tuning off|cached|search] [--tuning-cache PATH]
        [--out DIR] [--run-timeout S] [-- TORCHTITAN OVERRIDES ...]

Trains the baseline config and the UniEP config through ``./run_train.sh``,
the entry point users launch (``NGPU``, ``CONFIG_FILE``, TorchTitan overrides),
one run at a time, alternating: baseline 1, uniep 1, baseline 2, uniep 2, ...
(``--runs`` each), so a drift of the machine (clocks, temperature, neighbours)
falls on both sides alike. Overrides after ``--`` go to both sides, e.g.
``-- --parallelism.expert_parallel_degree 1 --training.local_batch_size 4``;
``--schedule``, ``--tuning`` and ``--tuning-cache`` only to the UniEP side.
Both sides train with ``[debug] deterministic = false``, as TorchTitan users
run, unless ``--deterministic`` is given (the bundled configs say ``true``;
the override is explicit both ways).

Every run's figures are TorchTitan's own, as its step log line prints them,
read from the ``loss.jsonl`` that ``titan_uniep.torchtitan.train`` writes on rank 0 (see
its docstring): tokens per second per device (``tps``), step time, MFU,
TFLOP/s, and the peak reserved memory, each over the steps since the
previous logged step (``metrics.log_freq``). Per run, the medians over the
logged steps whose window lies after ``--warmup`` (memory: the largest peak
over them); per side,
the median of the runs' figures with their min-max; the ratio uniep / baseline
of tokens/s, with its range from the runs' extremes. Each run's loss curve is
compared with baseline run 1 (``titan_uniep.tools.compare_loss``: the largest and
the mean relative difference over the common steps); the other baseline runs
give the run-to-run spread to read that against.

Writes, under ``--out`` (default ``out/bench_train/<timestamp>``):

- ``bench_train.md``: the table (also printed), the notes and every command;
- ``bench_train.jsonl``: one line per run and one summary line per side, with
  date, git commit, host, torch / triton / torchtitan versions, the device and
  the exact command of each run;
- ``tps.png`` (tokens/s per step of every run, warm-up shaded) and ``loss.png``
  (every run's loss, and its relative difference to baseline run 1);
- ``<side>_<i>/``: each run's dump folder (``loss.jsonl``) and its full log
  ``train.log``.

Exit status: 0 after a complete benchmark; 2 on a bad option or config, or
when a run fails (the message names the run, its exit code and the end of its
log).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

from titan_uniep.tools.compare_loss import LOSS_FILE, compare, load_run
from titan_uniep.config import SCHEDULE_NAMES, TUNING_MODES

REPO = Path(__file__).resolve().parents[2]
RUN_TRAIN = REPO / "run_train.sh"
DEFAULT_BASELINE = "train_configs/qwen3_30b_a3b_4l_baseline.toml"
DEFAULT_UNIEP = "train_configs/qwen3_30b_a3b_4l_uniep.toml"
SIDES = ("baseline", "uniep")
AC_MODES = ("none", "selective", "full")
LOG_FILE = "train.log"
TABLE_FILE = "bench_train.md"
JSONL_FILE = "bench_train.jsonl"
TPS_PLOT = "tps.png"
LOSS_PLOT = "loss.png"
LOG_TAIL_LINES = 40
DEFAULT_RUN_TIMEOUT_S = 3600
"""A run that hangs (a stuck collective past TorchTitan's own comm timeouts)
ends the benchmark instead of holding the GPUs forever; a real 40-step run of
the bundled qwen3 pair, with start-up and compilation, takes minutes."""

MEDIAN_FIELDS = ("tps", "step_time", "mfu_pct", "tflops")
"""loss.jsonl fields summarised by their median over the steps after warm-up."""
PEAK_FIELDS = ("mem_peak_gib", "mem_reserved_peak_gib", "mem_active_peak_gib", "mem_symmetric_gib",
               "mem_device_used_gib")
"""Figures summarised by their largest value over those steps: loss.jsonl's
reserved and active peaks; ``mem_symmetric_gib``, the symmetric memory
UniEP's workspaces hold (loss.jsonl's ``mem_symmetric``: PyTorch maps it
outside its caching allocator, so TorchTitan's figure leaves it out; 0 in a
baseline run, absent without a GPU); ``mem_peak_gib``, the reserved peak
plus it, the table's peak memory; and ``mem_device_used_gib``, the device's
used memory after a step (loss.jsonl's ``mem_device_used``), a cross-check
that counts everything on the device."""

_OWNED_OVERRIDES = {
    "training.steps": "--steps",
    "job.dump_folder": "--out (each run's dump folder is <out>/<side>_<i>)",
    "job.config_file": "--baseline / --uniep",
    "debug.deterministic": "--deterministic (without it both sides get --debug.no-deterministic)",
    "compile.enable": "--compile",
    "activation_checkpoint.mode": "--ac-mode",
}
"""TorchTitan options this tool sets on every run -> the option of this tool that sets them."""


# ---------------------------------------------------------------- options


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Parse and check the command line; ``args.overrides`` holds what follows ``--``.

    Raises:
        ValueError: an option value that cannot work, naming the option and the fix.
    """
    own, overrides = (argv[: argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(
        prog="python -m titan_uniep.tools.bench_train", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="TorchTitan overrides for both sides go after --, e.g. -- --parallelism.expert_parallel_degree 1. "
               f"Writes {TABLE_FILE}, {JSONL_FILE}, {TPS_PLOT}, {LOSS_PLOT} and <side>_<i>/ (dump folder, "
               f"{LOG_FILE}) under --out.",
    )
    parser.add_argument("--baseline", default=DEFAULT_BASELINE,
                        help=f"baseline TOML config, TorchTitan's own MoE path (default {DEFAULT_BASELINE})")
    parser.add_argument("--uniep", default=DEFAULT_UNIEP,
                        help=f"UniEP TOML config, [uniep] enable = true (default {DEFAULT_UNIEP})")
    parser.add_argument("--ngpu", type=int, default=1, help="processes per run, NGPU of run_train.sh (default 1)")
    parser.add_argument("--steps", type=int, default=40, help="training steps per run (default 40)")
    parser.add_argument("--warmup", type=int, default=5, help="first steps left out of every median (default 5)")
    parser.add_argument("--runs", type=int, default=2,
                        help="runs per side, alternating baseline and uniep (default 2)")
    parser.add_argument("--compile", action="store_true", help="torch.compile on both sides (--compile.enable)")
    parser.add_argument("--ac-mode", choices=AC_MODES,
                        help="activation_checkpoint.mode on both sides (default: the configs')")
    parser.add_argument("--deterministic", action="store_true",
                        help="[debug] deterministic = true on both sides (default: false, as TorchTitan users train)")
    parser.add_argument("--schedule", choices=SCHEDULE_NAMES,
                        help="uniep side's --uniep.schedule (default: the config's)")
    parser.add_argument("--tuning", choices=TUNING_MODES, help="uniep side's --uniep.tuning (default: the config's)")
    parser.add_argument("--tuning-cache", help="uniep side's --uniep.tuning_cache (a JSON file)")
    parser.add_argument("--out", type=Path, help="output folder (default: out/bench_train/<timestamp>)")
    parser.add_argument("--run-timeout", type=float, default=DEFAULT_RUN_TIMEOUT_S,
                        help=f"seconds a run may take before it is killed (default {DEFAULT_RUN_TIMEOUT_S})")
    args, unknown = parser.parse_known_args(own)
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}; TorchTitan overrides go after --, "
                     f"e.g. python -m titan_uniep.tools.bench_train -- {' '.join(unknown)}")
    args.overrides = overrides
    check_args(args)
    if args.out is None:
        args.out = Path("out", "bench_train", datetime.now().strftime("%Y%m%d-%H%M%S"))
    return args


def check_args(args: argparse.Namespace) -> None:
    """The checks that need no config file: counts, and overrides this tool owns."""
    if args.ngpu < 1:
        raise ValueError(f"--ngpu {args.ngpu}: give the number of processes per run, at least 1")
    if args.steps < 1:
        raise ValueError(f"--steps {args.steps}: give at least 1 step, and more than --warmup")
    if not 0 <= args.warmup < args.steps:
        raise ValueError(
            f"--warmup {args.warmup} with --steps {args.steps}: the medians are over steps warmup+1..steps, so "
            f"--warmup must be at least 0 and less than --steps; raise --steps or lower --warmup"
        )
    if args.runs < 2:
        raise ValueError(f"--runs {args.runs}: give at least 2 runs per side; one run per side has no spread "
                         "to tell a speed-up from the run-to-run variation")
    if args.run_timeout <= 0:
        raise ValueError(f"--run-timeout {args.run_timeout}: give the seconds a run may take, more than 0")
    if args.tuning_cache and args.tuning == "off":
        raise ValueError("--tuning-cache is read by --tuning cached and written by --tuning search; "
                         "with --tuning off it would be ignored: drop one of them")
    for arg in args.overrides:
        key = override_key(arg)
        if key is None:
            continue
        if key in _OWNED_OVERRIDES:
            raise ValueError(f"override {arg} (after --): this tool sets {key} on every run; "
                             f"use {_OWNED_OVERRIDES[key]}")
        if key.startswith("uniep."):
            raise ValueError(
                f"override {arg} (after --): overrides go to both sides, and the baseline runs TorchTitan's own "
                "path; the uniep side's options are --schedule, --tuning and --tuning-cache (other [uniep] keys "
                "belong in the uniep config)"
            )


def override_key(arg: str) -> str | None:
    """The TorchTitan key an override sets (``--compile.no-enable=x`` -> ``compile.enable``); None for a value."""
    if not arg.startswith("--"):
        return None
    key = arg[2:].split("=", 1)[0].replace("-", "_")
    section, _, name = key.rpartition(".")
    if name.startswith("no_"):  # tyro's spelling of a false bool
        name = name[3:]
    return f"{section}.{name}" if section else name


# ---------------------------------------------------------------- the runs


@dataclass
class RunSpec:
    """One training run: which side, where it writes, and the exact command."""

    side: str
    index: int
    """1-based among its side's runs."""
    order: int
    """1-based position in the launch sequence."""
    dump_folder: Path
    env: dict[str, str]
    """The variables run_train.sh reads (NGPU, CONFIG_FILE), on top of this process's environment."""
    argv: list[str]
    """./run_train.sh and its TorchTitan overrides."""

    @property
    def name(self) -> str:
        return f"{self.side} run {self.index}"

    @property
    def command(self) -> str:
        return " ".join([*(f"{k}={shlex.quote(v)}" for k, v in self.env.items()), shlex.join(self.argv)])


def resolve_config(path: str) -> str:
    """The config path as run_train.sh resolves it: the working directory first, then this checkout."""
    if Path(path).is_file() or Path(path).is_absolute() or not (REPO / path).is_file():
        return path
    return str(REPO / path)


def side_overrides(args: argparse.Namespace, side: str, dump_folder: Path) -> list[str]:
    """TorchTitan overrides of one run: this tool's, then the uniep side's own, then the user's (both sides)."""
    overrides = ["--training.steps", str(args.steps), "--job.dump_folder", str(dump_folder),
                 "--debug.deterministic" if args.deterministic else "--debug.no-deterministic"]
    if args.compile:
        overrides.append("--compile.enable")
    if args.ac_mode:
        overrides += ["--activation_checkpoint.mode", args.ac_mode]
    if side == "uniep":
        if args.schedule:
            overrides += ["--uniep.schedule", args.schedule]
        if args.tuning:
            overrides += ["--uniep.tuning", args.tuning]
        if args.tuning_cache:
            overrides += ["--uniep.tuning_cache", args.tuning_cache]
    return overrides + list(args.overrides)


def plan_runs(args: argparse.Namespace) -> list[RunSpec]:
    """Every run in launch order: baseline 1, uniep 1, baseline 2, uniep 2, ..."""
    launcher = "./run_train.sh" if Path.cwd().resolve() == REPO else str(RUN_TRAIN)
    configs = {"baseline": resolve_config(args.baseline), "uniep": resolve_config(args.uniep)}
    runs = []
    for index in range(1, args.runs + 1):
        for side in SIDES:
            dump_folder = args.out / f"{side}_{index}"
            runs.append(RunSpec(side, index, len(runs) + 1, dump_folder,
                                env={"NGPU": str(args.ngpu), "CONFIG_FILE": configs[side]},
                                argv=[launcher, *side_overrides(args, side, dump_folder)]))
    return runs


def check_configs(runs: list[RunSpec]) -> None:
    """What run_train.sh would reject, for both sides, before the first run starts.

    Runs ``titan_uniep.torchtitan.preflight`` (config file, NGPU against the parallel
    degrees, the [uniep] section) on each side's first run, and checks that
    the baseline trains TorchTitan's own path and the uniep config UniEP's.
    """
    from titan_uniep.torchtitan.preflight import load_config_file, preflight

    if not RUN_TRAIN.is_file():
        raise ValueError(f"{RUN_TRAIN} not found: run the benchmark from a titan_uniep checkout")
    for side in SIDES:
        spec = next(run for run in runs if run.side == side)
        option = f"--{side}"
        config = spec.env["CONFIG_FILE"]
        uniep = load_config_file(config).get("uniep", {})
        if side == "baseline" and uniep.get("enable", False):
            raise ValueError(f"{option} {config} has [uniep] enable = true; the baseline must train TorchTitan's own "
                             "MoE path: pass its *_baseline.toml twin")
        if side == "uniep" and not uniep.get("enable", False):
            raise ValueError(f"{option} {config} does not set [uniep] enable = true, so it would train TorchTitan's "
                             "own path; pass a UniEP config (e.g. its *_uniep.toml twin)")
        try:
            preflight(["--job.config_file", config, *spec.argv[1:]], world_size=int(spec.env["NGPU"]))
        except ValueError as err:
            raise ValueError(f"{side} side ({config}, NGPU={spec.env['NGPU']}): {err} (Here NGPU is --ngpu, and "
                             "a TorchTitan key is set for both sides by an override after --, e.g. "
                             "-- --parallelism.expert_parallel_degree 1.)") from None


class RunFailed(Exception):
    """A run exited non-zero, ran past its timeout, or left no usable loss.jsonl."""


def launch(spec: RunSpec, timeout_s: float) -> float:
    """Run ``spec`` to completion with its output in ``<dump_folder>/train.log``; return its wall seconds.

    The run gets its own process group, so a timeout or an interrupt ends
    torchrun's workers too. Raises RunFailed naming the run, its exit code and
    the end of its log.
    """
    spec.dump_folder.mkdir(parents=True, exist_ok=True)
    log_path = spec.dump_folder / LOG_FILE
    start = time.perf_counter()
    with open(log_path, "w", encoding="utf-8") as log:
        proc = subprocess.Popen(spec.argv, env={**os.environ, **spec.env}, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            returncode = proc.wait(timeout=timeout_s)
        except BaseException as exc:
            _kill_group(proc)
            if isinstance(exc, subprocess.TimeoutExpired):
                raise RunFailed(f"{spec.name} ran past --run-timeout {timeout_s:g} s and was killed; "
                                f"{_log_tail(log_path)}") from None
            raise
    if returncode != 0:
        raise RunFailed(f"{spec.name} exited with code {returncode}; {_log_tail(log_path)}")
    return time.perf_counter() - start


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _log_tail(log_path: Path) -> str:
    lines = log_path.read_text(encoding="utf-8", errors="replace").splitlines()
    tail = "\n".join(lines[-LOG_TAIL_LINES:])
    return f"its log is {log_path}; its last {min(len(lines), LOG_TAIL_LINES)} lines:\n{tail}"


# ---------------------------------------------------------------- statistics (pure)


def read_records(dump_folder: Path) -> list[dict]:
    """The loss.jsonl records of a run, by step; a step logged twice (a resumed run) keeps its last record."""
    path = Path(dump_folder) / LOSS_FILE
    if not path.is_file():
        raise ValueError(f"{path} does not exist: the run logged no step")
    records = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            record = json.loads(line)
            records[int(record["step"])] = record
    return [records[step] for step in sorted(records)]


def run_stats(records: list[dict], warmup: int, source: str = "loss.jsonl") -> dict:
    """One run's figures over its logged steps after ``warmup``.

    TorchTitan's figures of a logged step cover the steps since the previous
    logged one (every step at ``metrics.log_freq = 1``; ten at its default):
    a logged step counts only if its whole window comes after the warm-up,
    i.e. the previous logged step is ``warmup`` or later.

    Returns the median of each of ``MEDIAN_FIELDS``, the largest of each of
    ``PEAK_FIELDS`` (None where no step has the field, e.g. memory on a
    machine that does not report it), and ``first_step``, ``last_step``,
    ``measured_steps`` (the logged steps they cover).

    Raises:
        ValueError: no logged step after the warm-up, or steps without TorchTitan's ``tps``.
    """
    previous = [0] + [r["step"] for r in records[:-1]]
    measured = [r for r, before in zip(records, previous) if before >= warmup]
    if not measured:
        logged = [r["step"] for r in records]
        raise ValueError(f"{source}: no logged step after the {warmup} warm-up steps (logged steps: {logged}); "
                         "raise --steps or lower --warmup")
    lacking = [r["step"] for r in measured if r.get("tps") is None]
    if lacking:
        raise ValueError(f"{source}: steps {lacking} have no 'tps': it was written by a titan_uniep.torchtitan.train that "
                         "did not record TorchTitan's step metrics; train with this checkout's run_train.sh")
    stats = {"first_step": measured[0]["step"], "last_step": measured[-1]["step"], "measured_steps": len(measured)}
    measured = [{**r, **_memory_figures(r)} for r in measured]
    for name in MEDIAN_FIELDS:
        values = [r[name] for r in measured if r.get(name) is not None]
        stats[name] = statistics.median(values) if values else None
    for name in PEAK_FIELDS:
        values = [r[name] for r in measured if r.get(name) is not None]
        stats[name] = max(values) if values else None
    return stats


def side_summary(per_run: list[dict]) -> dict:
    """For each figure of ``run_stats``: the median over the runs, and the runs' min and max
    (``<name>_min``, ``<name>_max``)."""
    summary = {}
    for name in MEDIAN_FIELDS + PEAK_FIELDS:
        values = [stats[name] for stats in per_run if stats[name] is not None]
        summary[name] = statistics.median(values) if values else None
        summary[f"{name}_min"] = min(values) if values else None
        summary[f"{name}_max"] = max(values) if values else None
    return summary


def tps_ratio(baseline: dict, uniep: dict) -> tuple[float, float, float]:
    """uniep / baseline tokens/s: the ratio of the side medians, and its range from the runs' extremes,
    ``min(uniep) / max(baseline)`` to ``max(uniep) / min(baseline)`` (``side_summary`` dicts)."""
    return (uniep["tps"] / baseline["tps"], uniep["tps_min"] / baseline["tps_max"],
            uniep["tps_max"] / baseline["tps_min"])


def loss_difference(reference: Path, run: Path) -> dict:
    """``compare_loss`` of a run's loss curve against the reference run's, over their common steps."""
    result = compare(load_run(reference), load_run(run))
    return {"loss_max_rel_diff": result.max_rel, "loss_mean_rel_diff": result.mean_rel,
            "loss_common_steps": len(result.steps), "loss_bitwise": result.bitwise}


def _memory_figures(record: dict) -> dict:
    """A step's ``mem_symmetric_gib`` and ``mem_peak_gib`` (``PEAK_FIELDS``), where it has the figures."""
    figures = {}
    symmetric = record.get("mem_symmetric")
    if symmetric is not None:
        figures["mem_symmetric_gib"] = symmetric / 2**30
    if record.get("mem_device_used") is not None:
        figures["mem_device_used_gib"] = record["mem_device_used"] / 2**30
    if record.get("mem_reserved_peak_gib") is not None:
        figures["mem_peak_gib"] = record["mem_reserved_peak_gib"] + figures.get("mem_symmetric_gib", 0.0)
    return figures


def _largest(values: list[float]) -> float | None:
    values = list(values)
    if not values:
        return None
    return math.nan if any(math.isnan(v) for v in values) else max(values)


# ---------------------------------------------------------------- report (pure)


@dataclass
class Report:
    """Everything the table, the JSON lines and the plots are made of."""

    meta: dict
    """Written into every JSON line: date, commit, host, versions, options."""
    runs: list[dict] = field(default_factory=list)
    """One dict per run, in launch order: side, run, command, run_stats, loss differences, wall_s."""
    records: dict[str, list[dict]] = field(default_factory=dict)
    """Run label ("baseline 1") -> its loss.jsonl records, for the plots."""

    def side_runs(self, side: str) -> list[dict]:
        return [run for run in self.runs if run["side"] == side]

    def summaries(self) -> dict[str, dict]:
        """Per side: ``side_summary`` of its runs, its commands, and the loss figures (largest over its
        runs compared with baseline run 1); the uniep side also carries the tokens/s ratio."""
        out = {}
        for side in SIDES:
            runs = self.side_runs(side)
            compared = [run for run in runs if run.get("loss_max_rel_diff") is not None]
            out[side] = {"kind": "summary", "side": side, "runs": len(runs), **side_summary(runs),
                         "loss_max_rel_diff": _largest(run["loss_max_rel_diff"] for run in compared),
                         "loss_mean_rel_diff": _largest(run["loss_mean_rel_diff"] for run in compared),
                         "commands": [run["command"] for run in runs]}
        if out["baseline"]["runs"] and out["uniep"]["runs"]:
            ratio, low, high = tps_ratio(out["baseline"], out["uniep"])
            out["uniep"].update(tps_ratio=ratio, tps_ratio_min=low, tps_ratio_max=high)
        return out

    def json_lines(self) -> list[str]:
        rows = [{"kind": "run", **run} for run in self.runs] + list(self.summaries().values())
        return [json.dumps({**self.meta, **row}) for row in rows]


def _fmt(value: float | None, spec: str) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return format(value, spec)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1000 * seconds


def _times(ratio: float) -> str:
    return f"{ratio:.2f}x" if ratio >= 0.1 else f"{ratio:.2g}x"  # 0.0088x on a CPU, not 0.01x


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or not b else _times(a / b)


def step_range(first: int, last: int) -> str:
    """``step 4`` or ``steps 4-40``."""
    return f"step {first}" if first == last else f"steps {first}-{last}"


def markdown(report: Report) -> str:
    """The benchmark's Markdown: a heading with the setup, the table, how to read it, and every command."""
    meta, warmup, steps = report.meta, report.meta["warmup"], report.meta["steps"]
    summaries = report.summaries()
    lines = [
        "# Training benchmark: TorchTitan baseline vs UniEP",
        "",
        f"{meta['date']}, {meta['hostname']}, {meta['device']} x {meta['ngpu']}, commit {meta['git_commit']}; "
        f"torch {meta['torch']}, triton {meta['triton']}, torchtitan {meta['torchtitan']}.",
        f"Baseline `{meta['baseline_config']}`, UniEP `{meta['uniep_config']}`; {steps} steps per run, "
        f"{meta['runs']} runs per side, deterministic {str(meta['deterministic']).lower()}, "
        f"compile {str(meta['compile']).lower()}, AC mode {meta['ac_mode'] or 'as configured'}"
        + (f", overrides `{' '.join(meta['overrides'])}`" if meta["overrides"] else "") + ".",
        "",
        "| run | tok/s per device | step time (ms) | peak memory (GiB) | symmetric (GiB) | device used (GiB) "
        "| MFU (%) | TFLOP/s "
        "| loss max rel diff | loss mean rel diff | wall (s) |",
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for run in report.runs:
        reference = run["loss_max_rel_diff"] is None
        lines.append(
            f"| {run['side']} {run['run']} | {_fmt(run['tps'], ',.0f')} | {_fmt(_ms(run['step_time']), ',.1f')} "
            f"| {_fmt(run['mem_peak_gib'], '.2f')} "
            f"| {_fmt(run['mem_symmetric_gib'], '.2f')} | {_fmt(run['mem_device_used_gib'], '.2f')} "
            f"| {_fmt(run['mfu_pct'], '.2f')} "
            f"| {_fmt(run['tflops'], ',.2f')} | {'reference' if reference else _fmt(run['loss_max_rel_diff'], '.2e')} "
            f"| {'' if reference else _fmt(run['loss_mean_rel_diff'], '.2e')} | {_fmt(run['wall_s'], ',.0f')} |"
        )
    for side in SIDES:
        s = summaries[side]
        lines.append(
            f"| **{side}** (median of {s['runs']}) | **{_fmt(s['tps'], ',.0f')}** "
            f"({_fmt(s['tps_min'], ',.0f')}-{_fmt(s['tps_max'], ',.0f')}) | {_fmt(_ms(s['step_time']), ',.1f')} "
            f"| {_fmt(s['mem_peak_gib'], '.2f')} | | {_fmt(s['mem_device_used_gib'], '.2f')} "
            f"| {_fmt(s['mfu_pct'], '.2f')} | {_fmt(s['tflops'], ',.2f')} "
            f"| {_fmt(s['loss_max_rel_diff'], '.2e')} | {_fmt(s['loss_mean_rel_diff'], '.2e')} | |"
        )
    base, uniep = summaries["baseline"], summaries["uniep"]
    lines.append(
        f"| **uniep / baseline** | **{_times(uniep['tps_ratio'])}** ({_times(uniep['tps_ratio_min'])}-"
        f"{_times(uniep['tps_ratio_max'])}) | {_ratio(uniep['step_time'], base['step_time'])} "
        f"| {_ratio(uniep['mem_peak_gib'], base['mem_peak_gib'])} | "
        f"| {_ratio(uniep['mem_device_used_gib'], base['mem_device_used_gib'])} "
        f"| {_ratio(uniep['mfu_pct'], base['mfu_pct'])} | {_ratio(uniep['tflops'], base['tflops'])} | | | |"
    )
    lines += [
        "",
        f"Per run: medians over {step_range(warmup + 1, steps)} "
        f"({'no warm-up' if not warmup else 'warm-up: ' + step_range(1, warmup)}), as TorchTitan "
        "computes them for its step log line on rank 0: tokens/s per device (`tps`), step time, MFU, TFLOP/s; "
        "peak memory is the largest per-step peak of reserved memory over those steps plus the symmetric memory "
        "UniEP's workspaces hold (its own column: PyTorch maps it outside its caching allocator, so TorchTitan's "
        "memory figure leaves it out); device used is the largest of the device's used memory after a logged "
        "step (everything on the device: CUDA context, NCCL, symmetric memory). Per side: the median of "
        "the runs' figures (tokens/s with the runs' min-max). The ratio's range is min(uniep) / max(baseline) to "
        "max(uniep) / min(baseline). Loss: relative difference to baseline run 1 over every common step "
        "(`titan_uniep.tools.compare_loss`); the other baseline runs show how far the baseline differs from itself "
        "(side rows: the largest over the side's runs).",
        "",
        "Commands (in launch order):",
        "",
        "```",
        *(run["command"] for run in report.runs),
        "```",
    ]
    return "\n".join(lines) + "\n"


def progress_line(run: dict, total: int) -> str:
    """``[3/4] uniep run 2: 40 logged steps, 74,312 tok/s/device (median of steps 6-40), 42.1 GiB peak, 58 s``."""
    memory = "" if run["mem_peak_gib"] is None else f", {run['mem_peak_gib']:.1f} GiB peak"
    return (f"[{run['order']}/{total}] {run['side']} run {run['run']}: {run['logged_steps']} logged steps, "
            f"{run['tps']:,.0f} tok/s/device (median of {step_range(run['first_step'], run['last_step'])})"
            f"{memory}, {run['wall_s']:.0f} s")


def plot(report: Report, out: Path) -> None:
    """``tps.png``: tokens/s per logged step of every run, warm-up shaded; ``loss.png``: every run's loss and
    its relative difference to baseline run 1."""
    import matplotlib

    matplotlib.use("Agg")  # files only; no display on training machines
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    colours = {"baseline": "tab:blue", "uniep": "tab:orange"}
    styles = ("-", "--", ":", "-.")
    warmup = report.meta["warmup"]
    summaries = report.summaries()

    fig, ax = plt.subplots(figsize=(9, 5))
    if warmup:
        ax.axvspan(0.5, warmup + 0.5, color="grey", alpha=0.15,
                   label=f"warm-up ({step_range(1, warmup)}, not in the medians)")
    for run in report.runs:
        records = report.records[f"{run['side']} {run['run']}"]
        ax.plot([r["step"] for r in records], [r.get("tps") for r in records], styles[(run["run"] - 1) % len(styles)],
                color=colours[run["side"]], marker=".", label=f"{run['side']} {run['run']}")
    for side in SIDES:
        ax.axhline(summaries[side]["tps"], color=colours[side], linewidth=0.8, alpha=0.6)
    ax.set_xlabel("step")
    ax.set_ylabel("tokens/s per device (TorchTitan tps)")
    ax.set_title(f"tokens/s per step; horizontal lines: side medians "
                 f"(uniep / baseline {_times(summaries['uniep']['tps_ratio'])})")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(out / TPS_PLOT, dpi=120)
    plt.close(fig)

    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(9, 7), height_ratios=(2, 1))
    reference = {r["step"]: r["loss"] for r in report.records["baseline 1"]}
    for run in report.runs:
        records = report.records[f"{run['side']} {run['run']}"]
        style = dict(color=colours[run["side"]], linestyle=styles[(run["run"] - 1) % len(styles)])
        top.plot([r["step"] for r in records], [r["loss"] for r in records], label=f"{run['side']} {run['run']}",
                 **style)
        if (run["side"], run["run"]) != ("baseline", 1):
            common = [r for r in records if reference.get(r["step"])]
            bottom.plot([r["step"] for r in common], [(r["loss"] - reference[r["step"]]) / reference[r["step"]]
                                                      for r in common], **style)
    top.set_ylabel("loss")
    top.legend(fontsize="small")
    top.grid(alpha=0.3)
    bottom.axhline(0.0, color="black", linewidth=0.5)
    bottom.set_xlabel("step")
    bottom.xaxis.set_major_locator(MaxNLocator(integer=True))
    bottom.set_ylabel("rel. diff to baseline 1")
    bottom.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / LOSS_PLOT, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------- the benchmark


def environment(args: argparse.Namespace) -> dict:
    """The metadata written into every JSON line (the device is read from the first run's log later)."""
    versions = {}
    for package in ("torch", "triton", "torchtitan"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = None
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "git_commit": _git_commit(),
        "hostname": socket.gethostname(),
        **versions,
        "device": None,
        "ngpu": args.ngpu,
        "baseline_config": args.baseline,
        "uniep_config": args.uniep,
        "steps": args.steps,
        "warmup": args.warmup,
        "runs": args.runs,
        "deterministic": args.deterministic,
        "compile": args.compile,
        "ac_mode": args.ac_mode,
        "overrides": list(args.overrides),
        "cwd": os.getcwd(),
    }


def _git_commit() -> str | None:
    """HEAD of this checkout, with ``+dirty`` when tracked files differ from it."""
    try:
        head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+dirty" if dirty else "")


def device_name(log_path: Path) -> str | None:
    """The device TorchTitan reported training on: its "CUDA capacity: <name> with N GiB memory" line."""
    if not log_path.is_file():
        return None
    for line in log_path.read_text(encoding="utf-8", errors="replace").splitlines():
        _, sep, rest = line.partition(" capacity: ")
        if sep and " with " in rest:
            return rest.rsplit(" with ", 1)[0].strip()
    return None


def record_run(report: Report, spec: RunSpec, wall_s: float, warmup: int, reference: Path) -> dict:
    """Read a finished run's dump folder into ``report`` (its figures after ``warmup``, its loss
    against the ``reference`` run's, unless it is that run); return its row.

    Raises:
        RunFailed: its loss.jsonl is missing or has no usable step after the warm-up.
    """
    try:
        records = read_records(spec.dump_folder)
        stats = run_stats(records, warmup, source=str(spec.dump_folder / LOSS_FILE))
    except ValueError as err:
        raise RunFailed(f"{spec.name} finished but its figures cannot be read: {err}") from None
    report.records[f"{spec.side} {spec.index}"] = records
    if report.meta.get("device") is None:
        report.meta["device"] = device_name(spec.dump_folder / LOG_FILE)
    if spec.dump_folder == reference:
        losses = dict.fromkeys(("loss_max_rel_diff", "loss_mean_rel_diff", "loss_common_steps", "loss_bitwise"))
    else:
        losses = loss_difference(reference, spec.dump_folder)
    row = {"side": spec.side, "run": spec.index, "order": spec.order, "command": spec.command,
           "dump_folder": str(spec.dump_folder), "wall_s": round(wall_s, 2), "logged_steps": len(records),
           **stats, **losses}
    report.runs.append(row)
    return row


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(sys.argv[1:] if argv is None else list(argv))
        runs = plan_runs(args)
        if args.out.exists() and any(args.out.iterdir()):
            raise ValueError(f"--out {args.out} is not empty; pass a new folder (runs would mix with what is there)")
        check_configs(runs)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    report = Report(meta=environment(args))
    print(f"{len(runs)} runs ({' '.join(run.side[0].upper() for run in runs)}), NGPU={args.ngpu}, {args.steps} steps "
          f"each; per-run dump folders and logs in {args.out}/<side>_<i>/", flush=True)
    for spec in runs:
        try:
            wall_s = launch(spec, args.run_timeout)
            row = record_run(report, spec, wall_s, args.warmup, reference=args.out / "baseline_1")
        except RunFailed as err:
            print(f"error: [{spec.order}/{len(runs)}] {err}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            print(f"interrupted: {spec.name} was stopped (its processes killed); its log is "
                  f"{spec.dump_folder / LOG_FILE}", file=sys.stderr)
            return 130
        print(progress_line(row, len(runs)), flush=True)

    table = markdown(report)
    (args.out / TABLE_FILE).write_text(table, encoding="utf-8")
    (args.out / JSONL_FILE).write_text("\n".join(report.json_lines()) + "\n", encoding="utf-8")
    plot(report, args.out)
    print()
    print(table)
    print(f"written: {args.out / TABLE_FILE}, {args.out / JSONL_FILE}, {args.out / TPS_PLOT}, {args.out / LOSS_PLOT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
