"""The 2-GPU checklist in one command, from the repository root of a clean clone.

    python3 scripts/two_gpu_checklist.py                   # every step, logs under outputs/two_gpu_checklist-<time>/
    python3 scripts/two_gpu_checklist.py --dry-run         # each step's name and exact command; needs no GPU
    python3 scripts/two_gpu_checklist.py --steps ep_worker,ep_backward_worker --out /tmp/check

In order, one step at a time on 2 GPUs (each step's output in OUT/<step>.log):

- ep_worker, ep_backward_worker, ep_peers_worker: the real-EP pytest launchers of
  tests/gpu/ (forward with every schedule variant of ep_worker.py in one run, so
  they are compared bitwise with each other; backward; the EP group's probe);
- robustness_fused, robustness_sequential: scripts/gpu_train_robustness.sh at
  each kernel schedule (every token on a few experts at one step, each layer
  against float64; the strict guard stops both ranks; checkpoint interchange
  with the baseline);
- train_sequential, train_fused, compare_fused_sequential: the DeepSeek-V3 debug
  model at EP = 2 on TorchTitan 0.2.2, deterministic, the two loss curves bitwise equal;
- ep1_baseline, ep1_fused, compare_ep1: the Qwen3 debug MoE pair at EP = 1 on
  2 data-parallel ranks (FSDP shards the experts), UniEP fused within the bf16
  tolerance of TorchTitan's own experts.

A failed step does not stop the others. The end is a table of every step's exit
status and seconds (also in OUT/summary.md); the exit status is 1 if any step
failed, 2 if the checklist could not start (fewer than 2 GPUs, no TorchTitan 0.2.2,
an OUT that is not empty).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.metadata
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# NVLink multicast off, as every 2-GPU figure of docs/performance.md was measured and as
# scripts/gpu_*.sh export it; PYTHONUNBUFFERED keeps a step's log whole up to where a timeout stopped it.
COMMON_ENV = {"TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NCCL_NVLS_ENABLE": "0", "NVSHMEM_DISABLE_NVLS": "1",
              "PYTHONUNBUFFERED": "1"}
# Dropped from the caller's environment: each narrows or changes what a step checks
# (UNIEP_EP_VARIANTS runs a subset of ep_worker's variants; UNIEP_TEST_* are the training tests' hooks).
DROPPED_ENV_PREFIXES = ("UNIEP_EP_VARIANTS", "UNIEP_TEST_")

# Named timeouts, each a bound well above a normal run (so a hang ends the step, not the checklist).
PYTEST_S = 1200  # a torchrun worker, kernels compiled on first use (the launchers' own bound: 600 s)
TRAIN_S = 900  # one short training run, as scripts/gpu_train_robustness.sh and gpu_ep1.sh bound theirs
ROBUSTNESS_S = 3600  # six training runs of scripts/gpu_train_robustness.sh, 900 s each at most
COMPARE_S = 120
STOP_GRACE_S = 30  # for torchrun to stop its workers before the step's group is killed

PAIR_CONFIG = "train_configs/deepseek_v3_debug_uniep.toml"
EP1_BASELINE = "train_configs/qwen3_debug_moe_ep1_baseline.toml"
EP1_UNIEP = "train_configs/qwen3_debug_moe_ep1_uniep.toml"
# bf16 training against TorchTitan's experts: the tolerance docs/performance.md states for the
# debug model's first 10 steps (and gpu_train_robustness.sh uses); never a bitwise contract.
BASELINE_RTOL = "2e-2"


@dataclasses.dataclass(frozen=True)
class Step:
    name: str
    argv: list[str]
    """The command, run from the repository root."""
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    """Set on top of the caller's environment and ``COMMON_ENV``."""
    timeout_s: int = TRAIN_S

    def shell(self) -> str:
        """The command as one would type it in a shell at the repository root."""
        return " ".join([*(f"{k}={shlex.quote(v)}" for k, v in self.env.items()), shlex.join(self.argv)])


