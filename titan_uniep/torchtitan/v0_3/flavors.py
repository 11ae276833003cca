"""Model configs with realistic MoE layer shapes, sized for the bundled tokenizer (TorchTitan 0.3.0).

The same models as the 0.2.2 edge's flavors (``titan_uniep/torchtitan/v0_2/flavors.py``):

- ``qwen3_30b_a3b_4l``: Qwen3-30B-A3B's layers (dim 2048, 32 heads, 4 KV heads,
  128 experts of hidden 768, top-8, softmax routing) x4 with the bundled
  2048-token vocabulary;
- ``deepseek_v3_16b_4l``: DeepSeek-V3-16B's layers (dim 2048, MLA with 16
  heads, 64 routed experts of hidden 1408, top-6, two shared experts, the
  first layer dense) x4, 2048-token vocabulary;
- ``qwen3_moe_tiny``: one MoE layer of dim 16 (4 experts, top-2, expert
  hidden 16), small enough for UniEP's kernels to train it in Triton's
  interpreter on a CPU.

Each takes TorchTitan's own flavor config and keeps its first layers (with
their initialisation as in the full model) and a 2048-token vocabulary.
"""

from __future__ import annotations

from torchtitan.models.deepseek_v3 import model_registry as deepseek_v3_registry
from torchtitan.models.qwen3 import model_registry as qwen3_registry
from torchtitan.protocols.model_spec import ModelSpec

__all__ = ["VOCAB_SIZE", "deepseek_v3_16b_4l", "qwen3_30b_a3b_4l", "qwen3_moe_tiny"]

VOCAB_SIZE = 2048
"""The bundled tokenizer's vocabulary (``titan_uniep/assets/bpe2048``), the debug flavors' own."""


def _first_layers(spec: ModelSpec, n_layers: int, flavor: str) -> ModelSpec:
    model = spec.model
    model.layers = model.layers[:n_layers]
    model.vocab_size = VOCAB_SIZE
    model.tok_embeddings.num_embeddings = VOCAB_SIZE
    model.lm_head.out_features = VOCAB_SIZE
    spec.flavor = flavor
    return spec


def qwen3_30b_a3b_4l() -> ModelSpec:
    return _first_layers(qwen3_registry("30B-A3B"), 4, "30B-A3B-4L")


def deepseek_v3_16b_4l() -> ModelSpec:
    return _first_layers(deepseek_v3_registry("16B"), 4, "16B-4L")


def qwen3_moe_tiny() -> ModelSpec:
    """``debugmodel_moe`` shrunk to one MoE layer of dim 16 (built by Qwen3's own layer builder)."""
    from torchtitan.models.common.rope import CosSinRoPE
    from torchtitan.models.qwen3 import _build_qwen3_moe_layers  # the layer builder of every Qwen3 MoE flavor

    spec = qwen3_registry("debugmodel_moe")
    model = spec.model
    dim, head_dim = 16, 8
    model.dim = dim
    model.norm.normalized_shape = dim
    model.tok_embeddings.embedding_dim = dim
    model.lm_head.in_features = dim
    model.layers = _build_qwen3_moe_layers(
        n_layers=1, dim=dim, n_heads=2, n_kv_heads=1, head_dim=head_dim, moe_hidden_dim=16, num_experts=4,
        top_k=2, attn_backend="flex", moe_comm_backend="standard",
        rope=CosSinRoPE.Config(dim=head_dim, max_seq_len=4096, theta=1000000.0),
    )
    spec.flavor = "debugmodel_moe_tiny"
    return spec
