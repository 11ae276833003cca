"""titan_uniep.torchtitan.preflight and run_train.sh: a job that cannot run fails before TorchTitan builds anything,
with a message naming the key and the fix; the configs run from any working directory."""

from __future__ import annotations

import pytest
from torchtitan_release import requires_torchtitan

requires_torchtitan("0.2.2")  # the TorchTitan 0.2.2 edge

import json
import os
import re
import subprocess
import time
import sys
from pathlib import Path
from types import SimpleNamespace


from titan_uniep.torchtitan import preflight as pf

REPO = Path(__file__).resolve().parents[1]
UNIEP_CONFIG = REPO / "train_configs" / "deepseek_v3_debug_uniep.toml"
BASELINE_CONFIG = REPO / "train_configs" / "deepseek_v3_debug_baseline.toml"


def test_missing_config_file_stops_train_main_before_torchtitan(tmp_path, monkeypatch):
    from titan_uniep.torchtitan.v0_2 import train

    def torchtitan_main(trainer_class):
        raise AssertionError("TorchTitan started on a missing config file")

    monkeypatch.setattr(train, "torchtitan_main", torchtitan_main)
    monkeypatch.setattr(sys, "argv", ["titan_uniep.torchtitan.train", "--job.config_file", str(tmp_path / "nope.toml")])
    error_file = tmp_path / "error.json"  # torchrun names one per worker
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    with pytest.raises(SystemExit) as exit_info:
        train.main()
    message = str(exit_info.value.code)
    assert "nope.toml" in message and "does not exist" in message and "CONFIG_FILE" in message, message
    # The launcher's report prints what the worker recorded: the message itself.
    assert f"error: {json.loads(error_file.read_text())['message']}" == message


