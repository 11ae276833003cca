"""UniEP forward megakernels on a simulated world, on CPU (Triton interpreter).

fp32 data (the interpreter's bf16 tl.dot is wrong; bf16 runs in tests/gpu/).
Each test builds fresh random inputs and poisons every data buffer with NaN
before every run, so a row read before it is written shows up.
"""

from interpreter_env import request_interpreter

request_interpreter()  # before anything defines a Triton kernel

import pytest
import torch
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from titan_uniep.kernels.scoreboard import CTL_EPOCH, CTL_OWN_DISPATCH_TASKS
from titan_uniep.layout import compute_layout, count_per_expert, token_destinations
from titan_uniep.oracle import float64_moe_oracle, layout_oracle_forward
from titan_uniep.params import interpreter_params
from titan_uniep.runtime import (BackwardWorkspace, Workspace, WorkspaceShape, exchange_bytes, memory_bytes,
                                 simulated_moe_forward)
from titan_uniep.runtime.workspace import backward_returned_row

import worlds

if torch.cuda.is_available():
    pytest.skip("CPU interpreter tests (GPU runs use tests/gpu/)", allow_module_level=True)
if not isinstance(tl.standard.cdiv, InterpretedFunction):
    # Triton was imported (e.g. by torchtitan in an earlier test module) before
    # TRITON_INTERPRET was set, so its own jit helpers cannot run under the
    # interpreter in this process: test_interpreter_subprocess.py runs this file anew.
    pytest.skip("Triton was imported before TRITON_INTERPRET=1; run in a subprocess", allow_module_level=True)

DIM, HIDDEN = 32, 48  # HIDDEN not a multiple of the 16-column tiles' 32: masked column blocks too


def make_world(world, num_experts, top_k, num_tokens, *, seed, allowed=None, force=None):
    """Random inputs of a simulated world (``worlds.make_world`` at this file's dims, fp32)."""
    return worlds.make_world(world, num_experts, top_k, num_tokens, seed=seed, dim=DIM, hidden=HIDDEN,
                             allowed=allowed, force=force)


def run_both(world_inputs, *, score_before, workspace=None, params=None):
    """Sequential and fused on poisoned buffers (``worlds.run_both_poisoned``)."""
    return worlds.run_both_poisoned(world_inputs, score_before=score_before, params=params or interpreter_params(),
                                    workspace=workspace)


