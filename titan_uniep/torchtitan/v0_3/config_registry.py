"""UniEP's train configs for TorchTitan 0.3.0: baseline / UniEP pairs.

    torchrun ... -m titan_uniep.torchtitan.train --module titan_uniep.torchtitan.v0_3 \
        --config qwen3_debug_moe_uniep [--section.key value ...]

(TorchTitan's ``--module`` imports ``titan_uniep.torchtitan.v0_3.config_registry``,
``--config`` names a function here.) The pairs are those of the 0.2.2 TOMLs in
``train_configs/``, with the same training settings; a pair differs only in
its ``uniep`` section. Every config trains on the bundled corpus with the
bundled tokenizer (nothing is downloaded) through ``UniEPTrainer``, which
also writes ``loss.jsonl``.

| pair | model | EP |
|---|---|---|
| ``deepseek_v3_debug_*`` | DeepSeek-V3 ``debugmodel`` (8 experts, top-3, 2 shared) | 2 |
| ``qwen3_debug_moe_*`` | Qwen3 ``debugmodel_moe`` (64 experts, top-8) | 2 |
| ``qwen3_debug_moe_ep1_*`` | the same at EP = 1, schedule ``fused`` (GPU) | 1 |
| ``qwen3_debug_moe_tiny_ep1_*`` | one MoE layer of dim 16, fp32, schedule ``fused`` (CPU: Triton's interpreter) | 1 |
| ``qwen3_30b_a3b_4l_*`` | Qwen3-30B-A3B's MoE layers x4, schedule ``fused`` (GPU) | 1 |
| ``deepseek_v3_16b_4l_*`` | DeepSeek-V3-16B's layers x4, schedule ``fused`` (GPU) | 1 |

The UniEP debug pairs use ``schedule = "reference"``, which runs anywhere;
it syncs with the host, as TorchTitan's all-to-all at EP > 1 does, so both
sides of the debug pairs train without CUDA graphs. The EP = 1 pairs are GPU
configurations under TorchTitan's CUDA graphs (their CPU form: ``--config
qwen3_debug_moe_tiny_ep1_uniep``); on GPUs ``--uniep.schedule fused
--training.no-disable-cuda-graphs`` runs a debug pair's UniEP side under them.
"""

from __future__ import annotations

from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
from torchtitan.config import CommConfig, ParallelismConfig, TrainingConfig
from torchtitan.config.configs import DebugConfig
from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader
from torchtitan.models.common.config_utils import decoder_vocab_size
from torchtitan.models.deepseek_v3 import model_registry as deepseek_v3_registry
from torchtitan.models.qwen3 import model_registry as qwen3_registry
from torchtitan.protocols.model_spec import ModelSpec

from titan_uniep.config import UniEP
from titan_uniep.torchtitan.data import ASSETS_DIR, DATASET_NAME, register_dataset
from titan_uniep.torchtitan.v0_3.flavors import deepseek_v3_16b_4l, qwen3_30b_a3b_4l, qwen3_moe_tiny
from titan_uniep.torchtitan.v0_3.trainer import UniEPTrainer

register_dataset()

_REFERENCE = UniEP(enable=True, schedule="reference")
_FUSED = UniEP(enable=True, schedule="fused")
_OFF = UniEP()


