"""The tools' command lines, without a GPU: each usage line names the command
that runs it (``python3 -m titan_uniep.tools.NAME``, not ``NAME.py``), and a
tool that times CUDA kernels stops at once, in one line, where there is no
CUDA GPU or no torchrun launch, before any CUDA or NCCL call."""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]

TOOLS = ("tune", "bench", "bench_backward", "bench_train", "real_ranks", "compare_loss", "memory_flat")
# The GPU tools and an argument list that is valid everywhere but on the machine.
GPU_TOOLS = {
    "tune": ["--shape", "qwen3_1gpu"],
    "bench": ["--shape", "qwen3_1gpu"],
    "bench_backward": ["--shape", "qwen3_1gpu"],
}


def _main(tool: str):
    return importlib.import_module(f"titan_uniep.tools.{tool}").main


@pytest.fixture
def no_cuda_calls(monkeypatch):
    """Any CUDA device or process-group set-up fails the test."""

    def called(*args, **kwargs):
        raise AssertionError("the tool reached CUDA / NCCL set-up")

    monkeypatch.setattr(torch.cuda, "set_device", called)
    monkeypatch.setattr(dist, "init_process_group", called)


@pytest.mark.parametrize("tool", TOOLS)
def test_every_tools_usage_line_names_the_command_that_runs_it(tool, capsys):
    with pytest.raises(SystemExit) as stop:
        _main(tool)(["--help"])
    assert stop.value.code == 0
    usage = capsys.readouterr().out
    assert re.match(rf"usage: python3? -m titan_uniep\.tools\.{tool} ", usage), usage[:200]


@pytest.mark.parametrize("tool", GPU_TOOLS)
def test_a_gpu_tool_without_cuda_stops_at_once_in_one_line(tool, monkeypatch, no_cuda_calls, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as stop:
        _main(tool)(GPU_TOOLS[tool])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"python3 -m titan_uniep.tools.{tool}: error: "), err
    assert "needs a CUDA GPU" in err, err


def test_the_tuner_without_cuda_says_what_to_use_instead():
    # The reported symptom, as a user runs it: an AttributeError from torch._C deep in set_device.
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": os.pathsep.join(
        [str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "titan_uniep.tools.tune", "--shape", "qwen3_1gpu"],
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr == (
        "python3 -m titan_uniep.tools.tune: error: the measured search times CUDA kernels: it needs a CUDA GPU. "
        "Without one, train with [uniep] tuning = \"off\" (the shipped defaults) or \"cached\" with a cache tuned "
        "on a GPU of the same model\n"), proc.stderr[-3000:]


@pytest.mark.parametrize("tool", ["bench", "bench_backward"])
def test_a_benchmark_outside_torchrun_says_how_to_launch_it(tool, monkeypatch, no_cuda_calls, capsys):
    # Before: bench failed in init_process_group (no RANK), bench_backward with KeyError: 'LOCAL_RANK'.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(SystemExit) as stop:
        _main(tool)(GPU_TOOLS[tool])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"torchrun --nproc_per_node 1 -m titan_uniep.tools.{tool} " in err, err