def pytest_step(name: str, test_file: str) -> Step:
    return Step(name, ["python3", "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", test_file],
                timeout_s=PYTEST_S)


def train_step(name: str, config: str, out: Path, steps: int, overrides: list[str]) -> Step:
    """One ``run_train.sh`` run at NGPU=2, deterministic, every step in ``OUT/<name>/loss.jsonl``."""
    return Step(name, ["./run_train.sh", "--training.steps", str(steps), "--debug.deterministic",
                       "--metrics.log_freq", "1", *overrides, "--job.dump_folder", str(out / name)],
                env={"NGPU": "2", "LOG_RANK": "0,1", "CONFIG_FILE": config})


def compare_step(name: str, out: Path, run_a: str, run_b: str, check: list[str]) -> Step:
    return Step(name, ["python3", "-m", "titan_uniep.tools.compare_loss", str(out / run_a), str(out / run_b), *check,
                       "--labels", run_a, run_b, "--plot", str(out / f"{name}.png")], timeout_s=COMPARE_S)


def checklist(out: Path, train_steps: int) -> list[Step]:
    """Every step, in order; ``out``: the folder of the logs and dump folders."""
    return [
        pytest_step("ep_worker", "tests/gpu/test_gpu_ep.py"),
        pytest_step("ep_backward_worker", "tests/gpu/test_gpu_ep_backward.py"),
        pytest_step("ep_peers_worker", "tests/gpu/test_gpu_ep_peers.py"),
        *(Step(f"robustness_{schedule}", ["bash", "scripts/gpu_train_robustness.sh"],
               env={"SCHEDULE": schedule, "OUT": str(out / f"robustness_{schedule}")}, timeout_s=ROBUSTNESS_S)
          for schedule in ("fused", "sequential")),
        train_step("train_sequential", PAIR_CONFIG, out, train_steps, ["--uniep.schedule", "sequential"]),
        train_step("train_fused", PAIR_CONFIG, out, train_steps, ["--uniep.schedule", "fused"]),
        compare_step("compare_fused_sequential", out, "train_sequential", "train_fused", ["--assert-bitwise"]),
        train_step("ep1_baseline", EP1_BASELINE, out, train_steps, ["--parallelism.expert_parallel_degree", "1"]),
        train_step("ep1_fused", EP1_UNIEP, out, train_steps,
                   ["--parallelism.expert_parallel_degree", "1", "--uniep.schedule", "fused"]),
        compare_step("compare_ep1", out, "ep1_baseline", "ep1_fused", ["--rtol", BASELINE_RTOL]),
    ]


def step_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(DROPPED_ENV_PREFIXES)}
    env.update(COMMON_ENV)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def cannot_start(out: Path) -> str | None:
    """Why the checklist cannot run on this machine, or None."""
    import torch  # not needed by --dry-run

    gpus = torch.cuda.device_count()
    if gpus < 2:
        return (f"needs 2 CUDA GPUs, and torch.cuda.device_count() is {gpus} on this machine. "
                "Run it on a 2-GPU machine (--dry-run lists the steps anywhere).")
    try:
        version = importlib.metadata.version("torchtitan")
    except importlib.metadata.PackageNotFoundError:
        version = None
    if version is None or version.split("+", 1)[0] != "0.2.2":
        return (f"the training steps use TorchTitan 0.2.2 train configs, and the installed TorchTitan is {version}. "
                "pip install torchtitan==0.2.2 (README, Install).")
    if out.exists() and any(out.iterdir()):
        return (f"--out {out} is not empty: a previous run's checkpoints there would be loaded by the robustness "
                "steps. Pass a new folder.")
    return None


