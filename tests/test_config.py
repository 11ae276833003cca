"""The [uniep] section through TorchTitan's own config manager, and every error it promises."""

from __future__ import annotations

import pytest
from torchtitan_release import requires_torchtitan

requires_torchtitan("0.2.2")  # the TorchTitan 0.2.2 edge

import copy
import re
import textwrap

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torchtitan.config import ConfigManager
from torchtitan.distributed import ParallelDims
from torchtitan.protocols.train_spec import get_train_spec

from titan_uniep.config import UniEP
from titan_uniep.torchtitan import v0_2  # registers the *_uniep train specs
from titan_uniep.torchtitan.v0_2.parallelize import validate


def _parse(tmp_path, body: str, *cli: str):
    path = tmp_path / "job.toml"
    path.write_text(textwrap.dedent(body))
    return ConfigManager().parse_args(["--job.config_file", str(path), *cli])


HEADER = """
[job]
custom_config_module = "titan_uniep.config"
[experimental]
custom_import = "titan_uniep.torchtitan.v0_2"
[model]
name = "deepseek_v3_uniep"
flavor = "debugmodel"
"""


def test_uniep_section_is_merged_into_torchtitan_job_config(tmp_path):
    cfg = _parse(tmp_path, HEADER + '[uniep]\nenable = true\nguard = "check"\nguard_interval = 5\n')
    assert cfg.uniep.enable is True
    assert cfg.uniep.schedule == "reference"
    assert (cfg.uniep.guard, cfg.uniep.guard_interval) == ("check", 5)
    # CLI overrides reach the section too, as for TorchTitan's own sections.
    cfg = _parse(tmp_path, HEADER + "[uniep]\nenable = true\n", "--uniep.guard", "strict")
    assert cfg.uniep.guard == "strict"


def test_unknown_key_is_rejected_with_its_name(tmp_path):
    with pytest.raises(ValueError, match="schedul"):
        _parse(tmp_path, HEADER + '[uniep]\nenable = true\nschedul = "fused"\n')


@pytest.mark.parametrize(
    "line,match",
    [
        ('schedule = "overlapped"', r"\[uniep\] schedule = 'overlapped' is not a schedule; use one of 'reference'"),
        ('guard = "loud"', r"\[uniep\] guard = 'loud' is not a guard mode"),
        ("guard_interval = 0", r"\[uniep\] guard_interval must be a positive integer"),
        ('enable = "yes"', r"\[uniep\] enable must be true or false"),
    ],
)
def test_unknown_value_is_rejected_with_key_and_choices(tmp_path, line, match):
    with pytest.raises(ValueError, match=match):
        _parse(tmp_path, HEADER + f"[uniep]\n{line}\n")


@pytest.mark.parametrize("value", [True, "last", 1.5], ids=["bool", "str", "float"])
def test_guard_layer_that_is_not_an_integer_is_refused_naming_the_key(value):
    """``guard_layer = true`` would pass as layer 1 (a bool is an int in
    Python), ``"last"`` and ``1.5`` would fail only at the first guarded
    step, deep in training: each is refused where the section is built."""
    message = rf"^\[uniep\] guard_layer must be an integer, got {re.escape(repr(value))}$"
    with pytest.raises(ValueError, match=message):
        UniEP(enable=True, guard="check", guard_layer=value)


def _model(name: str, flavor: str, job):
    spec = get_train_spec(name)
    args = copy.deepcopy(spec.model_args[flavor])
    args.update_from_config(job)  # as torchtitan.train does before building
    with torch.device("meta"):
        return spec, spec.model_cls(args)


def _job(tmp_path, name="deepseek_v3_uniep", flavor="debugmodel", extra=""):
    return _parse(
        tmp_path,
        HEADER.replace("deepseek_v3_uniep", name).replace('"debugmodel"', f'"{flavor}"')
        + "[uniep]\nenable = true\n"
        + extra,
    )


def _dims(ep=2, tp=1, etp=1, world=2):
    return ParallelDims(dp_shard=-1, dp_replicate=1, cp=1, tp=tp, pp=1, ep=ep, etp=etp, world_size=world)


