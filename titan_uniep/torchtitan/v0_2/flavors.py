"""Extra model flavors with realistic MoE layer shapes, sized for the bundled tokenizer.

``qwen3`` flavor ``"30B-A3B-4L"``: Qwen3-30B-A3B's layer (dim 2048, 32 heads,
4 KV heads, 128 experts, top-8, expert hidden 768, softmax routing scored
after the experts) with 4 layers and the bundled 2048-token vocabulary, so a
2-GPU run exercises real MoE dimensions in minutes. Registered for ``qwen3``
and ``qwen3_uniep`` alike (they share TorchTitan's flavor table), so the
baseline and UniEP configs compare the same model.

``deepseek_v3`` flavor ``"16B-4L"``: DeepSeek-V3-16B's layers (dim 2048,
MLA attention with 16 heads, 64 routed experts of hidden 1408, top-6,
two shared experts, softmax routing scored after the experts) with 4 layers
(the first dense, as in 16B) and the bundled 2048-token vocabulary, so one
H200 trains three real MoE layers. Attention is SDPA with a causal mask
(16B's FlexAttention with document masks compiles its kernels at every
start, minutes of a short benchmark run, and is no part of the MoE layer
being compared). Registered for ``deepseek_v3`` and ``deepseek_v3_uniep``.

``qwen3`` flavor ``"debugmodel_moe_tiny"``: ``debugmodel_moe`` shrunk to one
MoE layer of dim 16 (4 experts, top-2, expert hidden 16), small enough for
UniEP's kernels to train it in Triton's interpreter on a CPU (the EP = 1
CPU test runs ``train_configs/qwen3_debug_moe_ep1_*.toml`` with it).
"""

from __future__ import annotations

import copy

from torchtitan.models.deepseek_v3 import deepseekv3_args
from torchtitan.models.moe import MoEArgs
from torchtitan.models.qwen3 import qwen3_args


def _shrunk(table: dict, base: str, **fields):
    args = copy.deepcopy(table[base])  # deep: update_from_config mutates moe_args
    for name, value in fields.items():
        setattr(args, name, value)
    return args


QWEN3_FLAVORS = {
    "30B-A3B-4L": _shrunk(qwen3_args, "30B-A3B", vocab_size=2048, n_layers=4, max_seq_len=8192),
    "debugmodel_moe_tiny": _shrunk(
        qwen3_args, "debugmodel_moe", dim=16, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=8, hidden_dim=32,
        moe_inter_dim=16,
        moe_args=MoEArgs(num_experts=4, num_shared_experts=0, top_k=2, score_func="softmax", route_norm=True,
                         score_before_experts=False, use_grouped_mm=False),
    ),
}
DEEPSEEK_V3_FLAVORS = {
    "16B-4L": _shrunk(deepseekv3_args, "16B", vocab_size=2048, n_layers=4, attn_type="sdpa", attn_mask_type="causal"),
}


def register_flavors() -> None:
    """Add the flavors to TorchTitan's qwen3 and deepseek_v3 flavor tables (idempotent)."""
    for table, flavors in ((qwen3_args, QWEN3_FLAVORS), (deepseekv3_args, DEEPSEEK_V3_FLAVORS)):
        for name, args in flavors.items():
            table.setdefault(name, args)
