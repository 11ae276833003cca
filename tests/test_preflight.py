"""titan_uniep.preflight and run_train.sh: a job that cannot run fails before TorchTitan builds anything,
with a message naming the key and the fix; the configs run from any working directory."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from titan_uniep import preflight as pf

REPO = Path(__file__).resolve().parents[1]
UNIEP_CONFIG = REPO / "train_configs" / "deepseek_v3_debug_uniep.toml"
BASELINE_CONFIG = REPO / "train_configs" / "deepseek_v3_debug_baseline.toml"


def test_missing_config_file_stops_train_main_before_torchtitan(tmp_path, monkeypatch):
    from titan_uniep import train

    def torchtitan_main(trainer_class):
        raise AssertionError("TorchTitan started on a missing config file")

    monkeypatch.setattr(train, "torchtitan_main", torchtitan_main)
    monkeypatch.setattr(sys, "argv", ["titan_uniep.train", "--job.config_file", str(tmp_path / "nope.toml")])
    with pytest.raises(SystemExit) as exit_info:
        train.main()
    message = str(exit_info.value.code)
    assert "nope.toml" in message and "does not exist" in message and "CONFIG_FILE" in message, message


def test_toml_syntax_error_names_file_line_and_column(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('[job]\ndescription = "x"\n\n[training\nsteps = 3\n')
    with pytest.raises(ValueError, match=r"bad\.toml' is not valid TOML: .*line 4, column 10"):
        pf.preflight([f"--job.config_file={bad}"], world_size=2)


def _parallelism(**degrees) -> SimpleNamespace:
    values = dict(data_parallel_replicate_degree=1, data_parallel_shard_degree=-1, context_parallel_degree=1,
                  tensor_parallel_degree=1, pipeline_parallel_degree=1, expert_parallel_degree=2,
                  expert_tensor_parallel_degree=1)
    values.update(degrees)
    return SimpleNamespace(**values)


@pytest.mark.parametrize("world", [1, 3])
def test_ngpu_that_does_not_fit_expert_parallel_degree_names_both(world):
    # TorchTitan's own error here: "The product of mesh_sizes=(1, 1, 0, 2, 1) is 0 ..." (world 1).
    with pytest.raises(ValueError) as err:
        pf.check_world_size(_parallelism(), world)
    message = str(err.value)
    assert f"NGPU (WORLD_SIZE) = {world} " in message, message
    assert "expert_parallel_degree = 2" in message and "Launch with NGPU = 2" in message, message


@pytest.mark.parametrize(
    "degrees,world,match",
    [
        (dict(data_parallel_shard_degree=4), 2, r"product is 4\. Launch with NGPU = 4"),
        (dict(tensor_parallel_degree=2, expert_parallel_degree=1), 3, r"= 2 does not divide 3\. Launch with NGPU = 2"),
        (dict(expert_parallel_degree=4, context_parallel_degree=2), 2, r"= 4 to divide .* = 2\. Launch with NGPU = 4 or a"),
        (dict(pipeline_parallel_degree=0), 2, r"parallelism\.pipeline_parallel_degree = 0 must be >= 1"),
    ],
)
def test_other_degree_mismatches_name_the_keys(degrees, world, match):
    with pytest.raises(ValueError, match=match):
        pf.check_world_size(_parallelism(**degrees), world)


@pytest.mark.parametrize("world,shard", [(2, 2), (4, 4), (6, 6)])
def test_fitting_world_sizes_pass_and_resolve_the_shard_degree(world, shard):
    dims = pf.check_world_size(_parallelism(), world)
    assert (dims.dp_shard, dims.ep, dims.world_size) == (shard, 2, world)
    # dp_shard 2 x cp 2 = 4 ranks hold the EP 4 group: fits on 4 ranks, not on 2.
    assert pf.check_world_size(_parallelism(expert_parallel_degree=4, context_parallel_degree=2), 4).dp_shard == 2


def test_preflight_reads_degrees_from_config_and_cli_overrides():
    with pytest.raises(ValueError, match=r"NGPU \(WORLD_SIZE\) = 1 .*expert_parallel_degree = 2"):
        pf.preflight(["--job.config_file", str(BASELINE_CONFIG)], world_size=1)
    # The CLI override wins over the TOML's expert_parallel_degree = 2, so 1 rank fits.
    pf.preflight(["--job.config_file", str(BASELINE_CONFIG), "--parallelism.expert_parallel_degree", "1"], world_size=1)


def test_preflight_runs_the_uniep_checks_that_need_no_model():
    with pytest.raises(ValueError, match=r"expert_parallel_comm_backend = 'deepep'"):
        pf.preflight(["--job.config_file", str(UNIEP_CONFIG), "--parallelism.expert_parallel_comm_backend", "deepep"],
                     world_size=2)


def test_bundled_tokenizer_path_resolves_from_any_working_directory(tmp_path, monkeypatch):
    from torchtitan.components.tokenizer import build_hf_tokenizer
    from torchtitan.config import ConfigManager

    monkeypatch.chdir(tmp_path)  # the configs' hf_assets_path "titan_uniep/assets/bpe2048" is relative
    args = ["--job.config_file", str(UNIEP_CONFIG)]
    overrides = pf.preflight(args, world_size=2)
    assert overrides[0] == "--model.hf_assets_path" and Path(overrides[1]).is_absolute(), overrides
    tokenizer = build_hf_tokenizer(ConfigManager().parse_args(args + overrides))
    assert tokenizer.get_vocab_size() == 2048
    # From the checkout root the relative path works as it is, and stays.
    monkeypatch.chdir(REPO)
    assert pf.preflight(args, world_size=2) == []


def test_ngpu_mismatch_stops_train_main_before_torchtitan(monkeypatch):
    from titan_uniep import train

    def torchtitan_main(trainer_class):
        raise AssertionError("TorchTitan started with 1 rank for an EP 2 config")

    monkeypatch.setattr(train, "torchtitan_main", torchtitan_main)
    monkeypatch.setenv("WORLD_SIZE", "1")  # as torchrun sets it for NGPU=1
    monkeypatch.setattr(sys, "argv", ["titan_uniep.train", "--job.config_file", str(UNIEP_CONFIG)])
    with pytest.raises(SystemExit) as exit_info:
        train.main()
    assert "error: NGPU (WORLD_SIZE) = 1 does not match" in str(exit_info.value.code)


def _run_train(cwd: Path, tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    """run_train.sh with a stand-in python3 that records the launch instead of training
    (its config-file check runs in the real Python)."""
    stub = tmp_path / "bin" / "python3"
    stub.parent.mkdir(exist_ok=True)
    # "-c": run_train.sh's CUDA probe (answer: no GPU); preflight.py: its config check, for real;
    # anything else: the torchrun launch.
    stub.write_text(f'#!/bin/sh\ncase "$1" in -c) exit 1;; */preflight.py) exec {sys.executable} "$@";; esac\n'
                    'printf "%s\\n" "$@" > "$LAUNCH_ARGS"\n')
    stub.chmod(0o755)
    environ = {k: v for k, v in os.environ.items() if k not in ("NGPU", "CONFIG_FILE")}
    environ.update(PATH=f"{stub.parent}{os.pathsep}{environ['PATH']}", LAUNCH_ARGS=str(tmp_path / "args"), **env)
    return subprocess.run([str(REPO / "run_train.sh"), "--training.steps", "3"], cwd=cwd, env=environ,
                          capture_output=True, text=True, timeout=60)


def test_run_train_rejects_a_missing_config_file_at_once(tmp_path):
    proc = _run_train(tmp_path, tmp_path, CONFIG_FILE="train_configs/nope.toml")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "CONFIG_FILE=train_configs/nope.toml is not a file" in proc.stderr
    assert not (tmp_path / "args").exists(), "torchrun was launched"


def test_run_train_rejects_a_toml_syntax_error_at_once(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[job]\ndump_folder = out\n")
    proc = _run_train(tmp_path, tmp_path, CONFIG_FILE=str(bad))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "bad.toml' is not valid TOML" in proc.stderr and "line 2, column 15" in proc.stderr, proc.stderr
    assert not (tmp_path / "args").exists(), "torchrun was launched"


@pytest.mark.parametrize("config", ["train_configs/deepseek_v3_debug_uniep.toml", str(UNIEP_CONFIG)])
def test_run_train_finds_the_config_from_another_directory(tmp_path, config):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    proc = _run_train(elsewhere, tmp_path, NGPU="1", CONFIG_FILE=config)
    assert proc.returncode == 0, proc.stderr[-2000:]
    args = (tmp_path / "args").read_text().splitlines()
    assert args[args.index("--job.config_file") + 1] == str(UNIEP_CONFIG), args
    assert "--nproc_per_node=1" in args and args[-2:] == ["--training.steps", "3"], args
