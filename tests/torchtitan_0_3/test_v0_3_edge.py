"""The TorchTitan 0.3.0 edge without training: the uniep section through TorchTitan's
config manager, its errors, the TOML form, the start-up checks, and UniEP's routed
experts against TorchTitan's on one layer."""

from __future__ import annotations

import pytest
from torchtitan_release import requires_torchtitan

requires_torchtitan("0.3.0")

import textwrap  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torchtitan.config import ConfigManager  # noqa: E402
from torchtitan.models.common.moe import RoutedExperts  # noqa: E402
from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher  # noqa: E402

from titan_uniep.torchtitan import preflight  # noqa: E402
from titan_uniep.torchtitan.v0_3.experts import UniEPRoutedExperts, apply_uniep  # noqa: E402
from titan_uniep.torchtitan.v0_3.preflight import parse_job  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
MODULE = ("--module", "titan_uniep.torchtitan.v0_3")


def _experts(config) -> list:
    return [layer.moe.routed_experts for layer in config.model_spec.model.layers if layer.moe is not None]


def test_the_hook_entry_hands_on_to_the_0_3_edge():
    import titan_uniep.parallelize as hook

    assert hook.UniEPRoutedExperts is UniEPRoutedExperts and callable(hook.uniep_routed_experts)


def test_uniep_options_on_the_cli_reach_every_routed_experts_node():
    config = ConfigManager().parse_args([*MODULE, "--config", "qwen3_debug_moe_uniep", "--uniep.compute_dtype",
                                         "float32", "--uniep.guard", "check"])
    experts = _experts(config)
    assert len(experts) == 8 and all(type(e) is UniEPRoutedExperts.Config for e in experts)
    assert {(e.uniep.schedule, e.uniep.compute_dtype, e.uniep.guard) for e in experts} == {
        ("reference", "float32", "check")}
    assert all(e.token_dispatcher is None for e in experts), "UniEP's experts build no token dispatcher"


def test_enable_false_restores_torchtitans_experts_with_their_dispatcher():
    config = ConfigManager().parse_args([*MODULE, "--config", "qwen3_debug_moe_uniep", "--uniep.no-enable"])
    experts = _experts(config)
    assert all(type(e) is RoutedExperts.Config for e in experts)
    assert all(type(e.token_dispatcher) is AllToAllTokenDispatcher.Config for e in experts)
    baseline = ConfigManager().parse_args([*MODULE, "--config", "qwen3_debug_moe_baseline"])
    for restored, own in zip(experts, _experts(baseline), strict=True):
        assert restored.token_dispatcher == own.token_dispatcher
        assert (restored.inner_experts.dim, restored.inner_experts.hidden_dim, restored.inner_experts.num_experts) == (
            own.inner_experts.dim, own.inner_experts.hidden_dim, own.inner_experts.num_experts)


@pytest.mark.parametrize("args,match", [
    (("--config", "qwen3_debug_moe_uniep", "--uniep.schedule", "fused"),
     r"uniep\.schedule = 'fused' needs CUDA GPUs with peer access at parallelism\.expert_parallel_degree = 2.*"
     r"--uniep\.schedule reference"),
    (("--config", "qwen3_debug_moe_tiny_ep1_uniep", "--uniep.compute_dtype", "auto"),
     r"Triton's interpreter, which computes in fp32 only.*Set --uniep\.compute_dtype float32"),
    (("--config", "qwen3_debug_moe_tiny_ep1_uniep", "--uniep.tuning", "search"),
     r"uniep\.tuning = \"search\".*--uniep\.tuning cached"),
    (("--config", "qwen3_debug_moe_uniep", "--parallelism.tensor_parallel_degree", "2"),
     r"tensor parallelism on MoE blocks.*--parallelism\.tensor_parallel_degree 1"),
])
def test_configurations_uniep_cannot_serve_fail_naming_the_key_and_the_fix(args, match):
    with pytest.raises(ValueError, match=match):
        parse_job([*MODULE, *args])


