"""UniEP's trainer for TorchTitan 0.3.0: TorchTitan's ``Trainer`` with a ``uniep`` config section.

``UniEPTrainer.Config`` is TorchTitan's ``Trainer.Config`` plus ``uniep``
(``titan_uniep.config.UniEP``: the same options and checks as the ``[uniep]``
section of a 0.2.2 TOML), so every key is a CLI override as TorchTitan's own
are (``--uniep.schedule fused``). Whenever the config is built (by its
registry function, by TorchTitan's CLI parse, by ``build``), it makes every
routed-experts node of the model UniEP's with these options
(``experts.apply_uniep``; with ``enable = false`` TorchTitan's own), so
TorchTitan's own checks that follow see the experts that will run.

``validate`` refuses, with the key and the fix, what UniEP cannot serve.
``UniEPTrainer`` runs it first; puts UniEP's op on the selective activation
checkpointing save list (``UniEPSelectiveAC``), as TorchTitan does for its
DeepEP ops; and, after TorchTitan has built and parallelized the model, names
each UniEP layer by its FQN, checks the EP group's GPUs for the kernel
schedules, sizes their workspaces, applies ``[uniep] tuning``, installs the
step counter, the bitwise guard and the ``UNIEP_TEST_*`` hooks, and records
``loss.jsonl`` on rank 0.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, field

import torch
from torchtitan.config import derive
from torchtitan.distributed.activation_checkpoint import SelectiveAC
from torchtitan.trainer import Trainer

from titan_uniep.compute_dtype import resolve
from titan_uniep.config import UniEP
from titan_uniep.schedules import available_schedules
from titan_uniep.testing import UniEPTestHooks
from titan_uniep.torchtitan.ep_group import check_ep_gpus, one_rank_group, probe_ep_gpus
from titan_uniep.torchtitan.layer import BitwiseGuard, StepCounter
from titan_uniep.torchtitan.loss_file import record_losses
from titan_uniep.torchtitan.trainer import UniEPSteps
from titan_uniep.torchtitan.v0_3.experts import UniEPRoutedExperts, apply_uniep

logger = logging.getLogger(__name__)

__all__ = ["UniEPSelectiveAC", "UniEPTrainer", "validate"]


class UniEPSelectiveAC(SelectiveAC):
    """TorchTitan's selective activation checkpointing, saving UniEP's exchange too.

    Recomputing UniEP's op in the backward would redo its dispatch and combine;
    as TorchTitan does for its DeepEP ops, its output is saved instead (and the
    reference schedule's count exchange)."""

    @dataclass(kw_only=True, slots=True)
    class Config(SelectiveAC.Config):
        pass

    def get_save_ops(self) -> set:
        ops = SelectiveAC.get_save_ops(self)
        ops.add(torch.ops._c10d_functional.all_gather_into_tensor.default)
        if "titan_uniep.op" in sys.modules:  # imported by the kernel schedules' layers when they are built
            ops.add(torch.ops.uniep.moe_experts.default)
        return ops


def quantized_experts(model_config) -> list[str]:
    """The class names of the grouped experts inside UniEP's routed-experts nodes
    that a TorchTitan quantization converter made (its float8 / MX grouped-GEMM
    recipes swap ``inner_experts`` for a subclass defined in
    ``torchtitan.components.quantization``); UniEP would keep only their weights."""
    names = []
    for _fqn, node, _parent, _attr in model_config.traverse(UniEPRoutedExperts.Config):
        owner = getattr(type(node.inner_experts), "_owner", None)
        if owner is not None and owner.__module__.startswith("torchtitan.components.quantization"):
            names.append(owner.__name__)
    return names


def validate(config: "UniEPTrainer.Config") -> None:
    """Raise ValueError naming the key and the fix if UniEP cannot serve this job. Needs the config only.

    The trainer runs it before it builds anything, and ``train.main`` right after
    the parse (a ValueError raised inside TorchTitan's tyro parse would come out
    as tyro's usage box instead of one line)."""
    cfg = config.uniep
    if not cfg.enable:
        return
    model = config.model_spec
    if model is not None and not any(model.model.traverse(UniEPRoutedExperts.Config)):
        raise ValueError(
            f"uniep.enable = true, but model {model.name!r} flavor {model.flavor!r} has no MoE layers. "
            "Pick an MoE config (e.g. --module titan_uniep.torchtitan.v0_3 --config qwen3_debug_moe_uniep), "
            "or set --uniep.enable false."
        )
    quantized = quantized_experts(model.model) if model is not None else []
    if quantized:
        raise ValueError(
            f"uniep.enable = true, but the model's grouped experts are {', '.join(sorted(set(quantized)))}, "
            "from a TorchTitan quantization converter (float8 / MX grouped GEMMs): UniEP's expert kernels "
            "compute in bf16 or fp32 and do not run those recipes. Drop the grouped-experts converter from "
            "the model registry's converters, or set --uniep.enable false."
        )
    parallelism = config.parallelism
    if parallelism.tensor_parallel_degree > 1:
        raise ValueError(
            "uniep.enable = true does not support tensor parallelism on MoE blocks "
            f"(parallelism.tensor_parallel_degree = {parallelism.tensor_parallel_degree}). Set "
            "--parallelism.tensor_parallel_degree 1, or --uniep.enable false."
        )
    schedules = available_schedules()
    if cfg.schedule not in schedules:
        raise ValueError(f"uniep.schedule = {cfg.schedule!r} is not available in this build (available: "
                         f"{', '.join(sorted(schedules))}). Use --uniep.schedule reference.")
    ep = parallelism.expert_parallel_degree
    on_gpu = torch.cuda.is_available()
    if schedules[cfg.schedule] and not on_gpu:
        # Without CUDA the kernels run in Triton's interpreter, on a one-rank group only, in fp32 only.
        if ep > 1:
            raise ValueError(
                f"uniep.schedule = {cfg.schedule!r} needs CUDA GPUs with peer access at "
                f"parallelism.expert_parallel_degree = {ep}, and this machine has none. Use --uniep.schedule "
                "reference on CPU (or expert_parallel_degree = 1, where the kernels run in Triton's interpreter: "
                "correct, and slow)."
            )
        if resolve(cfg.compute_dtype, framework_casts_to_bf16=True) != torch.float32:
            raise ValueError(
                f"uniep.schedule = {cfg.schedule!r} without CUDA runs UniEP's kernels in Triton's interpreter, "
                "which computes in fp32 only, and uniep.compute_dtype = \"auto\" computes in bf16 as TorchTitan "
                "0.3.0's experts do. Set --uniep.compute_dtype float32 (the CPU form of the EP = 1 configs), "
                "or --uniep.schedule reference."
            )
    if cfg.tuning == "search":
        raise ValueError(
            "uniep.tuning = \"search\" (the measured search at start-up) runs on TorchTitan 0.2.2 only. On 0.3.0 "
            "run the search beforehand (python3 -m titan_uniep.tools.tune --shape T,D,H,E,K on a GPU) and set "
            "--uniep.tuning cached."
        )
    if on_gpu and not config.training.disable_cuda_graphs:
        # TorchTitan captures each training step in a CUDA graph after one eager step.
        if cfg.schedule == "reference":
            raise ValueError(
                "uniep.schedule = \"reference\" sizes its all-to-all on the host (a device-to-host sync), which "
                "a CUDA graph cannot capture, and CUDA graphs are on (TorchTitan 0.3.0's default). Use "
                "--uniep.schedule fused (no host sync), or --training.disable_cuda_graphs."
            )
        if cfg.guard != "off":
            raise ValueError(
                f"uniep.guard = {cfg.guard!r} decides on the host, step by step, which forward it checks; a "
                "replayed CUDA graph runs none of that. Set --training.disable_cuda_graphs to run the guard, or "
                "--uniep.guard off."
            )


class UniEPTrainer(UniEPSteps, Trainer):
    """TorchTitan 0.3.0's ``Trainer`` for a config with a ``uniep`` section (see the module docstring)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        uniep: UniEP = field(default_factory=UniEP)
        """UniEP's options: the same keys, values and checks as the ``[uniep]``
        section of a TorchTitan 0.2.2 TOML (``titan_uniep.config.UniEP``).
        ``enable = true`` runs every MoE block's routed experts through UniEP."""

        def __post_init__(self) -> None:
            if self.model_spec is not None:
                apply_uniep(self.model_spec.model, self.uniep)
            Trainer.Config.__post_init__(self)

    def __init__(self, config: Config):
        validate(config)
        if config.uniep.enable and type(config.activation_checkpoint) is SelectiveAC.Config:
            # Here, not in the config: TorchTitan's CLI parse knows its own AC configs only.
            config.activation_checkpoint = derive(config.activation_checkpoint, UniEPSelectiveAC.Config)
        super().__init__(config)
        if config.uniep.enable:
            self._install_uniep(config)
        if torch.distributed.get_rank() == 0:
            record_losses(self.metrics_processor, config.dump_folder)

    def _install_uniep(self, config: Config) -> None:
        cfg = config.uniep
        layers = [(name, module) for model in self.model_parts for name, module in model.named_modules()
                  if isinstance(module, UniEPRoutedExperts)]
        for name, layer in layers:
            layer.layer_name = name
            if layer.ep_group is None:
                # TorchTitan parallelizes the model's modules only where a parallelism is
                # on: a one-rank run leaves them as built, each rank running all experts.
                layer.ep_group = one_rank_group()
        group = layers[0][1].ep_group
        # Tokens per rank per MoE call: the microbatch (CP splits the sequence).
        training = config.training
        tokens = training.local_batch_size * training.seq_len // config.parallelism.context_parallel_degree
        if cfg.schedule != "reference":
            from titan_uniep.op import reserve_tokens

            if self.parallel_dims.ep > 1:
                check_ep_gpus(cfg, probe_ep_gpus(group))
            reserve_tokens(group, tokens)
            if cfg.tuning == "cached":
                from titan_uniep.tuning.selection import configure_tuning

                configure_tuning(group, cfg.tuning, cfg.tuning_cache)
        steps = StepCounter(self.gradient_accumulation_steps)
        hooks = UniEPTestHooks.from_env()
        if hooks is not None:
            logger.warning("UniEP: testing-only hooks are active (titan_uniep.testing): %s", hooks)
        for model in self.model_parts:
            model.register_forward_pre_hook(steps.count_model_forward)
            model.uniep_steps = steps
            model.uniep_guard = None
        for _, layer in layers:
            layer.steps, layer.test_hooks = steps, hooks
        if cfg.guard != "off":
            try:
                name, layer = layers[cfg.guard_layer]
            except IndexError:
                raise ValueError(
                    f"uniep.guard_layer = {cfg.guard_layer} is out of range: the model has {len(layers)} MoE "
                    f"layers. Use a value in [-{len(layers)}, {len(layers) - 1}]."
                ) from None
            guard = layer.guard = BitwiseGuard(cfg.guard, cfg.guard_interval, steps)
            for model in self.model_parts:
                model.uniep_guard = guard
                model.register_forward_pre_hook(lambda module, args: guard.poll())
            logger.info("UniEP guard (%s) on %s every %d steps", cfg.guard, name, cfg.guard_interval)
        logger.info("UniEP: %d MoE layers on schedule %r (EP degree %d)", len(layers), cfg.schedule,
                    self.parallel_dims.ep)