def stop(proc: subprocess.Popen) -> None:
    """End ``proc``'s process group: SIGTERM first, which torchrun passes on to its workers
    (they run in sessions of their own, out of reach of a signal to this group), then SIGKILL."""
    with contextlib.suppress(ProcessLookupError):  # it may have ended meanwhile
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def run(step: Step, logs: Path, env: dict[str, str]) -> tuple[int, float]:
    """Run ``step`` with its output in ``logs/<name>.log``; (exit status, seconds). A timeout is status 124."""
    log = logs / f"{step.name}.log"
    start = time.monotonic()
    with open(log, "w") as f:
        f.write(f"$ {step.shell()}\n")
        f.flush()
        # Its own session: a timeout or Ctrl-C here ends the step's whole process group.
        proc = subprocess.Popen(step.argv, cwd=REPO, env={**env, **step.env}, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            status = proc.wait(timeout=step.timeout_s)
        except subprocess.TimeoutExpired:
            stop(proc)
            f.write(f"\ntwo_gpu_checklist: stopped after {step.timeout_s} s\n")
            status = 124
        except BaseException:
            stop(proc)
            raise
    return status, time.monotonic() - start


def summary(results: list[tuple[str, int, float]]) -> str:
    rows = [f"| {name} | {status} | {seconds:.0f} |" for name, status, seconds in results]
    return "\n".join(["| step | exit status | seconds |", "|---|---|---|", *rows])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path,
                        help="folder of the logs and runs (default: a new outputs/two_gpu_checklist-<time>/)")
    parser.add_argument("--train-steps", type=int, default=10,
                        help="steps of each training run (default 10: the debug models' stable start)")
    parser.add_argument("--steps", help="comma-separated step names to run, in the checklist's order (default: all)")
    parser.add_argument("--dry-run", action="store_true", help="print each step's name and command, run nothing")
    args = parser.parse_args(argv)

    if args.train_steps < 1:
        parser.error(f"--train-steps {args.train_steps}: a training run needs at least 1 step")
    out = (args.out or REPO / "outputs" / time.strftime("two_gpu_checklist-%Y%m%d-%H%M%S")).resolve()
    # Every step runs from the repository root: a folder inside it reads shorter from there.
    out = out.relative_to(REPO) if out.is_relative_to(REPO) else out
    logs = REPO / out  # the same folder from this process's working directory
    steps = checklist(out, args.train_steps)
    if args.steps:
        chosen = args.steps.split(",")
        unknown = sorted(set(chosen) - {s.name for s in steps})
        if unknown:
            parser.error(f"--steps {','.join(unknown)}: no such step (the steps: {', '.join(s.name for s in steps)})")
        steps = [s for s in steps if s.name in chosen]

    env_line = " ".join(f"{k}={v}" for k, v in COMMON_ENV.items())
    if args.dry_run:
        print(f"# from {REPO}, with {env_line} PYTHONPATH={REPO}; logs in {out}/<step>.log")
        for step in steps:
            print(f"{step.name}: {step.shell()}")
        return 0

    reason = cannot_start(logs)
    if reason:
        print(f"two_gpu_checklist: {reason}", file=sys.stderr)
        return 2
    logs.mkdir(parents=True, exist_ok=True)
    env = step_env()
    print(f"== two_gpu_checklist: {len(steps)} steps, logs in {logs}", flush=True)
    results = []
    for step in steps:
        print(f"== {step.name}: {step.shell()}", flush=True)
        status, seconds = run(step, logs, env)
        results.append((step.name, status, seconds))
        print(f"   exit {status} after {seconds:.0f} s", flush=True)
        if status:
            lines = (logs / f"{step.name}.log").read_text(errors="replace").splitlines()
            print("\n".join(f"   | {line}" for line in lines[-30:]), flush=True)
    table = summary(results)
    (logs / "summary.md").write_text(table + "\n")
    failed = [name for name, status, _ in results if status]
    print(f"\n{table}\n\n{'FAILED: ' + ', '.join(failed) if failed else 'TWO-GPU CHECKLIST OK'}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
