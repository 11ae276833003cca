"""scripts/two_gpu_checklist.py stays runnable for the day a 2-GPU machine is lent: its dry run
lists every step, every file, config and module a step names exists, every training step's
overrides pass run_train.sh's and the worker's start-up checks, and a failed or hung step
fails the checklist with its row in the summary."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from titan_uniep.torchtitan.preflight import check_job
from torchtitan_release import torchtitan_0_2

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "two_gpu_checklist.py"

_spec = importlib.util.spec_from_file_location("two_gpu_checklist", SCRIPT)
checklist = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = checklist  # its dataclass looks its module up there
_spec.loader.exec_module(checklist)

STEPS = checklist.checklist(Path("outputs/two_gpu_checklist-test"), train_steps=10)
TRAINING = [s for s in STEPS if s.argv[0] == "./run_train.sh"]


def test_dry_run_lists_every_step_and_its_command_without_a_gpu(tmp_path):
    out = tmp_path / "checklist"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--out", str(out)], cwd=tmp_path,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    listed = proc.stdout.splitlines()[1:]
    assert listed == [f"{s.name}: {s.shell()}" for s in checklist.checklist(out, train_steps=10)], proc.stdout
    assert not out.exists(), "the dry run wrote its output folder"


def test_without_two_gpus_it_stops_at_once_and_says_so(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path / "checklist")],
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "needs 2 CUDA GPUs, and torch.cuda.device_count() is 0" in proc.stderr
    assert not (tmp_path / "checklist").exists()


def test_every_two_gpu_launcher_of_tests_gpu_is_a_step():
    launchers = {f"tests/gpu/{p.name}" for p in (REPO / "tests" / "gpu").glob("test_*.py")
                 if "needs_two_gpus" in p.read_text()}
    assert len(launchers) >= 3, launchers
    assert launchers <= {arg for s in STEPS for arg in s.argv}


def test_every_file_config_and_worker_a_step_names_exists():
    named = [arg for s in STEPS for arg in [*s.argv, *s.env.values()] if re.search(r"\.(py|sh|toml)$", arg)]
    assert len(named) >= 7, named
    for path in named:
        assert (REPO / path).is_file(), f"a step names {path}, which does not exist"
    assert os.access(REPO / "run_train.sh", os.X_OK)
    # The launchers' workers, which torchrun runs from tests/gpu/.
    for launcher in {p for p in named if p.startswith("tests/gpu/")}:
        workers = re.findall(r'run_worker\("(\w+\.py)"', (REPO / launcher).read_text())
        assert workers, f"{launcher} runs no worker"
        for worker in workers:
            assert (REPO / "tests" / "gpu" / worker).is_file(), f"{launcher} runs {worker}, which does not exist"


def test_every_module_a_step_runs_with_dash_m_resolves():
    modules = [s.argv[s.argv.index("-m") + 1] for s in STEPS if "-m" in s.argv]
    assert {"pytest", "titan_uniep.tools.compare_loss"} <= set(modules)
    for module in modules:
        assert importlib.util.find_spec(module) is not None, f"python3 -m {module}: no such module"


@torchtitan_0_2  # the steps train TorchTitan 0.2.2 configs
@pytest.mark.parametrize("step", TRAINING, ids=lambda s: s.name)
def test_every_training_steps_overrides_pass_the_start_up_checks(step, monkeypatch):
    # run_train.sh's check and the worker's (TorchTitan's own parse, every key of every section,
    # NGPU against the degrees, [uniep] against the job) as on the GPU machine: the kernel
    # schedules at these shapes are GPU configurations, which the checks refuse on a CPU.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.chdir(REPO)
    job = check_job(["--job.config_file", step.env["CONFIG_FILE"], *step.argv[1:]], int(step.env["NGPU"]))
    assert step.env["NGPU"] == "2"
    assert job.training.steps == 10 and job.debug.deterministic
    assert job.job.dump_folder == f"outputs/two_gpu_checklist-test/{step.name}"
    ep1 = step.name.startswith("ep1_")
    assert job.parallelism.expert_parallel_degree == (1 if ep1 else 2)
    if "baseline" not in step.name:
        assert job.uniep.enable and job.uniep.schedule == step.name.rsplit("_", 1)[1]


def test_the_compared_runs_are_steps_before_their_comparison():
    for i, step in enumerate(STEPS):
        if "titan_uniep.tools.compare_loss" in step.argv:
            runs = [Path(a).name for a in step.argv if a.startswith("outputs/two_gpu_checklist-test/")][:2]
            assert set(runs) <= {s.name for s in STEPS[:i]}, (step.name, runs)


def test_steps_run_with_nvlink_multicast_off_and_without_the_test_hooks(monkeypatch):
    monkeypatch.setenv("UNIEP_EP_VARIANTS", "direct")  # would narrow ep_worker to one variant
    monkeypatch.setenv("UNIEP_TEST_GUARD_FLIP", "3:1")  # would plant a difference in a training run
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")
    env = checklist.step_env()
    assert {k: env[k] for k in ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "NCCL_NVLS_ENABLE", "NVSHMEM_DISABLE_NVLS")} == {
        "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NCCL_NVLS_ENABLE": "0", "NVSHMEM_DISABLE_NVLS": "1"}
    assert "UNIEP_EP_VARIANTS" not in env and "UNIEP_TEST_GUARD_FLIP" not in env
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(REPO)


def test_a_failed_or_hung_step_fails_the_checklist_and_every_step_is_in_the_summary(tmp_path, monkeypatch, capsys):
    python = [sys.executable, "-c"]
    steps = [checklist.Step("passes", [*python, "print('fine')"]),
             checklist.Step("fails", [*python, "import sys; print('broken'); sys.exit(3)"]),
             checklist.Step("hangs", [*python, "import time; time.sleep(120)"], timeout_s=1),
             checklist.Step("after", [*python, "pass"])]
    monkeypatch.setattr(checklist, "checklist", lambda out, train_steps: steps)
    monkeypatch.setattr(checklist, "cannot_start", lambda logs: None)
    out = tmp_path / "checklist"
    assert checklist.main(["--out", str(out)]) == 1
    rows = re.findall(r"^\| (\w+) \| (\d+) \| \d+ \|$", (out / "summary.md").read_text(), re.M)
    assert rows == [("passes", "0"), ("fails", "3"), ("hangs", "124"), ("after", "0")]
    assert "broken" in (out / "fails.log").read_text()
    assert "stopped after 1 s" in (out / "hangs.log").read_text()
    printed = capsys.readouterr().out
    assert "   | broken" in printed and printed.rstrip().endswith("FAILED: fails, hangs")