def _job(model_spec: ModelSpec, uniep: UniEP, *, ep: int, steps: int = 50, local_batch_size: int = 4,
         seq_len: int = 256) -> UniEPTrainer.Config:
    """The 0.2.2 TOMLs' job: AdamW 8e-4 with 2 warm-up steps and linear decay, bundled data,
    fp32 master weights with bf16 compute, seed 7, deterministic, no activation checkpointing;
    checkpoints off, and full (optimizer, data loader, step) where ``--checkpoint.enable`` turns them on.

    CUDA graphs (TorchTitan's default) stay on except where a side syncs with the
    host: TorchTitan's all-to-all dispatcher at EP > 1 and UniEP's reference schedule."""
    cuda_graphs = uniep.schedule != "reference" if uniep.enable else ep == 1
    return UniEPTrainer.Config(
        model_spec=model_spec,
        uniep=uniep,
        hf_assets_path=ASSETS_DIR,
        dump_folder="./outputs",
        loss=ChunkedLossWrapper.Config(
            loss_fn=CrossEntropyLoss.Config(global_vocab_size=decoder_vocab_size(model_spec)),
        ),
        metrics=MetricsProcessor.Config(log_freq=1, disable_color_printing=True),
        dataloader=HuggingFaceTextDataLoader.Config(dataset=DATASET_NAME),
        optimizer=default_adamw(lr=8e-4),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=2, decay_ratio=0.8, decay_type="linear",
                                                  min_lr_factor=0.0),
        training=TrainingConfig(local_batch_size=local_batch_size, seq_len=seq_len, steps=steps,
                                mixed_precision_param="bfloat16", disable_cuda_graphs=not cuda_graphs),
        parallelism=ParallelismConfig(expert_parallel_degree=ep),
        checkpoint=CheckpointManager.Config(enable=False, last_save_model_only=False),
        activation_checkpoint=None,
        comm=CommConfig(init_timeout_seconds=300, train_timeout_seconds=120),
        debug=DebugConfig(seed=7, deterministic=True),
    )


def deepseek_v3_debug_baseline() -> UniEPTrainer.Config:
    return _job(deepseek_v3_registry("debugmodel"), _OFF, ep=2)


def deepseek_v3_debug_uniep() -> UniEPTrainer.Config:
    return _job(deepseek_v3_registry("debugmodel"), _REFERENCE, ep=2)


def qwen3_debug_moe_baseline() -> UniEPTrainer.Config:
    return _job(qwen3_registry("debugmodel_moe"), _OFF, ep=2)


def qwen3_debug_moe_uniep() -> UniEPTrainer.Config:
    return _job(qwen3_registry("debugmodel_moe"), _REFERENCE, ep=2)


def qwen3_debug_moe_ep1_baseline() -> UniEPTrainer.Config:
    return _job(qwen3_registry("debugmodel_moe"), _OFF, ep=1)


def qwen3_debug_moe_ep1_uniep() -> UniEPTrainer.Config:
    return _job(qwen3_registry("debugmodel_moe"), _FUSED, ep=1)


def qwen3_debug_moe_tiny_ep1_baseline() -> UniEPTrainer.Config:
    """The CPU form of the EP = 1 pair: one MoE layer of dim 16, fp32 everywhere."""
    config = _job(qwen3_moe_tiny(), _OFF, ep=1, local_batch_size=1, seq_len=16)
    config.training.mixed_precision_param = "float32"
    return config


def qwen3_debug_moe_tiny_ep1_uniep() -> UniEPTrainer.Config:
    """``qwen3_debug_moe_tiny_ep1_baseline`` with UniEP's fused kernels in fp32 (on a CPU: Triton's interpreter)."""
    config = _job(qwen3_moe_tiny(), UniEP(enable=True, schedule="fused", compute_dtype="float32"), ep=1,
                  local_batch_size=1, seq_len=16)
    config.training.mixed_precision_param = "float32"
    return config


def qwen3_30b_a3b_4l_baseline() -> UniEPTrainer.Config:
    return _job(qwen3_30b_a3b_4l(), _OFF, ep=1, steps=30, local_batch_size=2, seq_len=4096)


def qwen3_30b_a3b_4l_uniep() -> UniEPTrainer.Config:
    return _job(qwen3_30b_a3b_4l(), _FUSED, ep=1, steps=30, local_batch_size=2, seq_len=4096)


def deepseek_v3_16b_4l_baseline() -> UniEPTrainer.Config:
    return _job(deepseek_v3_16b_4l(), _OFF, ep=1, steps=30, local_batch_size=2, seq_len=4096)


def deepseek_v3_16b_4l_uniep() -> UniEPTrainer.Config:
    return _job(deepseek_v3_16b_4l(), _FUSED, ep=1, steps=30, local_batch_size=2, seq_len=4096)