@pytest.mark.parametrize("converter", ["float8", "mx"])
def test_a_low_precision_experts_converter_is_refused_not_trained_in_bf16(converter):
    """TorchTitan's float8 / MX grouped-experts converters (applied in the model registry,
    before UniEP's override) swap ``inner_experts`` for a quantized subclass; UniEP's node
    would keep only its weights and train the experts in bf16. The converters need torchao
    and an SM89+ GPU to be built, so the test runs their ``convert`` alone."""
    from torchtitan.components.quantization.float8 import Float8GroupedExpertsConverter
    from torchtitan.components.quantization.mx import MXFP8GroupedExpertsConverter

    from titan_uniep.config import UniEP
    from titan_uniep.torchtitan.v0_3.trainer import validate

    cls = {"float8": Float8GroupedExpertsConverter, "mx": MXFP8GroupedExpertsConverter}[converter]
    instance = object.__new__(cls)
    instance.config = cls.Config()
    job = ConfigManager().parse_args([*MODULE, "--config", "qwen3_debug_moe_uniep"])
    validate(job)  # as bundled: served
    model = instance.convert(ConfigManager().parse_args([*MODULE, "--config", "qwen3_debug_moe_baseline"])
                             .model_spec.model)
    apply_uniep(model, UniEP(enable=True))
    job.model_spec.model = model
    with pytest.raises(ValueError, match=r"grouped experts are (Float8|MXFP8)GroupedExperts, from a TorchTitan "
                                         r"quantization converter.*Drop the grouped-experts converter"):
        validate(job)


@pytest.mark.parametrize("args,match", [
    (("--training.no-disable-cuda-graphs",), r"uniep\.schedule = \"reference\" sizes its all-to-all on the host.*"
                                             r"--training\.disable_cuda_graphs"),
    (("--uniep.schedule", "fused", "--uniep.guard", "check", "--training.no-disable-cuda-graphs"),
     r"uniep\.guard = 'check'.*Set --training\.disable_cuda_graphs"),
])
def test_under_cuda_graphs_host_syncing_options_fail_naming_the_fix(monkeypatch, args, match):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # TorchTitan's graphs apply on CUDA only
    with pytest.raises(ValueError, match=match):
        parse_job([*MODULE, "--config", "qwen3_debug_moe_uniep", *args])