def test_toml_syntax_error_names_file_line_and_column(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('[job]\ndescription = "x"\n\n[training\nsteps = 3\n')
    with pytest.raises(ValueError, match=r"bad\.toml' is not valid TOML: .*line 4, column 10"):
        pf.preflight([f"--job.config_file={bad}"], world_size=2)


UNIEP_SECTION = """
[job]
custom_config_module = "titan_uniep.config"
[experimental]
custom_import = "titan_uniep.torchtitan.v0_2"
[model]
name = "deepseek_v3_uniep"
flavor = "debugmodel"
[uniep]
enable = true
"""


def test_misspelt_uniep_key_in_the_file_names_the_closest_key_and_the_fix(tmp_path):
    # TorchTitan's own error: "Invalid field names in <class 'titan_uniep.config.UniEP'> data: {'shedule'}".
    path = tmp_path / "job.toml"
    path.write_text(UNIEP_SECTION + 'shedule = "fused"\n')
    with pytest.raises(ValueError) as err:
        pf.check_launch(["--job.config_file", str(path)], world_size=1)
    message = str(err.value)
    assert message.startswith(f"config file {str(path)!r}: shedule is not a key of [uniep]; did you mean schedule? "
                              "Fix the key in the file"), message
    assert "enable, schedule, compute_dtype, guard" in message, message


def test_misspelt_uniep_key_on_the_command_line_names_the_closest_flag():
    args = ["--job.config_file", str(UNIEP_CONFIG)]
    with pytest.raises(ValueError, match=r"^--uniep\.shedule is not a key of \[uniep\]; did you mean "
                                         r"--uniep\.schedule\? Fix the override"):
        pf.check_launch(args + ["--uniep.shedule", "fused"], world_size=2)
    with pytest.raises(ValueError, match=r"^--uniep\.gard_layer is not .*did you mean --uniep\.guard_layer\?"):
        pf.check_launch(args + ["--uniep.gard-layer=1"], world_size=2)
    # tyro's spellings of real keys pass: hyphens, and a bool field's negative flag.
    pf.check_launch(args + ["--uniep.guard-interval", "5", "--uniep.no-enable", "--uniep.no_enable"], world_size=2)


def test_unknown_key_with_no_close_match_lists_the_sections_keys():
    with pytest.raises(ValueError, match=r"^--uniep\.zzz is not a key of \[uniep\]\. Fix the override \(the keys of "
                                         r"\[uniep\]: enable, schedule"):
        pf.check_launch(["--job.config_file", str(UNIEP_CONFIG), "--uniep.zzz", "1"], world_size=2)


@pytest.mark.parametrize("edit,extra,match", [
    (("seq_len", "seqlen"), [], r"config file .*: seqlen is not a key of \[training\]; did you mean seq_len\?"),
    (("[training]", "[trainng]"), [], r"config file .*: \[trainng\] is not a section of the train config; did you "
                                     r"mean \[training\]\?"),
    (None, ["--training.stesp", "3"], r"^--training\.stesp is not a key of \[training\]; did you mean "
                                      r"--training\.steps\?"),
])
def test_worker_names_the_closest_key_of_every_section(tmp_path, edit, extra, match):
    text = UNIEP_CONFIG.read_text()
    if edit:
        text = text.replace(*edit)
    path = tmp_path / "job.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match=match):
        pf.check_job(["--job.config_file", str(path), *extra], world_size=2)


@pytest.mark.parametrize("extra,match", [
    (["--uniep.schedule", "fast"], r"\[uniep\] schedule = 'fast' is not a schedule; use one of 'reference'"),
    (["--uniep.guard_interval", "0"], r"\[uniep\] guard_interval must be a positive integer"),
    (["--uniep.tuning", "cached"], r"\[uniep\] tuning = 'cached' tunes UniEP's kernels, but schedule = "
                                   r"\"reference\" runs none"),
])
def test_uniep_values_of_the_file_and_the_overrides_are_checked_before_torchrun(extra, match):
    with pytest.raises(ValueError, match=match):
        pf.check_launch(["--job.config_file", str(UNIEP_CONFIG), *extra], world_size=2)


@pytest.mark.parametrize("toml, value", [("true", True), ('"last"', "last"), ("1.5", 1.5)],
                         ids=["bool", "str", "float"])
def test_guard_layer_that_is_not_an_integer_is_refused_before_torchrun(tmp_path, toml, value):
    """run_train.sh's check refuses a file's ``guard_layer`` that ``UniEP``
    refuses, before torchrun starts (the workers would fail only at the first
    guarded step, or, for ``true``, guard layer 1)."""
    path = tmp_path / "job.toml"
    path.write_text(UNIEP_SECTION + f'guard = "check"\nguard_layer = {toml}\n')
    message = rf"\[uniep\] guard_layer must be an integer, got {re.escape(repr(value))}$"
    with pytest.raises(ValueError, match=message):
        pf.check_launch(["--job.config_file", str(path)], world_size=1)


def test_misspelt_section_in_the_file_or_an_override_is_refused_before_torchrun_naming_the_closest(tmp_path):
    # Before: found by the worker's check, after torchrun had started (10.5 s on 2 cores).
    path = tmp_path / "job.toml"
    path.write_text(UNIEP_CONFIG.read_text().replace("[uniep]", "[unipe]"))
    with pytest.raises(ValueError) as err:
        pf.check_launch(["--job.config_file", str(path)], world_size=2)
    assert str(err.value).startswith(f"config file {str(path)!r}: [unipe] is not a section of the train config; "
                                      "did you mean [uniep]? Fix the section name in the file (the sections: job, "
                                      "profiling,"), err.value
    with pytest.raises(ValueError, match=r"^--trainng\.\* is not a section of the train config; did you mean "
                                         r"--training\.\*\? Fix the override"):
        pf.check_launch(["--job.config_file", str(UNIEP_CONFIG), "--trainng.steps", "3"], world_size=2)
    # [uniep] is a section only where custom_config_module merges it.
    path.write_text(UNIEP_CONFIG.read_text().replace('custom_config_module = "titan_uniep.config"', ""))
    with pytest.raises(ValueError, match=r"sets \[uniep\], but names no \[job\] custom_config_module: .*Add that "
                                         r"line under \[job\] \(or pass --job\.custom_config_module "
                                         r"titan_uniep\.config\)\.$"):
        pf.check_launch(["--job.config_file", str(path)], world_size=2)
    pf.check_launch(["--job.config_file", str(path), "--job.custom_config_module", "titan_uniep.config"], 2)


def _uniep_on(tmp_path, name: str | None) -> Path:
    """deepseek_v3_debug_uniep.toml with another [model] name (None: no name, TorchTitan's default)."""
    line = 'name = "deepseek_v3_uniep"\n'
    path = tmp_path / "job.toml"
    path.write_text(UNIEP_CONFIG.read_text().replace(line, f'name = "{name}"\n' if name else ""))
    return path


@pytest.mark.parametrize("name,extra,match", [
    # TorchTitan's own MoE model: it trains, as TorchTitan's MoE with the header "UniEP reference schedule".
    ("deepseek_v3", [], r"\[model\] name = 'deepseek_v3' is TorchTitan's own deepseek_v3, whose MoE blocks UniEP "
                        r"does not reach: the job would train TorchTitan's MoE\. Set \[model\] name = "
                        r"\"deepseek_v3_uniep\""),
    ("deepseek_v3_uniep", ["--model.name", "qwen3"], r"--model\.name qwen3 is TorchTitan's own qwen3.* Set \[model\] "
                                                    r"name = \"qwen3_uniep\""),
    # A model without MoE, and none at all (TorchTitan's default llama3).
    ("llama3", [], r"\[model\] name = 'llama3' is not a model UniEP serves: it reaches the MoE blocks of the \*_uniep "
                   r"models only\. Set \[model\] name to one of them \(\"deepseek_v3_uniep\", \"qwen3_uniep\", "
                   r"\"llama4_uniep\""),
    (None, [], r"\[model\] name \(unset: TorchTitan's default 'llama3'\) is not a model UniEP serves"),
    ("deepseek_v3_uniep", ["--model.name=deepseek_v3_unip"], r"--model\.name deepseek_v3_unip is not a model UniEP "
                                                             r"serves.* Did you mean deepseek_v3_uniep\?"),
])
def test_uniep_enabled_on_a_model_it_cannot_serve_is_refused_before_torchrun(tmp_path, name, extra, match):
    path = _uniep_on(tmp_path, name)
    with pytest.raises(ValueError, match=r"^config file .*: \[uniep\] enable = true, but " + match) as err:
        pf.check_launch(["--job.config_file", str(path), *extra], world_size=2)
    assert str(err.value).endswith("or set [uniep] enable = false."), err.value


def test_uniep_models_and_the_baseline_pairings_that_run_pass_the_launch_stage(tmp_path):
    pf.check_launch(["--job.config_file", str(UNIEP_CONFIG)], world_size=2)
    # A *_uniep model with enable = false trains like its base model (documented); a base model
    # with the [uniep] section off is the baseline.
    pf.check_launch(["--job.config_file", str(UNIEP_CONFIG), "--uniep.no-enable"], world_size=2)
    pf.check_launch(["--job.config_file", str(_uniep_on(tmp_path, "deepseek_v3")), "--uniep.no-enable"], 2)
    pf.check_launch(["--job.config_file", str(BASELINE_CONFIG)], world_size=2)


def test_run_train_refuses_uniep_on_torchtitans_own_model_at_once(tmp_path):
    # The report: deepseek_v3_debug_uniep.toml with [model] name = "deepseek_v3" trained TorchTitan's
    # own MoE (exit 0) under a header saying "UniEP reference schedule".
    start = time.monotonic()
    proc = _run_train(tmp_path, tmp_path, NGPU="2", CONFIG_FILE=str(_uniep_on(tmp_path, "deepseek_v3")))
    seconds = time.monotonic() - start
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert not (tmp_path / "args").exists(), "torchrun was launched"
    assert proc.stderr.startswith(f"run_train.sh: config file {str(tmp_path / 'job.toml')!r}: [uniep] enable = "
                                  "true, but [model] name = 'deepseek_v3' is TorchTitan's own deepseek_v3"), proc.stderr
    assert 'Set [model] name = "deepseek_v3_uniep"' in proc.stderr, proc.stderr
    assert seconds < 1.0, f"run_train.sh took {seconds:.2f} s to refuse it"


def test_run_train_refuses_a_misspelt_section_at_once(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text(UNIEP_CONFIG.read_text().replace("[uniep]", "[unipe]"))
    start = time.monotonic()
    proc = _run_train(tmp_path, tmp_path, NGPU="2", CONFIG_FILE=str(path))
    seconds = time.monotonic() - start
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert not (tmp_path / "args").exists(), "torchrun was launched"
    assert proc.stderr.startswith(f"run_train.sh: config file {str(path)!r}: [unipe] is not a section of the "
                                  "train config; did you mean [uniep]?"), proc.stderr
    assert seconds < 1.0, f"run_train.sh took {seconds:.2f} s to refuse it"


def test_the_worker_refuses_a_model_without_moe_layers_before_torchtitan_builds_it(monkeypatch):
    # Before: the parallelize hook refused it, after the process group and the model were built.
    from titan_uniep.torchtitan.v0_2 import train

    def torchtitan_main(trainer_class):
        raise AssertionError("TorchTitan started on a model without MoE layers")

    monkeypatch.setattr(train, "torchtitan_main", torchtitan_main)
    monkeypatch.setenv("WORLD_SIZE", "2")
    config = REPO / "train_configs" / "qwen3_debug_moe_uniep.toml"
    monkeypatch.setattr(sys, "argv", ["titan_uniep.torchtitan.train", "--job.config_file", str(config),
                                      "--model.flavor", "debugmodel"])  # qwen3's dense debug flavor
    with pytest.raises(SystemExit) as exit_info:
        train.main()
    assert str(exit_info.value.code) == (
        "error: [uniep] enable = true, but model 'qwen3_uniep' flavor 'debugmodel' has no MoE layers. Pick an MoE "
        "flavor (e.g. deepseek_v3 'debugmodel', qwen3 'debugmodel_moe', llama4 'debugmodel') or set [uniep] "
        "enable = false.")


def test_the_workers_own_check_refuses_uniep_on_torchtitans_model_as_torchtitan_parsed_it():
    # The edge's check reads TorchTitan's parse, so a spelling the launcher's reading misses is caught too.
    import dataclasses

    from titan_uniep.torchtitan.v0_2 import preflight as edge

    launch = pf.check_launch(["--job.config_file", str(UNIEP_CONFIG)], world_size=2)
    launch = dataclasses.replace(launch, argv=[*launch.argv, "--model.name", "deepseek_v3"])
    with pytest.raises(ValueError, match=r"^\[uniep\] enable = true, but \[model\] name = 'deepseek_v3' is "
                                         r"TorchTitan's own deepseek_v3"):
        edge.check_job(launch, world_size=2)


def test_launch_stage_reads_degrees_and_dump_folder_from_file_and_overrides():
    args = ["--job.config_file", str(BASELINE_CONFIG)]
    assert pf.check_launch(args, world_size=2).dump_folder == "./outputs/deepseek_v3_debug_baseline"
    launch = pf.check_launch(args + ["--parallelism.expert-parallel-degree=1", "--job.dump_folder", "out/x"], 1)
    assert launch.dump_folder == "out/x"
    with pytest.raises(ValueError, match=r"NGPU \(WORLD_SIZE\) = 3 .*expert_parallel_degree = 2"):
        pf.check_launch(args, world_size=3)


def test_launch_stage_defaults_are_torchtitans():
    import dataclasses

    from torchtitan.config.job_config import Job, JobConfig, Model, Parallelism

    from titan_uniep.config import JobConfig as UniEPJobConfig

    assert pf._DEGREE_DEFAULTS == {name: getattr(Parallelism(), name) for name in pf._DEGREE_DEFAULTS}
    assert pf._DUMP_FOLDER_DEFAULT == Job().dump_folder
    assert pf._MODEL_NAME_DEFAULT == Model().name
    assert pf._SECTIONS_0_2 == tuple(f.name for f in dataclasses.fields(JobConfig))
    assert [f.name for f in dataclasses.fields(UniEPJobConfig)] == ["uniep"]  # what custom_config_module adds


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
        (dict(data_parallel_shard_degree=4), 2, r"product is 4\.\nLaunch with NGPU = 4"),
        (dict(tensor_parallel_degree=2, expert_parallel_degree=1), 3, r"= 2 does not divide 3\.\nLaunch with NGPU = 2"),
        (dict(expert_parallel_degree=4, context_parallel_degree=2), 2, r"= 4 to divide .* = 2\.\nLaunch with NGPU = 4 or a"),
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


@pytest.mark.parametrize("converters", ["quantize.grouped_mm.float8", "quantize.linear.float8,quantize.grouped_mm.mx"])
def test_a_low_precision_experts_recipe_stops_at_start_up(converters):
    """TorchTitan's float8 / MX grouped-GEMM converters swap the experts' weights for torchao
    tensor subclasses, which UniEP's kernels do not run: no silent bf16 run under such a config."""
    with pytest.raises(ValueError, match=r"model\.converters has quantize\.grouped_mm\.(float8|mx): .*Remove "
                                         r"quantize\.grouped_mm\.\w+ from \[model\] converters"):
        pf.preflight(["--job.config_file", str(UNIEP_CONFIG), "--model.converters", converters], world_size=2)
    # Converters of other layers only (the linear float8 recipe) are the job's own business.
    pf.preflight(["--job.config_file", str(UNIEP_CONFIG), "--model.converters", "quantize.linear.float8"],
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
    from titan_uniep.torchtitan.v0_2 import train

    def torchtitan_main(trainer_class):
        raise AssertionError("TorchTitan started with 1 rank for an EP 2 config")

    monkeypatch.setattr(train, "torchtitan_main", torchtitan_main)
    monkeypatch.setenv("WORLD_SIZE", "1")  # as torchrun sets it for NGPU=1
    monkeypatch.setattr(sys, "argv", ["titan_uniep.torchtitan.train", "--job.config_file", str(UNIEP_CONFIG)])
    with pytest.raises(SystemExit) as exit_info:
        train.main()
    assert "error: NGPU (WORLD_SIZE) = 1 does not fit" in str(exit_info.value.code)


EP1_UNIEP_CONFIG = REPO / "train_configs" / "qwen3_debug_moe_ep1_uniep.toml"


# The EP = 1 pair is a GPU configuration; without CUDA the kernels compute in fp32 only, on the tiny flavor.
CPU_EP1 = ("--model.flavor", "debugmodel_moe_tiny", "--training.mixed_precision_param", "float32")


def _cached(cache: Path) -> list[str]:
    return ["--job.config_file", str(EP1_UNIEP_CONFIG), *CPU_EP1, "--uniep.tuning", "cached", "--uniep.tuning_cache",
            str(cache)]


def test_unreadable_or_foreign_tuning_cache_fails_preflight_naming_the_key(tmp_path):
    foreign = tmp_path / "foreign.json"
    foreign.write_text('{"format": "someone else\'s cache", "entries": []}')
    with pytest.raises(ValueError, match=r"\[uniep\] tuning_cache: tuning cache .*foreign\.json is not a 'titan_uniep "
                                         r"tuning cache' file.*Set \[uniep\] tuning_cache to a file written by"):
        pf.check_job(_cached(foreign), world_size=1)
    with pytest.raises(ValueError, match=r"\[uniep\] tuning_cache: tuning cache .* cannot be read"):
        pf.check_job(_cached(tmp_path), world_size=1)  # a folder
    # The report: --uniep.tuning_cache /etc/hostname was "not JSON ...; delete it or point to another file".
    hostname = tmp_path / "hostname"
    hostname.write_text("gpu-node-7\n")
    with pytest.raises(ValueError) as err:
        pf.check_job(_cached(hostname), world_size=1)
    message = str(err.value)
    assert message.startswith(f"[uniep] tuning_cache: tuning cache {hostname} is not JSON (Expecting value: line 1 "
                              "column 1 (char 0)), so titan_uniep did not write it"), message
    assert "leave it as it is and name another file for the cache (--uniep.tuning_cache PATH" in message, message
    assert "delete" not in message, message
    # No file yet: every shape runs the defaults, with a warning when its workspace is built.
    pf.check_job(_cached(tmp_path / "missing.json"), world_size=1)


def _run_train(cwd: Path, tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    """run_train.sh with a stand-in python3 that records the launch instead of training
    (its preflight runs in the real Python)."""
    stub = tmp_path / "bin" / "python3"
    stub.parent.mkdir(exist_ok=True)
    # "-c": run_train.sh's CUDA probe (answer: no GPU); "-m ...preflight": its checks, for real;
    # anything else: the torchrun launch.
    stub.write_text(f'#!/bin/sh\ncase "$1 $2" in "-c "*) exit 1;; "-m titan_uniep.torchtitan.preflight") '
                    f'exec {sys.executable} "$@";; esac\n'
                    'printf "%s\\n" "$@" > "$LAUNCH_ARGS"\n')
    stub.chmod(0o755)
    environ = {k: v for k, v in os.environ.items() if k not in ("NGPU", "CONFIG_FILE")}
    environ.update(PATH=f"{stub.parent}{os.pathsep}{environ['PATH']}", LAUNCH_ARGS=str(tmp_path / "args"), **env)
    return subprocess.run([str(REPO / "run_train.sh"), "--training.steps", "3", *args], cwd=cwd, env=environ,
                          capture_output=True, text=True, timeout=60)


def test_run_train_rejects_a_missing_config_file_at_once(tmp_path):
    proc = _run_train(tmp_path, tmp_path, CONFIG_FILE="train_configs/nope.toml")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"CONFIG_FILE=train_configs/nope.toml is not a file (looked in {tmp_path} and {REPO});" in proc.stderr
    assert not (tmp_path / "args").exists(), "torchrun was launched"


def test_run_train_names_the_checkout_once_when_run_from_it(tmp_path):
    proc = _run_train(REPO, tmp_path, CONFIG_FILE="train_configs/nope.toml")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"is not a file (looked in {REPO});" in proc.stderr, proc.stderr


def test_run_train_rejects_a_toml_syntax_error_at_once(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[job]\ndump_folder = out\n")
    proc = _run_train(tmp_path, tmp_path, CONFIG_FILE=str(bad))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "bad.toml' is not valid TOML" in proc.stderr and "line 2, column 15" in proc.stderr, proc.stderr
    assert not (tmp_path / "args").exists(), "torchrun was launched"


def test_run_train_with_a_wrong_ngpu_fails_within_a_second_with_the_message_last(tmp_path):
    # Before: the worker found it about 12 s after torchrun started, followed by ~40 lines of torchrun.
    start = time.monotonic()
    proc = _run_train(tmp_path, tmp_path, NGPU="1", CONFIG_FILE=str(UNIEP_CONFIG))
    seconds = time.monotonic() - start
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert not (tmp_path / "args").exists(), "torchrun was launched"
    lines = proc.stderr.splitlines()
    assert lines[0].startswith("run_train.sh: NGPU (WORLD_SIZE) = 1 does not fit the [parallelism] degrees "
                               "(expert_parallel_degree = 2, the others at their defaults)"), proc.stderr
    assert lines[-1] == "Launch with NGPU = 2 or a multiple of it, or change the [parallelism] degrees.", proc.stderr
    assert seconds < 1.0, f"run_train.sh took {seconds:.2f} s to refuse NGPU=1"


def test_run_train_rejects_a_misspelt_uniep_override_before_torchrun(tmp_path):
    proc = _run_train(tmp_path, tmp_path, "--uniep.shedule", "fused", NGPU="2", CONFIG_FILE=str(UNIEP_CONFIG))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.startswith("run_train.sh: --uniep.shedule is not a key of [uniep]; did you mean "
                                  "--uniep.schedule?"), proc.stderr
    assert not (tmp_path / "args").exists(), "torchrun was launched"


@pytest.mark.parametrize("config", ["train_configs/deepseek_v3_debug_uniep.toml", str(UNIEP_CONFIG)])
def test_run_train_finds_the_config_from_another_directory(tmp_path, config):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    proc = _run_train(elsewhere, tmp_path, NGPU="2", CONFIG_FILE=config)
    assert proc.returncode == 0, proc.stderr[-2000:]
    args = (tmp_path / "args").read_text().splitlines()
    assert args[args.index("--job.config_file") + 1] == str(UNIEP_CONFIG), args
    assert "--nproc_per_node=2" in args and args[-2:] == ["--training.steps", "3"], args


def test_run_train_keeps_torchruns_logs_in_the_dump_folder(tmp_path):
    # Not a /tmp/torchelastic_* folder per run: torchrun's default without --log-dir.
    proc = _run_train(tmp_path, tmp_path, "--job.dump_folder", "out/x", NGPU="2", CONFIG_FILE=str(UNIEP_CONFIG))
    assert proc.returncode == 0, proc.stderr[-2000:]
    args = (tmp_path / "args").read_text().splitlines()
    assert args[:2] == ["-m", "titan_uniep.torchtitan.torchrun"], args
    assert args[args.index("--log-dir") + 1] == "out/x/logs", args


@pytest.mark.slow
def test_a_workers_start_up_error_is_the_last_thing_printed_without_torchruns_traceback(tmp_path):
    # A foreign tuning cache is found by the worker's preflight (after TorchTitan's import), not before torchrun.
    foreign = tmp_path / "foreign.json"
    foreign.write_text("[1, 2]")
    env = {k: v for k, v in os.environ.items() if k not in ("NGPU", "CONFIG_FILE")}
    env.update(NGPU="1", CONFIG_FILE=str(EP1_UNIEP_CONFIG), CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([str(REPO / "run_train.sh"), *_cached(foreign)[2:], "--job.dump_folder", str(tmp_path / "run")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "ChildFailedError" not in proc.stderr, proc.stderr
    lines = proc.stderr.splitlines()
    assert lines[-2:] == ["rank 0 failed first (exit code 1):",
                          f"[uniep] tuning_cache: tuning cache {foreign} is not a 'titan_uniep tuning cache' file "
                          "(no matching 'format' field), so titan_uniep did not write it (its tuning caches are JSON "
                          "objects with \"format\": \"titan_uniep tuning cache\"): leave it as it is and name another "
                          "file for the cache (--uniep.tuning_cache PATH, or --cache PATH of titan_uniep.tools.tune). "
                          "Set [uniep] tuning_cache to a file written by "
                          "`python -m titan_uniep.tools.tune` (or to a path that does not exist yet), or tuning = \"off\"."
                          ], proc.stderr
    assert lines[-3] == f"every rank's output: {tmp_path / 'run' / 'logs'}", proc.stderr
    assert list((tmp_path / "run" / "logs").glob("*/attempt_0/0/stderr.log")), "no rank log"
