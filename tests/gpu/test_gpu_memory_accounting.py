"""Where UniEP's workspace memory lives on the GPU, and that it is counted.

A real EP workspace's arena comes from PyTorch's symmetric-memory allocator,
which maps it outside the caching allocator: no segment of
``torch.cuda.memory_snapshot()`` holds it, so ``torch.cuda.memory_reserved``
(TorchTitan's memory figure) leaves it out, while the local buffers are
inside. ``Workspace.symmetric_bytes`` / ``op.symmetric_memory_bytes`` name
those bytes, which ``loss.jsonl`` records and ``bench_train`` adds to the
reserved peak.
"""

import pytest
import torch

import titan_uniep.op as op
from titan_uniep.runtime import BackwardWorkspace, Workspace

pytestmark = pytest.mark.gpu


def _in_a_caching_allocator_segment(ptr: int) -> bool:
    return any(seg["address"] <= ptr < seg["address"] + seg["total_size"] for seg in torch.cuda.memory_snapshot())


def test_the_arena_is_symmetric_memory_outside_the_reserved_figure(one_rank_group, monkeypatch):
    sizes = dict(num_tokens=2048, dim=1024, hidden=96, num_experts=12, top_k=4, dtype=torch.bfloat16)
    fwd = Workspace.for_group(one_rank_group, **sizes)
    bwd = BackwardWorkspace.for_group(one_rank_group, **sizes)
    for ws in (fwd, bwd):
        arena = getattr(ws, "inner", ws).arena
        assert ws.symmetric_bytes == arena.numel() == ws.memory_bytes()["arena"] > 0
        assert not _in_a_caching_allocator_segment(arena.data_ptr())
        assert _in_a_caching_allocator_segment(getattr(ws, "inner", ws).h.data_ptr())
    # The backward's call-local buffers the op moves into the forward's returned rows: symmetric memory too.
    assert bwd.borrow_scratch(fwd.returned_region()) > 0
    for name in bwd.CALL_SCRATCH:
        ptr = getattr(bwd, name).data_ptr()
        in_returned = 0 <= ptr - fwd.arena.data_ptr() - fwd.offsets["returned"] < fwd.shape.arena_sizes()["returned"]
        assert in_returned != _in_a_caching_allocator_segment(ptr), name
    monkeypatch.setattr(op, "_workspaces", {"forward": fwd, "backward": bwd})
    assert op.symmetric_memory_bytes() == fwd.symmetric_bytes + bwd.symmetric_bytes
    # A simulated world's buffers are ordinary tensors: no symmetric memory.
    assert Workspace.simulated(2, device="cuda", **sizes).symmetric_bytes == 0
