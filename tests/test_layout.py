"""Properties of the one definition of where routed rows go (titan_uniep.layout).

Every rank's layout is computed in one process from the same exchanged
counts table, as the EP ranks would after the counts exchange.
"""

from __future__ import annotations

import pytest
import torch

from titan_uniep.layout import compute_layout, count_per_expert


def _routing(num_tokens: int, num_experts: int, top_k: int, mode: str, gen: torch.Generator) -> torch.Tensor:
    if num_tokens == 0:
        return torch.empty(0, top_k, dtype=torch.int64)
    if mode == "one_expert_first":  # expert 0 first on every token, the rest random
        rest = torch.stack([torch.randperm(num_experts - 1, generator=gen)[: top_k - 1] + 1 for _ in range(num_tokens)])
        return torch.cat([torch.zeros(num_tokens, 1, dtype=torch.int64), rest], 1)
    if mode == "low_experts":  # only experts 0..top_k-1: higher ranks receive nothing
        return torch.stack([torch.randperm(top_k, generator=gen) for _ in range(num_tokens)])
    return torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(num_tokens)])


def _world(tokens: list[int], num_experts: int, top_k: int, mode: str, seed: int):
    gen = torch.Generator().manual_seed(seed)
    indices = [_routing(t, num_experts, top_k, mode, gen) for t in tokens]
    counts_all = torch.stack([count_per_expert(i, num_experts) for i in indices])
    layouts = [compute_layout(i, counts_all, r) for r, i in enumerate(indices)]
    return indices, counts_all, layouts


CASES = [
    # (tokens per rank, experts, top_k, routing)
    ([5, 7], 4, 2, "random"),
    ([1, 1], 4, 1, "random"),  # T = 1
    ([0, 9], 6, 3, "random"),  # a rank that routes nothing
    ([13, 0, 3, 8], 8, 3, "random"),
    ([11, 6], 8, 3, "low_experts"),  # rank 1 receives nothing; most experts empty
    ([9, 4, 7], 6, 2, "one_expert_first"),  # everyone on expert 0
    ([17, 17, 17, 17], 4, 4, "random"),  # El = 1, every expert every token
]


@pytest.mark.parametrize("tokens,num_experts,top_k,mode", CASES)
@pytest.mark.parametrize("seed", [0, 1])
def test_slots_are_a_bijection_onto_each_receive_buffer(tokens, num_experts, top_k, mode, seed):
    indices, counts_all, layouts = _world(tokens, num_experts, top_k, mode, seed)
    world = len(tokens)
    for r in range(world):
        slots = torch.cat([lay.dest_slot[lay.dest_rank == r] for lay in layouts])
        rows = int(layouts[r].expert_offsets[-1])
        assert rows == int(counts_all[:, r * (num_experts // world) : (r + 1) * (num_experts // world)].sum())
        assert torch.equal(torch.sort(slots).values, torch.arange(rows)), f"rank {r}: slots are not 0..{rows - 1}"


@pytest.mark.parametrize("tokens,num_experts,top_k,mode", CASES)
def test_receive_buffer_is_expert_major_then_source_token_k(tokens, num_experts, top_k, mode):
    indices, counts_all, layouts = _world(tokens, num_experts, top_k, mode, seed=3)
    world, num_local = len(tokens), num_experts // len(tokens)
    for r in range(world):
        rows = int(layouts[r].expert_offsets[-1])
        key = [None] * rows  # (local expert, source rank, token, k) of each slot
        for s, (idx, lay) in enumerate(zip(indices, layouts)):
            for t in range(idx.shape[0]):
                for k in range(top_k):
                    if int(lay.dest_rank[t, k]) == r:
                        key[int(lay.dest_slot[t, k])] = (int(idx[t, k]) % num_local, s, t, k)
        assert all(k is not None for k in key)
        assert key == sorted(key), f"rank {r}: rows are not ordered by (expert, source, token, k)"
        # expert_offsets delimit each local expert's rows
        for el in range(num_local):
            lo, hi = int(layouts[r].expert_offsets[el]), int(layouts[r].expert_offsets[el + 1])
            assert all(key[i][0] == el for i in range(lo, hi))


@pytest.mark.parametrize("tokens,num_experts,top_k,mode", CASES)
def test_collective_stream_lands_on_the_same_slots(tokens, num_experts, top_k, mode):
    """all_to_all delivers rows source-major in send order; stream_slots must agree with dest_slot."""
    indices, counts_all, layouts = _world(tokens, num_experts, top_k, mode, seed=4)
    world = len(tokens)
    for r in range(world):
        expected = []
        for lay in layouts:
            flat_rank, flat_slot = lay.dest_rank.reshape(-1), lay.dest_slot.reshape(-1)
            sent = lay.send_order[flat_rank[lay.send_order] == r]
            expected.append(flat_slot[sent])
        rows = int(layouts[r].expert_offsets[-1])
        assert torch.equal(layouts[r].stream_slots(rows), torch.cat(expected))
        assert torch.equal(layouts[r].recv_counts, torch.tensor([int((lay.dest_rank == r).sum()) for lay in layouts]))


def test_layout_is_stable_and_deterministic():
    indices, counts_all, layouts = _world([12, 12], 4, 2, "random", seed=5)
    again = compute_layout(indices[0], counts_all, 0)
    assert torch.equal(again.dest_slot, layouts[0].dest_slot)
    assert torch.equal(again.send_order, layouts[0].send_order)
    # stable: copies of one expert leave in flat (t, k) order
    flat = indices[0].reshape(-1)
    for e in range(4):
        ids = layouts[0].send_order[flat[layouts[0].send_order] == e]
        assert torch.equal(ids, torch.sort(ids).values)


def test_layout_rejects_bad_shapes():
    with pytest.raises(ValueError, match="must be \\(T, K\\)"):
        compute_layout(torch.zeros(4, dtype=torch.int64), torch.zeros(2, 4, dtype=torch.int64), 0)
    with pytest.raises(ValueError, match="divisible by the EP size"):
        compute_layout(torch.zeros(1, 1, dtype=torch.int64), torch.zeros(2, 5, dtype=torch.int64), 0)