def test_fused_schedule_runs_under_cuda_graphs_by_default(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    config = parse_job([*MODULE, "--config", "qwen3_debug_moe_ep1_uniep"])
    assert config.training.disable_cuda_graphs is False and config.uniep.schedule == "fused"


# ---- the TOML form ----------------------------------------------------------------------


def _toml(tmp_path, body: str) -> str:
    path = tmp_path / "job.toml"
    path.write_text(textwrap.dedent(body))
    return str(path)


def test_toml_names_module_and_config_and_the_command_line_wins(tmp_path):
    path = _toml(tmp_path, """
        module = "titan_uniep.torchtitan.v0_3"
        config = "deepseek_v3_debug_uniep"
        dump_folder = "out/x"
        [training]
        steps = 7
        local_batch_size = 2
        [uniep]
        compute_dtype = "float32"
        """)
    config = parse_job(["--job.config_file", path, "--training.steps", "3"])
    assert (config.dump_folder, config.training.steps, config.training.local_batch_size) == ("out/x", 3, 2)
    assert config.model_spec.name == "deepseek_v3" and config.uniep.compute_dtype == "float32"
    assert {e.uniep.compute_dtype for e in _experts(config)} == {"float32"}
    # The command line names another config of the registry: it wins over the file's.
    other = parse_job(["--job.config_file", path, "--config", "qwen3_debug_moe_uniep"])
    assert other.model_spec.name == "qwen3" and other.training.steps == 7


@pytest.mark.parametrize("body,match", [
    ('[training]\nstesp = 3\n', r"job\.toml', line 4 \(training\.stesp\): stesp is not a key of training; did you "
                                r"mean steps\?"),
    ('[training]\nsteps = "ten"\n', r"line 4 \(training\.steps\): training\.steps = 'ten' is not of type int\. "
                                  r"Fix the value"),
    ('[uniep]\nshedule = "fused"\n', r"line 4 \(uniep\.shedule\): shedule is not a key of uniep; did you mean "
                                     r"schedule\?"),
    ('[dump_folder]\nx = 1\n', r"line 3 \(dump_folder\): dump_folder is not a section"),
])
def test_toml_errors_name_the_line_and_the_key(tmp_path, body, match):
    path = _toml(tmp_path, 'module = "titan_uniep.torchtitan.v0_3"\nconfig = "qwen3_debug_moe_uniep"\n' + body)
    with pytest.raises(ValueError, match=match):
        parse_job(["--job.config_file", path])


def test_toml_without_module_and_config_names_both(tmp_path):
    path = _toml(tmp_path, "[training]\nsteps = 3\n")
    with pytest.raises(ValueError, match=r"names no module: add a top-level line module = "):
        parse_job(["--job.config_file", path])


def test_every_bundled_toml_parses_to_its_registry_config(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # as on the GPU machines the EP = 1 pairs are for
    for path in sorted((REPO / "train_configs" / "torchtitan_0_3").glob("*.toml")):
        config = parse_job(["--job.config_file", str(path)])
        assert config.uniep.enable == path.stem.endswith("_uniep"), path.name
        assert config.dump_folder == f"./outputs/{path.stem}", path.name


def test_run_train_refuses_a_toml_of_the_other_release_naming_both(tmp_path):
    with pytest.raises(ValueError, match=r"is a TorchTitan 0\.2\.2 train config .* and TorchTitan 0\.3\.0 is "
                                         r"installed\. Use a 0\.3\.0 train config, e\.g\. CONFIG_FILE=train_configs/"
                                         r"torchtitan_0_3/"):
        preflight.check_launch(["--job.config_file", str(REPO / "train_configs" / "deepseek_v3_debug_uniep.toml")], 2)
    launch = preflight.check_launch(["--job.config_file", str(REPO / "train_configs" / "torchtitan_0_3" /
                                                              "deepseek_v3_debug_uniep.toml"), "--dump_folder", "o"], 2)
    assert launch.dump_folder == "o"


def test_launch_stage_names_are_torchtitans():
    import dataclasses

    from torchtitan.experiments import _supported_experiments
    from torchtitan.models import _supported_models

    from titan_uniep.torchtitan.v0_3.trainer import UniEPTrainer

    fields = [f.name for f in dataclasses.fields(UniEPTrainer.Config) if f.init]
    assert sorted(preflight._SECTIONS_0_3 + preflight._TOP_LEVEL_KEYS_0_3) == sorted(fields + ["module", "config"])
    assert preflight._TORCHTITAN_MODULES_0_3 == _supported_models | _supported_experiments


def test_misspelt_section_is_refused_before_torchrun_naming_the_closest(tmp_path, capsys):
    # Before: found by the worker's parse, after torchrun had started.
    path = _toml(tmp_path, (REPO / "train_configs" / "torchtitan_0_3" / "deepseek_v3_debug_uniep.toml").read_text()
                 .replace("[uniep]", "[unipe]"))
    assert preflight.main(["2", "--job.config_file", path]) == 2  # run_train.sh's check
    assert capsys.readouterr().err.startswith(
        f"run_train.sh: config file {path!r}: [unipe] is not a section of the train config; did you mean [uniep]? "
        "Fix the section name in the file (the sections: profiler, metrics,"), "the worker's message, or none"
    with pytest.raises(ValueError, match=r"^--unipe\.\* is not a section of the train config; did you mean "
                                         r"--uniep\.\*\? Fix the override"):
        preflight.check_launch(["--job.config_file", str(REPO / "train_configs" / "torchtitan_0_3" /
                                                         "deepseek_v3_debug_uniep.toml"), "--unipe.enable"], 2)
    # A top-level field written as a table is the worker's to refuse, with its line.
    table = _toml(tmp_path, 'module = "titan_uniep.torchtitan.v0_3"\nconfig = "qwen3_debug_moe_uniep"\n[dump_folder]\n')
    preflight.check_launch(["--job.config_file", table], 2)


@pytest.mark.parametrize("module,given_as", [
    ("deepseek_v3", "module = 'deepseek_v3'"),
    ("torchtitan.models.qwen3", "module = 'torchtitan.models.qwen3'"),
    ("--module qwen3", "--module qwen3"),
])
def test_uniep_on_torchtitans_own_registry_is_refused_before_torchrun_and_in_the_worker(tmp_path, module, given_as):
    # TorchTitan's configs have no uniep section: its MoE would train. Before: the worker's parse
    # refused it as "uniep is not a key of the top level; did you mean ...?", after torchrun.
    in_file = not module.startswith("--")
    path = _toml(tmp_path, f'module = "{module if in_file else "deepseek_v3"}"\n'
                           'config = "deepseek_v3_debugmodel"\n[uniep]\nenable = true\n')
    args = ["--job.config_file", path, *([] if in_file else module.split())]
    message = (rf"^config file '.*job\.toml': {given_as} is TorchTitan's own config registry, and the job sets "
               r"\[uniep\]: TorchTitan's configs have no uniep section, so it would train TorchTitan's MoE without "
               r"UniEP\. .*module = \"titan_uniep\.torchtitan\.v0_3\".* or remove \[uniep\]\.$")
    with pytest.raises(ValueError, match=message):
        preflight.check_launch(args, 2)
    with pytest.raises(ValueError, match=message):
        parse_job(args)
    with pytest.raises(ValueError, match=r"^--module qwen3 is TorchTitan's own config registry, and the job sets "
                                         r"--uniep\.enable: .* or remove --uniep\.enable\.$"):
        parse_job(["--module", "qwen3", "--config", "qwen3_debugmodel", "--uniep.enable"])


def test_uniep_on_a_config_without_the_section_is_refused_in_the_worker(tmp_path, monkeypatch):
    # Another registry's config: only TorchTitan's import of it tells whether it has a uniep section.
    (tmp_path / "my_registry.py").write_text("from torchtitan.models.qwen3.config_registry import qwen3_debugmodel\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    path = _toml(tmp_path, 'module = "my_registry"\nconfig = "qwen3_debugmodel"\n\n[uniep]\nenable = true\n')
    preflight.check_launch(["--job.config_file", path], 2)
    with pytest.raises(ValueError, match=r"job\.toml', line 4 \(uniep\): this config \(Trainer\.Config\) has no uniep "
                                         r"section, so it would train without UniEP\. .*set module = "
                                         r"\"titan_uniep\.torchtitan\.v0_3\" and one of its configs, or remove "
                                         r"\[uniep\]\."):
        parse_job(["--job.config_file", path])


def test_the_shared_job_check_runs_the_edges_parse():
    config = preflight.check_job([*MODULE, "--config", "qwen3_debug_moe_uniep", "--training.steps", "2"], 2)
    assert config.uniep.enable and config.training.steps == 2
    assert preflight.preflight([*MODULE, "--config", "qwen3_debug_moe_uniep"], 2) == []


# ---- one layer against TorchTitan's --------------------------------------------------------


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path_factory.mktemp('pg') / 'store'}", rank=0,
                            world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


@pytest.mark.parametrize("compute_dtype,rtol", [("auto", 2e-2), ("float32", 2e-2)])
def test_uniep_experts_match_torchtitans_on_one_layer_with_the_same_parameters(group, compute_dtype, rtol):
    from titan_uniep.config import UniEP

    torch.manual_seed(0)
    config = ConfigManager().parse_args([*MODULE, "--config", "qwen3_debug_moe_tiny_ep1_baseline"])
    stock_cfg = _experts(config)[0]
    model_cfg = config.model_spec.model
    apply_uniep(model_cfg, UniEP(enable=True, schedule="reference", compute_dtype=compute_dtype))
    uniep_cfg = _experts(config)[0]
    stock, uniep = stock_cfg.build(), uniep_cfg.build()
    assert [n for n, _ in stock.named_parameters()] == [n for n, _ in uniep.named_parameters()], \
        "the same FQNs: checkpoints interchange"
    for module in (stock, uniep):
        module.to_empty(device="cpu")
        module.init_states()
    uniep.load_state_dict(stock.state_dict())
    uniep.ep_group = group
    B, L, D, E, K = 2, 8, 16, 4, 2
    x = torch.randn(B, L, D, requires_grad=True)
    scores, ids = torch.rand(B, L, E).softmax(-1).topk(K, dim=-1)
    counts = torch.bincount(ids.flatten(), minlength=E)
    out = uniep(x, scores, ids, counts)
    ref = stock(x, scores, ids, counts)
    assert out.shape == ref.shape == (B, L, D) and out.dtype == x.dtype
    torch.testing.assert_close(out, ref, rtol=rtol, atol=rtol * ref.abs().max().item())
    out.sum().backward()
    assert uniep.inner_experts.w1_EFD.grad is not None and torch.isfinite(x.grad).all()
