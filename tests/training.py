"""Launch ``./run_train.sh`` on 2 CPU processes (gloo) for the end-to-end tests.

Each run gets its own process group: when it runs past its timeout (or the
test session is interrupted) the whole group goes, torchrun's workers too,
instead of orphaned workers training on and slowing what follows.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from titan_uniep.tools.compare_loss import load_run

REPO = Path(__file__).resolve().parents[1]
BASELINE = "train_configs/deepseek_v3_debug_baseline.toml"
UNIEP = "train_configs/deepseek_v3_debug_uniep.toml"
RUN_TIMEOUT_S = 600
"""A stuck run fails the test instead of hanging it; TorchTitan's own comm
timeouts ([comm] in the configs) normally end it much sooner."""


class RunTimedOut(Exception):
    """A command ran past its timeout; its whole process group was killed."""

    def __init__(self, pgid: int, output: str):
        super().__init__(f"process group {pgid} ran past its timeout")
        self.pgid = pgid
        self.output = output


def run_in_own_group(cmd: list[str], *, env: dict[str, str], timeout_s: float) -> tuple[int, str]:
    """Run ``cmd`` in a new session (its own process group); return (exit code, stdout + stderr).

    Raises RunTimedOut after SIGKILLing the whole group if it runs past
    ``timeout_s``; on any other interruption the group is killed too.
    """
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout_s)
    except BaseException as exc:  # a timeout, or the test session interrupted
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        if isinstance(exc, subprocess.TimeoutExpired):
            raise RunTimedOut(proc.pid, output) from None
        raise
    return proc.returncode, output


@dataclass
class TrainRun:
    """One finished ``./run_train.sh`` run: its exit code, both ranks' output, its dump folder."""

    dump_folder: Path
    returncode: int
    output: str

    @property
    def losses(self) -> dict[int, float]:
        """``{step: loss}`` from its loss.jsonl."""
        return load_run(self.dump_folder).losses

    def failures(self) -> dict[int, str]:
        """The launcher's failure report (``titan_uniep.torchtitan.torchrun``), by rank: each
        rank's exit status (``exit code N``, ``signal SIGKILL``, or ``stopped by torchrun
        (SIGTERM)`` for a rank torchrun stopped once another had failed) and what it
        recorded before exiting (present even when torchrun stopped it afterwards): the
        first rank's error in full, the others' first line or ``the same error``."""
        report = {}
        lines = self.output.splitlines()
        for i, line in enumerate(lines):
            failed = re.fullmatch(r"rank (\d+) failed (too|first) \(([^)]*)\)(.*)", line)
            stopped = re.fullmatch(r"rank (\d+) was stopped by torchrun \((\w+)\) after rank \d+ failed"
                                   r"(?:; it had recorded (.*))?", line)
            if failed:
                rank, order, status, rest = failed.groups()
                said = "\n".join(lines[i + 1:]) if order == "first" else rest.removeprefix(": ")
                report[int(rank)] = f"{status}: {said}" if said else status
            elif stopped:
                rank, signal_name, said = stopped.groups()
                status = f"stopped by torchrun ({signal_name})"
                report[int(rank)] = f"{status}: {said}" if said else status
        return report

    def rank_lines(self, rank: int) -> list[str]:
        """Lines that rank printed (torchrun prefixes each with ``[rank<R>]:``)."""
        prefix = f"[rank{rank}]:"
        return [line for line in self.output.splitlines() if line.startswith(prefix)]


def train(config: str, dump_folder: Path, *overrides: str, steps: int, env: dict[str, str] | None = None,
          expect_failure: bool = False, timeout_s: float = RUN_TIMEOUT_S) -> TrainRun:
    """Run ./run_train.sh on 2 CPU processes (both ranks' output kept); fail the test if it
    times out, or if its exit status is not what ``expect_failure`` says."""
    run_env = dict(os.environ, NGPU="2", LOG_RANK="0,1", CONFIG_FILE=config, CUDA_VISIBLE_DEVICES="", **(env or {}))
    cmd = ["./run_train.sh", "--training.steps", str(steps), "--job.dump_folder", str(dump_folder), *overrides]
    try:
        returncode, output = run_in_own_group(cmd, env=run_env, timeout_s=timeout_s)
    except RunTimedOut as e:
        pytest.fail(f"{' '.join(cmd)} ran past {timeout_s} s:\n{e.output[-6000:]}")
    if (returncode != 0) != expect_failure:
        pytest.fail(f"{' '.join(cmd)} exited {returncode}:\n{output[-6000:]}")
    return TrainRun(dump_folder, returncode, output)
