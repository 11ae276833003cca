"""The TorchTitan hook: swap MoE blocks' expert-parallel path for UniEP's.

``wrap_parallelize_fn(base)`` returns a parallelize_fn that, when
``[uniep] enable = true``:

1. validates the job (no ETP/TP on MoE, a model with MoE layers, a schedule
   this machine can run; for the kernel schedules at EP > 1, an EP group on
   one host with peer access) with errors that name the key and the fix;
2. swaps each ``MoE`` / ``GroupedExperts`` instance's class for UniEP's
   (parameters, buffers and FQNs stay the very same objects, so FSDP,
   activation checkpointing and checkpoints interchange with a baseline run);
3. runs the base parallelize_fn with ``UniEPExpertParallel`` as the plan that
   TorchTitan's ``apply_moe_ep_tp`` puts on ``moe.experts``; at EP = 1, where
   TorchTitan shards no experts, each rank's experts get a one-rank group
   (all experts, this rank's tokens, no peer traffic);
4. installs the step counter, the bitwise guard if ``[uniep] guard`` asks
   for it, and the ``UNIEP_TEST_*`` hooks of ``titan_uniep.testing`` if set.

With ``enable = false`` it calls the base parallelize_fn and nothing else.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Callable, Iterator

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle
from torchtitan.models.moe.moe import GroupedExperts, MoE

from titan_uniep.compute_dtype import job_compute_dtype, job_weight_grad_dtype, resolve
from titan_uniep.config import UniEP
from titan_uniep.schedules import available_schedules
from titan_uniep.testing import UniEPTestHooks
from titan_uniep.torchtitan.ep_group import EPGPU, check_ep_gpus, one_rank_group, probe_ep_gpus
from titan_uniep.torchtitan.layer import BitwiseGuard, StepCounter
from titan_uniep.torchtitan.v0_2.moe import UniEPGroupedExperts, UniEPMoE

logger = logging.getLogger(__name__)

__all__ = ["EPGPU", "UniEPExpertParallel", "check_ep_gpus", "check_moe_layers", "kernel_dtype", "moe_layers",
           "validate", "wrap_parallelize_fn"]


class UniEPExpertParallel(ParallelStyle):
    """EP plan for UniEP experts: TorchTitan's Shard(0) expert sharding, no hooks.

    TorchTitan's ``ExpertParallel`` dispatches in a forward pre-hook and
    combines in a forward hook around the grouped GEMM. UniEP fuses both with
    the GEMMs, so its experts module does the exchange itself; this style
    only shards the expert weights on the EP mesh exactly as TorchTitan does
    (so checkpoints and FSDP's expert sharding match) and hands the module
    its EP group.
    """

    def _partition_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        for param_name, param in module.named_parameters(recurse=False):
            module.register_parameter(param_name, nn.Parameter(distribute_tensor(param, device_mesh, [Shard(0)])))

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, UniEPGroupedExperts):
            raise TypeError(
                f"UniEPExpertParallel applies to UniEPGroupedExperts, got {type(module).__name__}; "
                "the MoE blocks must be swapped by titan_uniep.parallelize first"
            )
        module = distribute_module(module, device_mesh, partition_fn=self._partition_fn)
        module.ep_group = device_mesh.get_group()
        return module


def moe_layers(model: nn.Module) -> list[tuple[str, MoE]]:
    """``(fqn, module)`` of every TorchTitan MoE block, in model order."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, MoE)]


def check_moe_layers(model: nn.Module, job_config) -> None:
    """Raise ValueError naming the key and the fix if ``model`` has no MoE block for UniEP to serve."""
    if not moe_layers(model):
        raise ValueError(
            f"[uniep] enable = true, but model {job_config.model.name!r} flavor {job_config.model.flavor!r} has "
            "no MoE layers. Pick an MoE flavor (e.g. deepseek_v3 'debugmodel', qwen3 'debugmodel_moe', llama4 "
            "'debugmodel') or set [uniep] enable = false."
        )


def validate(cfg: UniEP, model: nn.Module | None, parallel_dims, job_config) -> None:
    """Raise ValueError naming the key and the fix if UniEP cannot serve this job.

    ``model=None`` runs the checks that need only the config (``titan_uniep.torchtitan.v0_2.preflight``,
    which then runs ``check_moe_layers`` on the model built on the meta device).
    """
    model_name = job_config.model.name
    if model is not None:
        check_moe_layers(model, job_config)
    if parallel_dims.etp > 1:
        raise ValueError(
            f"[uniep] enable = true does not support parallelism.expert_tensor_parallel_degree > 1 "
            f"(got {parallel_dims.etp}). Set expert_tensor_parallel_degree = 1, or [uniep] enable = false."
        )
    if parallel_dims.tp > 1:
        raise ValueError(
            f"[uniep] enable = true does not support tensor parallelism on MoE blocks "
            f"(parallelism.tensor_parallel_degree = {parallel_dims.tp}). Set tensor_parallel_degree = 1, "
            "or [uniep] enable = false."
        )
    experts_converters = [c for c in job_config.model.converters if c.startswith("quantize.grouped_mm.")]
    if experts_converters:
        # The converter swaps the experts' weights for torchao tensor subclasses (dynamic
        # float8 / MX scaling in their grouped GEMMs); UniEP's kernels compute in bf16 or fp32,
        # so the job would train the experts without the recipe it asks for.
        raise ValueError(
            f"[uniep] enable = true, but model.converters has {', '.join(experts_converters)}: UniEP's expert "
            "kernels compute in bf16 or fp32 and do not run TorchTitan's low-precision grouped-GEMM recipes. "
            f"Remove {', '.join(experts_converters)} from [model] converters (--model.converters), or set "
            "[uniep] enable = false."
        )
    backend = job_config.parallelism.expert_parallel_comm_backend
    if backend != "standard":
        raise ValueError(
            f"[uniep] enable = true replaces the expert-parallel communication, but "
            f"parallelism.expert_parallel_comm_backend = {backend!r}. Set it to \"standard\" (the default), "
            "or [uniep] enable = false."
        )
    schedules = available_schedules()
    if cfg.schedule not in schedules:
        raise ValueError(
            f"[uniep] schedule = {cfg.schedule!r} is not available in this build (available: "
            f"{', '.join(sorted(schedules))}). Use schedule = \"reference\"."
        )
    if schedules[cfg.schedule] and not torch.cuda.is_available():
        # Without CUDA the kernels run in Triton's interpreter, on a one-rank group only.
        if parallel_dims.ep > 1:
            raise ValueError(
                f"[uniep] schedule = {cfg.schedule!r} needs CUDA GPUs with peer access at "
                f"parallelism.expert_parallel_degree = {parallel_dims.ep}, and this machine has none. Use "
                "schedule = \"reference\" on CPU (or expert_parallel_degree = 1, where the kernels run in "
                "Triton's interpreter: correct, and slow)."
            )
        grouped_mm = _uses_grouped_mm(model, job_config)
        if job_compute_dtype(cfg.compute_dtype, framework_casts_to_bf16=grouped_mm,
                             activation_dtype=job_config.training.mixed_precision_param) != torch.float32:
            why = (f"TorchTitan's own grouped-GEMM experts of model {model_name!r} flavor "
                   f"{job_config.model.flavor!r} compute in bf16" if grouped_mm and cfg.compute_dtype == "auto"
                   else f"training.mixed_precision_param = {job_config.training.mixed_precision_param!r}")
            raise ValueError(
                f"[uniep] schedule = {cfg.schedule!r} without CUDA runs UniEP's kernels in Triton's interpreter, "
                f"which computes in fp32 only, and this job's experts would not ({why}): it is a GPU "
                "configuration. On a CPU, train the tiny flavor the CPU tests use (--model.flavor "
                "debugmodel_moe_tiny --training.local_batch_size 1 --training.seq_len 16 "
                "--training.mixed_precision_param float32), or set [uniep] schedule = \"reference\"."
            )


def _uses_grouped_mm(model: nn.Module | None, job_config) -> bool:
    """Whether the job's TorchTitan experts run grouped GEMMs (and so cast to
    bf16): read from the model, or before it is built from its flavor's
    arguments as the trainer adjusts them (deepseek_v3 turns grouped GEMMs off
    below SM 9.0)."""
    if model is not None:
        return all(moe.experts.use_grouped_mm for _, moe in moe_layers(model))
    import copy

    from torchtitan.protocols.train_spec import get_train_spec

    args = get_train_spec(job_config.model.name).model_args.get(job_config.model.flavor)
    if args is None:
        return True  # TorchTitan's own error names the flavor
    args = copy.deepcopy(args)
    args.update_from_config(job_config)
    return getattr(getattr(args, "moe_args", None), "use_grouped_mm", True)


def kernel_dtype(cfg: UniEP, model: nn.Module | None, job_config) -> torch.dtype:
    """The dtype UniEP's kernels compute in for this job (``compute_dtype.job_compute_dtype``);
    ``model``: the built model, or None before it exists."""
    return job_compute_dtype(cfg.compute_dtype, framework_casts_to_bf16=_uses_grouped_mm(model, job_config),
                             activation_dtype=job_config.training.mixed_precision_param)


def _probe_ep_gpus(parallel_dims) -> list[EPGPU]:
    return probe_ep_gpus(parallel_dims.get_mesh("ep").get_group())


def _swap_to_uniep(model: nn.Module, cfg: UniEP) -> list[tuple[str, UniEPMoE]]:
    # The model was built by TorchTitan's own model class (on the meta
    # device) before parallelize_fn sees it. Swapping the class of each
    # instance, rather than building new modules, keeps every parameter,
    # buffer, FQN and init_weights path the same objects as the baseline's.
    swapped = []
    for name, moe in moe_layers(model):
        if not isinstance(moe.experts, GroupedExperts):
            raise ValueError(f"{name}.experts is a {type(moe.experts).__name__}, not TorchTitan's GroupedExperts")
        moe.__class__ = UniEPMoE
        moe.experts.__class__ = UniEPGroupedExperts
        moe.experts.configure(
            schedule=cfg.schedule,
            score_before_experts=moe.score_before_experts,
            # TorchTitan's grouped-GEMM experts cast their operands to bf16
            # (models/moe/moe.py, _run_experts_grouped_mm); its for-loop ones do not.
            compute_dtype=resolve(cfg.compute_dtype, framework_casts_to_bf16=moe.experts.use_grouped_mm),
            layer_name=f"{name}.experts",
        )
        swapped.append((name, moe))
    return swapped


@contextlib.contextmanager
def _uniep_expert_parallel_plan() -> Iterator[None]:
    # The one scoped patch. TorchTitan 0.2.2's apply_moe_ep_tp (llama4's
    # parallelize module, reused by deepseek_v3 and qwen3) hard-codes
    # ``ExpertParallel()`` as the plan of ``moe.experts`` and offers no
    # registry for it; the DeepEP switch it does have imports deep_ep. While
    # the base parallelize_fn runs, its module-level name ExpertParallel
    # resolves to UniEP's plan; everything else (AC, compile, FSDP and its
    # expert-mesh wrapping) runs unchanged.
    import torchtitan.models.llama4.infra.parallelize as llama4_parallelize

    original = llama4_parallelize.ExpertParallel
    llama4_parallelize.ExpertParallel = UniEPExpertParallel
    try:
        yield
    finally:
        llama4_parallelize.ExpertParallel = original


def _grad_accum_steps(parallel_dims, job_config) -> int:
    local = job_config.training.local_batch_size
    global_batch = job_config.training.global_batch_size
    if global_batch < 0:
        return 1
    return max(1, global_batch // (local * parallel_dims.dp_replicate * parallel_dims.dp_shard))


def _install_step_counter(model: nn.Module, swapped: list[tuple[str, UniEPMoE]], parallel_dims, job_config) -> StepCounter:
    steps = StepCounter(_grad_accum_steps(parallel_dims, job_config))
    model.register_forward_pre_hook(steps.count_model_forward)
    hooks = UniEPTestHooks.from_env()
    if hooks is not None:
        logger.warning("UniEP: testing-only hooks are active (titan_uniep.testing): %s", hooks)
    for _, moe in swapped:
        moe.experts.steps = steps
        moe.experts.test_hooks = hooks
    return steps


def _install_guard(model: nn.Module, swapped: list[tuple[str, UniEPMoE]], cfg: UniEP, steps: StepCounter) -> BitwiseGuard | None:
    if cfg.guard == "off":
        return None
    try:
        name, moe = swapped[cfg.guard_layer]
    except IndexError:
        raise ValueError(
            f"[uniep] guard_layer = {cfg.guard_layer} is out of range: the model has {len(swapped)} MoE layers. "
            f"Use a value in [-{len(swapped)}, {len(swapped) - 1}]."
        ) from None
    guard = BitwiseGuard(cfg.guard, cfg.guard_interval, steps)
    moe.experts.guard = guard
    # Each step's first forward logs the check-mode verdicts that have landed.
    model.register_forward_pre_hook(lambda module, args: guard.poll())
    logger.info("UniEP guard (%s) on %s every %d steps", cfg.guard, name, cfg.guard_interval)
    return guard


def _sac_save_list(base_parallelize_fn: Callable) -> set | None:
    import sys

    module = sys.modules.get(getattr(base_parallelize_fn, "__module__", ""), None)
    return getattr(module, "_op_sac_save_list", None)


def wrap_parallelize_fn(base_parallelize_fn: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
    """A parallelize_fn that runs ``base_parallelize_fn`` with UniEP's MoE path."""

    def parallelize_uniep(model: nn.Module, parallel_dims, job_config) -> nn.Module:
        cfg: UniEP | None = getattr(job_config, "uniep", None)
        if cfg is None or not cfg.enable:
            return base_parallelize_fn(model, parallel_dims, job_config)
        validate(cfg, model, parallel_dims, job_config)
        if cfg.schedule != "reference" and parallel_dims.ep > 1:
            check_ep_gpus(cfg, _probe_ep_gpus(parallel_dims))
        swapped = _swap_to_uniep(model, cfg)
        dtype = kernel_dtype(cfg, model, job_config)
        if parallel_dims.ep == 1:
            # TorchTitan applies no EP plan at EP = 1 (FSDP, if any, all-gathers
            # the experts with their block): each rank runs all of them.
            for _name, moe in swapped:
                moe.experts.ep_group = one_rank_group()
        sac_ops = _sac_save_list(base_parallelize_fn)
        if sac_ops is not None:
            # As TorchTitan does for its DeepEP ops: selective AC saves the
            # exchange's outputs instead of re-running it in backward.
            sac_ops.add(torch.ops._c10d_functional.all_gather_into_tensor.default)
            if cfg.schedule != "reference":
                import titan_uniep.op  # noqa: F401  (registers torch.ops.uniep.moe_experts)

                sac_ops.add(torch.ops.uniep.moe_experts.default)
        with _uniep_expert_parallel_plan():
            model = base_parallelize_fn(model, parallel_dims, job_config)
        if cfg.schedule != "reference":
            from titan_uniep.op import reserve_tokens

            # Tokens per rank per MoE call: the microbatch (CP splits the sequence).
            tokens = job_config.training.local_batch_size * job_config.training.seq_len // parallel_dims.cp
            reserve_tokens(swapped[0][1].experts.ep_group, tokens)
            if cfg.tuning != "off":
                from titan_uniep.tuning.selection import configure_tuning

                grads = job_weight_grad_dtype(dtype, fsdp=parallel_dims.fsdp_enabled,
                                              mixed_precision_param=job_config.training.mixed_precision_param)
                configure_tuning(swapped[0][1].experts.ep_group, cfg.tuning, cfg.tuning_cache,
                                 moe_modules=[moe for _, moe in swapped], num_tokens=tokens, dtype=dtype,
                                 weight_grad_dtype=grads)
        model.uniep_steps = _install_step_counter(model, swapped, parallel_dims, job_config)
        model.uniep_guard = _install_guard(model, swapped, cfg, model.uniep_steps)
        logger.info("UniEP: %d MoE layers on schedule %r (EP degree %d), expert GEMMs in %s", len(swapped),
                    cfg.schedule, parallel_dims.ep, str(dtype).removeprefix("torch."))
        return model

    parallelize_uniep.__name__ = f"{getattr(base_parallelize_fn, '__name__', 'parallelize')}_uniep"
    parallelize_uniep.__wrapped__ = base_parallelize_fn
    return parallelize_uniep
