"""The custom op's fake (meta) implementation, which torch.compile traces with,
gives the shapes the real one returns: ``(T, D)`` and the forward workspace's
``slot_capacity x 2H`` h1 | h3 buffer (2 gloo ranks on CPU; the real op needs
CUDA, its shapes come from the same ``slot_capacity`` formula and workspace)."""

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode

from distributed import run_distributed


def _body(rank: int, world: int) -> None:
    from titan_uniep import op
    from titan_uniep.layout import slot_capacity

    group = dist.group.WORLD
    tokens, dim, hidden, local_experts, top_k = 37, 24, 40, 3, 4
    with FakeTensorMode():
        x = torch.empty(tokens, dim, dtype=torch.bfloat16)
        scores = torch.empty(tokens, top_k)
        indices = torch.empty(tokens, top_k, dtype=torch.int64)
        w1 = torch.empty(local_experts, hidden, dim, dtype=torch.bfloat16)
        w2 = torch.empty(local_experts, dim, hidden, dtype=torch.bfloat16)
        out, h13 = op.moe_experts(x, scores, indices, w1, w2, w1, group.group_name, "fused", False)
        assert tuple(out.shape) == (tokens, dim) and out.dtype == torch.bfloat16
        # No workspace yet: the capacity it will be built with, max(T, reserved).
        assert tuple(h13.shape) == (slot_capacity(world, tokens, top_k, local_experts), 2 * hidden)
        assert h13.dtype == torch.bfloat16
        op.reserve_tokens(group, 100)
        _, h13 = op.moe_experts(x, scores, indices, w1, w2, w1, group.group_name, "fused", False)
        assert tuple(h13.shape) == (world * 100 * min(top_k, local_experts), 2 * hidden)


def test_fake_shapes_follow_the_workspace_capacity():
    run_distributed(_body, 2)