def assert_correct(world_inputs, sequential, fused, *, score_before):
    w = world_inputs
    layout_ref = layout_oracle_forward(
        w["xs"], w["scores"], w["indices"], w["w1s"], w["w2s"], w["w3s"], score_before_experts=score_before
    )
    for r, (seq, fus) in enumerate(zip(sequential, fused)):
        assert torch.equal(seq, fus), f"rank {r}: fused differs from sequential"
        assert not torch.isnan(fus).any(), f"rank {r}: NaN in the output (a row was never written)"
        exact = float64_moe_oracle(
            w["xs"][r], w["scores"][r], w["indices"][r], w["w1"], w["w2"], w["w3"], score_before_experts=score_before
        )
        torch.testing.assert_close(fus.double(), exact, rtol=1e-4, atol=1e-5, msg=lambda m: f"rank {r} vs float64: {m}")
        torch.testing.assert_close(fus, layout_ref[r], rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {r} vs layout ref: {m}")


def rank_view(ws, r, local_buffers):
    """Local rank ``r`` of a simulated workspace as a real-EP rank sees it
    (L = 1, rank_base = r) on the shared simulated arenas: every per-rank
    array (and the packed ``Route`` of them) sliced to ``[r:r + 1]``."""
    from types import SimpleNamespace

    from titan_uniep.kernels.scoreboard import Route

    per_rank = (*local_buffers, "control", "counts_all", "num_tokens", "block_counts", "route_tables", "dest_rank",
                "dest_slot", "dest_tile", "tile_expert", "tile_start", "tile_end", "num_tiles", "tile_order")
    sliced = {name: (None if getattr(ws, name) is None else getattr(ws, name)[r:r + 1]) for name in per_rank}
    route_args = Route(*(v[r:r + 1] if isinstance(v, torch.Tensor) else v for v in ws.route_args))
    assert route_args.tables.data_ptr() == sliced["route_tables"].data_ptr()
    return SimpleNamespace(shape=ws.shape, element_offsets=ws.element_offsets, offsets=ws.offsets,
                           arena_ptrs=ws.arena_ptrs, anchors=ws.anchors, anchor_rank=ws.anchor_rank,
                           arena_args=ws.arena_args, route_args=route_args, device=ws.device, rank_base=r,
                           num_local_ranks=1, is_simulated=False, **sliced)


# fc2 schedules: tiles claimed one by one (release right after the stores, or
# deferred), or dealt to the programs in one flattened loop.
FC2_SCHEDULES = {"claims": {}, "deferred_release": dict(fc2_defer_release=True),
                 "flat_loop": dict(fc2_flat_loop=True)}


@pytest.mark.parametrize("fc2", sorted(FC2_SCHEDULES))
@pytest.mark.parametrize("score_before", [False, True], ids=["score_after", "score_before"])
@pytest.mark.parametrize("world,num_experts,top_k,num_tokens", [
    (1, 6, 4, [13]),  # EP = 1: the tiles read x in place, no token rows in the arena
    (2, 8, 3, [13, 9]),
    (4, 8, 3, [7, 11, 5, 9]),
    (8, 16, 4, [5, 0, 9, 3, 7, 2, 6, 4]),  # EP = 8 (one 8-GPU node), a rank with no tokens
])
def test_fused_matches_sequential_bitwise_and_references(world, num_experts, top_k, num_tokens, score_before, fc2):
    w = make_world(world, num_experts, top_k, num_tokens, seed=1 + world)
    params = interpreter_params(**FC2_SCHEDULES[fc2])
    ws = Workspace.simulated(world, num_tokens=max(num_tokens), dim=DIM, hidden=HIDDEN, num_experts=num_experts,
                             top_k=top_k, dtype=torch.float32, params=params)
    seq, fus = run_both(w, score_before=score_before, workspace=ws, params=params)
    assert_correct(w, seq, fus, score_before=score_before)


def test_every_fc2_schedule_gives_the_same_bits():
    """Claimed tiles, deferred releases, the flattened loop and both together."""
    w = make_world(2, 8, 3, [10, 7], seed=5)
    params = interpreter_params()
    ws = Workspace.simulated(2, num_tokens=10, dim=DIM, hidden=HIDDEN, num_experts=8, top_k=3, dtype=torch.float32,
                             params=params)
    outs = {}
    for defer in (False, True):
        for flat in (False, True):
            ws.poison()
            outs[defer, flat] = simulated_moe_forward(
                w["xs"], w["scores"], w["indices"], w["w1s"], w["w2s"], w["w3s"], schedule="fused",
                score_before_experts=False, workspace=ws,
                params=params.replace(fc2_defer_release=defer, fc2_flat_loop=flat),
            )
    for key, out in outs.items():
        for a, b in zip(outs[False, False], out):
            assert not a.isnan().any() and torch.equal(a, b), key


@pytest.mark.parametrize("case", ["skewed_one_expert", "empty_experts", "rank_receives_nothing", "rank_with_no_tokens",
                                  "one_local_expert"])
def test_fused_matches_sequential_bitwise_under_edge_routing(case):
    if case == "skewed_one_expert":  # every token picks expert 5: one expert gets many tiles
        w = make_world(2, 8, 3, [21, 17], seed=11, force=5)
    elif case == "empty_experts":  # odd experts never picked
        w = make_world(2, 8, 2, [9, 6], seed=12, allowed=[0, 2, 4, 6])
    elif case == "rank_receives_nothing":  # only rank 0's experts
        w = make_world(2, 8, 3, [10, 7], seed=13, allowed=[0, 1, 2, 3])
    elif case == "rank_with_no_tokens":
        w = make_world(2, 8, 3, [0, 9], seed=14)
    else:  # El = 1, every token on both ranks
        w = make_world(2, 2, 2, [9, 5], seed=15)
    score_before = case in ("empty_experts", "one_local_expert")
    params = interpreter_params(fc2_defer_release=case in ("skewed_one_expert", "rank_with_no_tokens"),
                                fc2_flat_loop=case in ("empty_experts", "rank_with_no_tokens"))
    num_tokens, top_k = [x.shape[0] for x in w["xs"]], w["indices"][0].shape[1]
    ws = Workspace.simulated(2, num_tokens=max(num_tokens), dim=DIM, hidden=HIDDEN, num_experts=w["w1"].shape[0],
                             top_k=top_k, dtype=torch.float32, params=params)
    seq, fus = run_both(w, score_before=score_before, workspace=ws, params=params)  # poisons ws before each run
    assert_correct(w, seq, fus, score_before=score_before)


def test_workspace_reuse_across_calls_with_new_routing():
    """Epochs and counter zeroing: one workspace, three calls, new data each time."""
    ws = Workspace.simulated(2, num_tokens=12, dim=DIM, hidden=HIDDEN, num_experts=8, top_k=2,
                             dtype=torch.float32, params=interpreter_params())
    for call, tokens in enumerate([[12, 5], [3, 12], [8, 8]]):
        w = make_world(2, 8, 2, tokens, seed=100 + call)
        seq, fus = run_both(w, score_before=False, workspace=ws)
        assert_correct(w, seq, fus, score_before=False)
    assert ws.control[:, CTL_EPOCH].tolist() == [6, 6]  # two schedules x three calls


def test_counts_exchange_gives_every_rank_the_same_table():
    w = make_world(4, 8, 3, [5, 0, 7, 3], seed=21)
    ws = Workspace.simulated(4, num_tokens=7, dim=DIM, hidden=HIDDEN, num_experts=8, top_k=3,
                             dtype=torch.float32, params=interpreter_params())
    simulated_moe_forward(w["xs"], w["scores"], w["indices"], w["w1s"], w["w2s"], w["w3s"],
                          schedule="fused", score_before_experts=False, workspace=ws)
    expected = torch.stack([count_per_expert(i, 8) for i in w["indices"]])
    for r in range(4):
        assert torch.equal(ws.counts_all[r], expected)


@pytest.mark.timeout(30)  # a wait that never gives up fails here, not at pyproject's 900 s
def test_silent_rank_times_out_with_a_clear_error():
    w = make_world(2, 8, 3, [6, 6], seed=31)
    params = interpreter_params(debug_silent_rank=1, interpreter_max_spins=3)
    with pytest.raises(RuntimeError, match=r"rank 0 .*waiting for the dispatched rows of tile \d+ \(tile_arrivals"):
        simulated_moe_forward(w["xs"], w["scores"], w["indices"], w["w1s"], w["w2s"], w["w3s"],
                              schedule="fused", score_before_experts=False, params=params)


def test_dedup_sends_each_token_once_per_destination_rank():
    w = make_world(2, 8, 4, [16, 16], seed=41)
    counts_all = torch.stack([count_per_expert(i, 8) for i in w["indices"]])
    layout = compute_layout(w["indices"][0], counts_all, 0)
    sent = exchange_bytes(layout, DIM, 4)
    dest_rank = w["indices"][0] // 4
    tokens_to_rank1 = int((dest_rank == 1).any(1).sum())
    copies_to_rank1 = int((dest_rank == 1).sum())
    assert int(sent["dispatch_dedup"]) == tokens_to_rank1 * DIM * 4
    assert int(sent["dispatch_copies"]) == copies_to_rank1 * DIM * 4
    assert torch.equal(token_destinations(layout), torch.stack([(dest_rank == r).any(1) for r in range(2)], 1))


def test_memory_report_follows_the_documented_formula():
    shape = WorkspaceShape(world_size=2, token_capacity=8192, dim=2048, hidden=768, num_experts=128, top_k=8,
                           dtype=torch.bfloat16, block_m=128)
    sizes = memory_bytes(shape)
    slots = 2 * 8192 * 8
    assert sizes["tokens"] == 2 * 8192 * 2048 * 2
    assert sizes["returned"] == 8192 * 8 * 2048 * 2
    assert sizes["slot_copy"] == sizes["slot_score"] == 4 * slots
    assert sizes["tile_arrivals"] == 4 * (slots // 128 + 64)
    assert sizes["h"] == slots * 768 * 2
    assert sizes["arena"] >= sum(sizes[k] for k in ("tokens", "slot_copy", "slot_score", "tile_arrivals", "returned",
                                                    "token_arrivals", "counts", "count_flags"))
    blocks = 8192 * 8 // 128  # route blocks of 128 copies (E = 128)
    assert sizes["route"] == 4 * (1 + blocks * 128 + 5 * 128 + 3 * 8192 * 8 + 4 * (slots // 128 + 64) + 1)
    assert sizes["total"] == sizes["arena"] + sizes["h"] + sizes["counts_all"] + sizes["control"] + sizes["route"]
    # One rank: the tiles read x in place, the arena holds no token rows.
    alone = memory_bytes(WorkspaceShape(**{**shape.__dict__, "world_size": 1}))
    assert alone["tokens"] == 0 and alone["arena"] < sizes["arena"] - sizes["tokens"]
    # The route arrays as a workspace allocates them (per local rank).
    ws = Workspace.simulated(2, num_tokens=13, dim=DIM, hidden=HIDDEN, num_experts=8, top_k=3, dtype=torch.float32,
                             params=interpreter_params())
    route = ("num_tokens", "block_counts", "route_tables", "dest_rank", "dest_slot", "dest_tile", "tile_expert",
             "tile_start", "tile_end", "num_tiles", "tile_order")
    assert ws.memory_bytes()["route"] * 2 == sum(getattr(ws, name).nbytes for name in route)


def test_backward_returned_rows_hold_the_da_row_and_its_score_word_in_128_byte_lines():
    """The backward's returned row: D elements of dA, then one fp32 word (the
    router-score gradient), padded to 128 bytes; not the 2D of its
    ``[x | dOut]`` token rows."""
    assert backward_returned_row(2048, torch.bfloat16) == 2112  # 4096 + 4 bytes -> 4224
    assert backward_returned_row(1000, torch.float16) == 1024  # 2000 + 4 -> 2048
    assert backward_returned_row(30, torch.float32) == 32  # 120 + 4 -> 128
    with pytest.raises(ValueError, match="multiple of 4 bytes"):
        backward_returned_row(33, torch.bfloat16)
    sizes = dict(num_tokens=5, dim=2048, hidden=16, num_experts=4, top_k=2, dtype=torch.bfloat16,
                 params=interpreter_params())
    shape = BackwardWorkspace.simulated(1, **sizes).inner.shape
    assert (shape.dim, shape.returned_row_elems) == (4096, 2112)
    assert memory_bytes(shape)["returned"] == 5 * 2 * 4224
    assert Workspace.simulated(1, **sizes).shape.returned_row_elems == 2048  # the forward's: D


@pytest.mark.parametrize("defer,flat,local_first", [(False, False, False), (True, True, False), (False, False, True)])
def test_per_rank_launches_match_the_simulated_world(defer, flat, local_first):
    """The real-EP path (one rank per launch: L = 1, rank_base = r), driven rank
    by rank in producer-first order on shared simulated arenas, gives the same
    bits as the whole-world launch (also with ``local_first``: own rows, then
    the others, tiles in each rank's own ``tile_order``)."""
    from titan_uniep.runtime.forward import launch_forward
    from titan_uniep.runtime.launch import CallArrays, route

    world, cfg = 2, interpreter_params(fc2_defer_release=defer, fc2_flat_loop=flat, local_first=local_first,
                                       local_first_experts=1.0)
    w = make_world(world, 8, 3, [11, 6], seed=51)
    ws = Workspace.simulated(world, num_tokens=11, dim=DIM, hidden=HIDDEN, num_experts=8, top_k=3,
                             dtype=torch.float32, params=cfg)
    whole = simulated_moe_forward(w["xs"], w["scores"], w["indices"], w["w1s"], w["w2s"], w["w3s"],
                                  schedule="sequential", score_before_experts=False, workspace=ws)
    views = [rank_view(ws, r, ("h",)) for r in range(world)]
    for step in ("count", "publish", "collect", "place"):
        for r in range(world):
            indices = w["indices"][r].unsqueeze(0)
            route(views[r], indices, indices.shape[1], cfg, steps=[step])
    # One rank's arrays as moe_forward builds them (L = 1), into a NaN-poisoned output.
    calls = [CallArrays(x=w["xs"][r].unsqueeze(0), scores=w["scores"][r].unsqueeze(0), w1=w["w1s"][r].unsqueeze(0),
                        w2=w["w2s"][r].unsqueeze(0), w3=w["w3s"][r].unsqueeze(0),
                        out=torch.full_like(w["xs"][r], float("nan")).unsqueeze(0)) for r in range(world)]
    for phase in ("dispatch", "fc1", "fc2", "reduce"):
        for r in range(world):
            launch_forward(views[r], calls[r], cfg, False, [phase])
    ws.check_errors()
    for r in range(world):
        assert torch.equal(calls[r].out[0], whole[r]), f"rank {r}"


def test_workspace_grows_when_asked_and_keeps_working():
    ws = Workspace.simulated(2, num_tokens=4, dim=DIM, hidden=HIDDEN, num_experts=8, top_k=2, dtype=torch.float32,
                             params=interpreter_params())
    w = make_world(2, 8, 2, [9, 6], seed=61)
    with pytest.raises(RuntimeError, match="ensure_capacity"):
        simulated_moe_forward(w["xs"], w["scores"], w["indices"], w["w1s"], w["w2s"], w["w3s"],
                              schedule="fused", score_before_experts=False, workspace=ws)
    assert ws.ensure_capacity(9) and not ws.ensure_capacity(5)
    assert ws.shape.token_capacity == 9
    seq, fus = run_both(w, score_before=False, workspace=ws)
    assert_correct(w, seq, fus, score_before=False)


def test_every_token_on_one_rank_fills_its_slots_exactly_and_a_grown_workspace_keeps_the_bits():
    """Every token of every rank routed to experts 0..K-1, all local to rank 0
    (K <= El): rank 0 receives W * T * K copies, exactly its slot capacity
    ``W * T * min(K, El)``, rank 1 none. A used workspace grown to T gives
    the bits of one built for T, and drops nothing (float64 oracle)."""
    world, num_experts, top_k, num_tokens = 2, 8, 3, 11
    w = make_world(world, num_experts, top_k, [num_tokens] * world, seed=81)
    w["indices"] = [torch.arange(top_k).expand(num_tokens, top_k).contiguous() for _ in range(world)]
    grown = Workspace.simulated(world, num_tokens=4, dim=DIM, hidden=HIDDEN, num_experts=num_experts, top_k=top_k,
                                dtype=torch.float32, params=interpreter_params())
    before = make_world(world, num_experts, top_k, [4, 3], seed=82)  # a used workspace: its epochs move on
    simulated_moe_forward(before["xs"], before["scores"], before["indices"], before["w1s"], before["w2s"],
                          before["w3s"], schedule="fused", score_before_experts=False, workspace=grown)
    assert grown.ensure_capacity(num_tokens)
    assert grown.shape.slot_capacity == world * num_tokens * top_k
    seq, fus = run_both(w, score_before=False, workspace=grown)
    assert_correct(w, seq, fus, score_before=False)
    received = grown.counts_all[0, :, : num_experts // world].sum(), grown.counts_all[1, :, num_experts // world:].sum()
    assert [int(n) for n in received] == [grown.shape.slot_capacity, 0]
    fresh = Workspace.simulated(world, num_tokens=num_tokens, dim=DIM, hidden=HIDDEN, num_experts=num_experts,
                                top_k=top_k, dtype=torch.float32, params=interpreter_params())
    again = simulated_moe_forward(w["xs"], w["scores"], w["indices"], w["w1s"], w["w2s"], w["w3s"],
                                  schedule="fused", score_before_experts=False, workspace=fresh)
    for a, b in zip(fus, again):
        assert torch.equal(a, b), "the grown workspace gives other bits than one built for T"


@pytest.mark.parametrize("world,num_experts,top_k,num_tokens,block_m,case", [
    (2, 8, 3, [13, 9], 16, "random"),
    (4, 8, 3, [7, 0, 5, 9], 16, "random"),
    (2, 8, 2, [40, 33], 16, "skewed"),
    (2, 2, 2, [9, 5], 4 * 4, "one_local_expert"),
    (2, 128, 8, [300, 257], 128, "random"),
    (4, 256, 8, [70, 65, 0, 3], 32, "empty_experts"),
    (2, 6, 2, [11, 17], 16, "random"),  # E not a power of two
    (1, 128, 8, [300], 128, "random"),  # one rank: publish and collect in one launch of 8 parts
    (1, 72, 4, [77], 16, "skewed"),  # one rank, 8 parts: the fifth one's columns partly past E, the last 3's all
    (1, 256, 8, [5], 16, "random"),  # more chunks of receive tiles than blocks of copies
])
def test_route_kernels_match_compute_layout_and_compute_tiles_bitwise(world, num_experts, top_k, num_tokens,
                                                                      block_m, case):
    """The Triton layout (kernels.route) gives exactly the arrays of the torch
    definition (layout.compute_layout + compute_tiles), on every rank, for two
    calls in a row on one workspace (each call's counts exchange is split in
    ``count_parts(E)`` parts, whose last one resets the ticket for the next).
    The first call writes the receive tiles in route_layout_kernel; the second,
    with local_first, in the exchange (with tile_order, here for half the
    local experts)."""
    from titan_uniep.kernels.route import count_parts
    from titan_uniep.layout import compute_tiles
    from titan_uniep.runtime.launch import route

    assert count_parts(num_experts) == {128: 8, 256: 16, 72: 8}.get(num_experts, 1)
    gen = torch.Generator().manual_seed(num_experts * 7 + sum(num_tokens))
    cfg = interpreter_params(block_m=block_m, local_first=True, local_first_experts=0.5)
    ws = Workspace.simulated(world, num_tokens=max(num_tokens), dim=DIM, hidden=HIDDEN, num_experts=num_experts,
                             top_k=top_k, dtype=torch.float32, params=cfg)
    for call, local_first in enumerate((False, True)):
        tokens = num_tokens if call == 0 else [max(0, t - 3 * r - 1) for r, t in enumerate(num_tokens)]
        indices = []
        for t in tokens:
            pool = torch.arange(num_experts)
            if case == "empty_experts":
                pool = pool[pool % 3 != 1]
            picked = pool[torch.rand(t, len(pool), generator=gen).argsort(1)][:, :top_k]
            if case == "skewed":
                lacks = (picked != 3 + call).all(1)
                picked[lacks, -1] = 3 + call
            indices.append(picked.contiguous())
        _check_route(ws, cfg.replace(local_first=local_first), indices, tokens, num_experts, top_k, block_m, world,
                     compute_tiles, route, f"call {call}")


def _check_route(ws, cfg, indices, num_tokens, num_experts, top_k, block_m, world, compute_tiles, route, label):
    cap = ws.shape.token_capacity
    padded = torch.full((world, cap, top_k), -1, dtype=torch.int64)
    for r, idx in enumerate(indices):
        padded[r, :idx.shape[0]] = idx
    ws.num_tokens.copy_(torch.tensor(num_tokens, dtype=torch.int32))
    for out in (ws.dest_rank, ws.dest_slot, ws.dest_tile, ws.tile_expert, ws.tile_start, ws.tile_end, ws.num_tiles,
                ws.tile_order, ws.counts_all):
        out.fill_(-7)  # poison: every entry compared below must be written by this call
    route(ws, padded, None, cfg)
    ws.check_errors()
    counts_all = torch.stack([count_per_expert(i, num_experts) for i in indices])
    for r in range(world):
        where = f"{label}, rank {r}"
        assert torch.equal(ws.counts_all[r], counts_all), f"{where}: counts_all"
        layout = compute_layout(indices[r], counts_all, r)
        tiles = compute_tiles(layout, indices[r], block_m, ws.shape.tile_capacity)
        t = num_tokens[r]
        assert torch.equal(ws.dest_rank[r, :t], layout.dest_rank.to(torch.int32)), f"{where}: dest_rank"
        assert torch.equal(ws.dest_slot[r, :t], layout.dest_slot.to(torch.int32)), f"{where}: dest_slot"
        assert torch.equal(ws.dest_tile[r, :t], tiles.dest_tile), f"{where}: dest_tile"
        assert torch.equal(ws.tile_expert[r], tiles.tile_expert), f"{where}: tile_expert"
        assert torch.equal(ws.tile_start[r], tiles.tile_start), f"{where}: tile_start"
        assert torch.equal(ws.tile_end[r], tiles.tile_end), f"{where}: tile_end"
        assert torch.equal(ws.num_tiles[r:r + 1], tiles.num_tiles), f"{where}: num_tiles"
        if not cfg.local_first:
            continue
        # tile_order (LayerParams.local_first): the tiles of the first half of the
        # local experts whose rows all come from rank r itself first, then the
        # others, each in id order.
        el = num_experts // world
        mine = counts_all[:, r * el:(r + 1) * el]  # (W, El): rows of each source in r's experts
        own_lo = layout.expert_offsets[:-1] + (torch.cumsum(mine, 0) - mine)[r]
        own_hi = own_lo + mine[r]
        ids = torch.arange(ws.shape.tile_capacity)
        expert = tiles.tile_expert.long()
        own = ((ids < int(tiles.num_tiles)) & (tiles.tile_start >= own_lo[expert]) & (tiles.tile_end <= own_hi[expert])
               & (expert < -(-el // 2)))
        expected = torch.cat([ids[own], ids[~own]]).to(torch.int32)
        assert torch.equal(ws.tile_order[r], expected), f"{where}: tile_order"


@pytest.mark.parametrize("world,num_tokens,case,defer", [
    (2, [21, 17], "random", False),
    (2, [21, 17], "skewed", True),
    (4, [9, 0, 13, 6], "random", True),
    (2, [10, 7], "rank_receives_nothing", False),
])
def test_local_first_schedule_changes_no_bits(world, num_tokens, case, defer):
    """``LayerParams.local_first``: rows that stay on a rank are dispatched
    first by every program and the tiles holding only those run first; the
    others follow. Same outputs, bit for bit, as the default schedule (fused
    and sequential), and correct (skewed routing, a rank with no tokens, a rank
    that receives nothing, with and without the deferred release)."""
    allowed = [0, 1, 2, 3] if case == "rank_receives_nothing" else None
    w = make_world(world, 8, 3, num_tokens, seed=31 + world, allowed=allowed,
                   force=5 if case == "skewed" else None)
    base = interpreter_params(fc2_defer_release=defer, num_programs=3)
    ws = Workspace.simulated(world, num_tokens=max(num_tokens), dim=DIM, hidden=HIDDEN, num_experts=8, top_k=3,
                             dtype=torch.float32, params=base)
    outs = {}
    for flag in (False, True):
        outs[flag] = run_both(w, score_before=False, workspace=ws, params=base.replace(local_first=flag))
        # Own-rows dispatch claims of the last (fused) call (one counter, row 0, serves the simulated world).
        claimed = int(ws.control[0, CTL_OWN_DISPATCH_TASKS])
        assert (claimed > 0) == flag, f"local_first={flag}: {claimed} own-rows dispatch claims"
    assert_correct(w, *outs[True], score_before=False)
    for schedule in (0, 1):
        for r in range(world):
            assert torch.equal(outs[False][schedule][r], outs[True][schedule][r]), f"rank {r}: local_first changed bits"


def test_default_params_per_shape_choice():
    """The defaults table (params.DEFAULTS, keyed by EP size and shape class):
    the EP-size default for long expert GEMMs; for small expert hidden dims
    (short, H <= 1024) every program dispatching first, fc2_combine as two
    4-warp programs per SM with 128-column tiles and da_combine as two 4-warp
    programs per SM with a 32-deep K step; for medium ones (H <= 2048) only the
    da_combine choice; the one-product fc1 tile in every class. Other EP sizes
    take the closest smaller tuned size's entry (the smallest's below it)."""
    from titan_uniep.params import DEFAULTS, LayerParams, default_params, shape_class

    base = default_params(2, hidden=14336)
    assert base == LayerParams(fc1_one_dot=True) == DEFAULTS[2, "long"]
    assert base.dispatch_programs == 16 and base.fc2_programs_per_sm == 1
    assert (base.fc2_block_n, base.fc2_num_warps, base.da_block_k, base.da_num_warps, base.da_programs_per_sm) == (
        256, 8, 64, 8, 1)
    short_da = dict(da_block_k=32, da_num_warps=4, da_programs_per_sm=2)
    assert default_params(2, hidden=768) == base.replace(
        dispatch_programs=1024, fc2_block_n=128, fc2_num_warps=4, fc2_programs_per_sm=2, **short_da)
    assert default_params(2, hidden=1024) == default_params(2, hidden=768)
    assert default_params(2, hidden=2048) == base.replace(**short_da) == default_params(2, hidden=1025)
    assert default_params(2, hidden=2049) == base
    assert [shape_class(h) for h in (768, 1024, 1025, 2048, 2049)] == ["short", "short", "medium", "medium", "long"]
    for h in (768, 2048, 14336):  # EP sizes without a row of their own
        assert default_params(1, hidden=h) == default_params(8, hidden=h) == default_params(2, hidden=h)
    with pytest.raises(ValueError, match="ep_size"):
        default_params(0, hidden=768)
