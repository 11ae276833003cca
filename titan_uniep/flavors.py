"""Extra model flavors with realistic MoE layer shapes, sized for the bundled tokenizer.

``qwen3`` flavor ``"30B-A3B-4L"``: Qwen3-30B-A3B's layer (dim 2048, 32 heads,
4 KV heads, 128 experts, top-8, expert hidden 768, softmax routing scored
after the experts) with 4 layers and the bundled 2048-token vocabulary, so a
2-GPU run exercises real MoE dimensions in minutes. Registered for ``qwen3``
and ``qwen3_uniep`` alike (they share TorchTitan's flavor table), so the
baseline and UniEP configs compare the same model.

``qwen3`` flavor ``"debugmodel_moe_tiny"``: ``debugmodel_moe`` shrunk to one
MoE layer of dim 16 (4 experts, top-2, expert hidden 16), small enough for
UniEP's kernels to train it in Triton's interpreter on a CPU (the EP = 1
CPU test runs ``train_configs/qwen3_debug_moe_ep1_*.toml`` with it).
"""

from __future__ import annotations

import copy

from torchtitan.models.moe import MoEArgs
from torchtitan.models.qwen3 import qwen3_args


def _shrunk(base: str, **fields):
    args = copy.deepcopy(qwen3_args[base])  # deep: update_from_config mutates moe_args
    for name, value in fields.items():
        setattr(args, name, value)
    return args


FLAVORS = {
    "30B-A3B-4L": _shrunk("30B-A3B", vocab_size=2048, n_layers=4, max_seq_len=8192),
    "debugmodel_moe_tiny": _shrunk(
        "debugmodel_moe", dim=16, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=8, hidden_dim=32, moe_inter_dim=16,
        moe_args=MoEArgs(num_experts=4, num_shared_experts=0, top_k=2, score_func="softmax", route_norm=True,
                         score_before_experts=False, use_grouped_mm=False),
    ),
}


def register_flavors() -> None:
    """Add FLAVORS to TorchTitan's qwen3 flavor table (idempotent)."""
    for name, args in FLAVORS.items():
        qwen3_args.setdefault(name, args)