def test_expert_parallel_degree_1_is_served_with_a_one_rank_group(tmp_path):
    """EP = 1: TorchTitan shards no experts; the hook gives every MoE layer's
    experts this rank's own group (here the whole one-process world), and the
    kernel schedules pass validation also without CUDA (Triton's interpreter)."""
    from titan_uniep.torchtitan.v0_2.moe import UniEPGroupedExperts
    from titan_uniep.torchtitan.v0_2.parallelize import moe_layers, one_rank_group

    job = _job(tmp_path, "qwen3_uniep", "debugmodel_moe_tiny", extra='schedule = "fused"\n')
    job.training.mixed_precision_param = "float32"  # the interpreter computes in fp32 only
    spec, model = _model("qwen3_uniep", "debugmodel_moe_tiny", job)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = spec.parallelize_fn(model, _dims(ep=1, world=1), job)  # TorchTitan's own parallelize inside
        layers = moe_layers(model)
        assert layers
        for name, moe in layers:
            assert isinstance(moe.experts, UniEPGroupedExperts), name
            assert moe.experts.ep_group is one_rank_group(), name
            assert moe.experts.ep_group.size() == 1 and moe.experts.schedule == "fused", name
            assert not isinstance(moe.experts.w1, DTensor), f"{name}: experts sharded at EP = 1"
    finally:
        one_rank_group.cache_clear()
        dist.destroy_process_group()


def test_expert_tensor_parallelism_is_refused(tmp_path):
    job = _job(tmp_path)
    spec, model = _model("deepseek_v3_uniep", "debugmodel", job)
    with pytest.raises(ValueError, match=r"expert_tensor_parallel_degree > 1 \(got 2\)"):
        spec.parallelize_fn(model, _dims(ep=2, tp=2, etp=2, world=4), job)


def test_tensor_parallel_moe_is_refused(tmp_path):
    job = _job(tmp_path)
    spec, model = _model("deepseek_v3_uniep", "debugmodel", job)
    with pytest.raises(ValueError, match=r"tensor_parallel_degree = 2"):
        spec.parallelize_fn(model, _dims(ep=2, tp=2, etp=1, world=4), job)


def test_model_without_moe_layers_is_refused(tmp_path):
    job = _job(tmp_path, "qwen3_uniep", "debugmodel")
    spec, model = _model("qwen3_uniep", "debugmodel", job)  # qwen3's dense debug flavor
    with pytest.raises(ValueError, match=r"has no MoE layers"):
        spec.parallelize_fn(model, _dims(), job)


def test_deepep_backend_conflicts(tmp_path):
    job = _job(tmp_path)
    spec, model = _model("deepseek_v3_uniep", "debugmodel", job)
    job.parallelism.expert_parallel_comm_backend = "deepep"
    with pytest.raises(ValueError, match=r"expert_parallel_comm_backend = 'deepep'"):
        spec.parallelize_fn(model, _dims(), job)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
def test_fused_schedule_without_cuda_is_refused(tmp_path):
    job = _job(tmp_path, extra='schedule = "fused"\n')
    spec, model = _model("deepseek_v3_uniep", "debugmodel", job)
    with pytest.raises(ValueError, match=r"\[uniep\] schedule = 'fused'.*(needs CUDA|not available)"):
        spec.parallelize_fn(model, _dims(), job)


def test_disabled_uniep_calls_only_the_base_parallelize(tmp_path):
    spec = get_train_spec("qwen3_uniep")
    calls = []
    base = spec.parallelize_fn.__wrapped__
    from titan_uniep.torchtitan.v0_2.parallelize import wrap_parallelize_fn

    wrapped = wrap_parallelize_fn(lambda m, d, j: calls.append((m, d, j)) or m)
    job = _parse(tmp_path, HEADER + "[uniep]\nenable = false\n")
    sentinel = torch.nn.Linear(1, 1)
    assert wrapped(sentinel, "dims", job) is sentinel
    assert calls == [(sentinel, "dims", job)]
    assert type(sentinel) is torch.nn.Linear
    assert base is get_train_spec("qwen3").parallelize_fn


def test_uniep_train_specs_are_registered():
    for name, base in v0_2.UNIEP_MODELS.items():
        spec, base_spec = get_train_spec(name), get_train_spec(base)
        assert spec.model_cls is base_spec.model_cls
        assert spec.model_args is base_spec.model_args
        assert spec.parallelize_fn.__wrapped__ is base_spec.parallelize_fn


def test_defaults_are_off():
    cfg = UniEP()
    assert (cfg.enable, cfg.schedule, cfg.guard) == (False, "reference", "off")


def _fused_job_on_probed_gpus(tmp_path, monkeypatch, gpus):
    """A fused-schedule job whose EP group's GPUs are ``gpus`` (the probe needs CUDA; here it is replaced)."""
    from titan_uniep.torchtitan.v0_2 import parallelize

    job = _job(tmp_path, extra='schedule = "fused"\n')
    spec, model = _model("deepseek_v3_uniep", "debugmodel", job)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # past validate's no-CUDA check
    monkeypatch.setattr(parallelize, "_probe_ep_gpus", lambda parallel_dims: gpus)
    return lambda: spec.parallelize_fn(model, _dims(world=len(gpus)), job)


def test_fused_ep_group_spanning_hosts_is_refused(tmp_path, monkeypatch):
    from titan_uniep.torchtitan.v0_2.parallelize import EPGPU

    gpus = [EPGPU(0, "node-a", ()), EPGPU(1, "node-b", ())]
    run = _fused_job_on_probed_gpus(tmp_path, monkeypatch, gpus)
    with pytest.raises(ValueError, match=r"schedule = 'fused' needs the whole EP group on one host.*spans 2 hosts "
                                         r"\(node-a: ranks \[0\]; node-b: ranks \[1\]\).*schedule = \"reference\""):
        run()


def test_fused_ep_group_without_peer_access_is_refused(tmp_path, monkeypatch):
    from titan_uniep.torchtitan.v0_2.parallelize import EPGPU

    gpus = [EPGPU(0, "node-a", ()), EPGPU(1, "node-a", (0,))]  # rank 1's GPU cannot map rank 0's
    run = _fused_job_on_probed_gpus(tmp_path, monkeypatch, gpus)
    with pytest.raises(ValueError, match=r"needs peer access .* missing for rank 1 -> rank 0 on node-a.*"
                                         r"schedule = \"reference\""):
        run()


def test_ep_group_on_one_host_with_peer_access_passes_the_check():
    from titan_uniep.torchtitan.v0_2.parallelize import EPGPU, check_ep_gpus

    check_ep_gpus(UniEP(enable=True, schedule="fused"), [EPGPU(r, "node-a", ()) for r in range(4)])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
@pytest.mark.parametrize("flavor,precision,why", [
    ("debugmodel_moe", "float32",
     r"grouped-GEMM experts of model 'qwen3_uniep' flavor 'debugmodel_moe' compute in bf16"),
    ("debugmodel_moe_tiny", "bfloat16", r"training.mixed_precision_param = 'bfloat16'"),
])
def test_kernel_schedule_without_cuda_refuses_bf16_experts_naming_why_and_the_cpu_flavor(tmp_path, flavor, precision,
                                                                                          why):
    """EP = 1 without CUDA runs the kernels in the interpreter (fp32 only): a job
    whose experts compute in bf16 is a GPU configuration, refused before the
    model exists (preflight) and in the hook alike."""
    job = _job(tmp_path, "qwen3_uniep", flavor, extra='schedule = "fused"\n')
    job.training.mixed_precision_param = precision
    dims = _dims(ep=1, world=1)
    message = rf"{why}\): it is a GPU configuration.*--model.flavor debugmodel_moe_tiny"
    with pytest.raises(ValueError, match=message):
        validate(job.uniep, None, dims, job)
    _spec, model = _model("qwen3_uniep", flavor, job)
    with pytest.raises(ValueError, match=message):
        validate(job.uniep, model, dims, job)
    job.uniep.compute_dtype = "float32"  # asked for explicitly: served (slowly)
    if flavor == "debugmodel_moe":
        validate(job.uniep, model, dims, job)
