"""UniEP backward megakernels on a simulated world (CPU, Triton interpreter).

fp32 data (the interpreter's bf16 tl.dot is wrong; bf16 runs in tests/gpu/).
The backward reads each slot's h1 | h3 as the forward saves them: the
forward's own buffer (``saved_h13_of_forward``) where a test is about the
two together, else the same rows built in torch (``saved_h13_reference``:
the forward under the interpreter costs as much as the backward). Every run
poisons the backward workspace with NaN first. Each gradient (x, scores,
w1, w2, w3) is checked against autograd of the float64 reference and
of the layout reference (torch, fp32), and fused against sequential bitwise.
"""

from interpreter_env import request_interpreter

request_interpreter()  # before anything defines a Triton kernel

import pytest
import torch
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from titan_uniep.oracle import float64_moe_oracle, layout_oracle_forward
from titan_uniep.params import interpreter_params
from titan_uniep.runtime import BackwardWorkspace, simulated_moe_backward

import worlds

if torch.cuda.is_available():
    pytest.skip("CPU interpreter tests (GPU runs use tests/gpu/)", allow_module_level=True)
if not isinstance(tl.standard.cdiv, InterpretedFunction):
    pytest.skip("Triton was imported before TRITON_INTERPRET=1; run in a subprocess", allow_module_level=True)

DIM, HIDDEN = 32, 48
NAMES = ("dx", "dscores", "dw1", "dw2", "dw3")


def make_world(world, num_experts, top_k, num_tokens, *, seed, allowed=None, force=None):
    """Random inputs of a simulated world (``worlds.make_world`` at this file's dims, fp32)."""
    return worlds.make_world(world, num_experts, top_k, num_tokens, seed=seed, dim=DIM, hidden=HIDDEN,
                             allowed=allowed, force=force)


def run_both(w, *, score_before, params=None, workspace=None, saved=None):
    """The backward in both schedules on ``saved`` (default:
    ``saved_h13_reference`` sized for ``workspace``)."""
    params = params or interpreter_params()
    if saved is None:
        capacity = workspace.inner.shape.token_capacity if workspace is not None else None
        saved = saved_h13_reference(w, score_before=score_before, num_tokens=capacity)
    outs = {}
    for schedule in ("sequential", "fused"):
        if workspace is not None:
            workspace.poison()
        outs[schedule] = simulated_moe_backward(
            w["grads"], w["xs"], w["scores"], w["indices"], w["w1s"], w["w2s"], w["w3s"], schedule=schedule,
            score_before_experts=score_before, params=params, workspace=workspace, poison_outputs=True,
            saved_h13=saved,
        )
    return outs["sequential"], outs["fused"]


def saved_h13_of_forward(w, params, *, score_before=False):
    """Each slot's h1 | h3 as the fused forward saves them (NaN where no slot
    is used), for the backward's ``saved_h13``."""
    from titan_uniep.runtime import Workspace, simulated_moe_forward

    world, num_experts, top_k = len(w["xs"]), w["el"] * len(w["xs"]), w["indices"][0].shape[1]
    fwd = Workspace.simulated(world, num_tokens=max(max(len(x) for x in w["xs"]), 1), dim=DIM, hidden=HIDDEN,
                              num_experts=num_experts, top_k=top_k, dtype=torch.float32, params=params)
    saved = torch.full((world, fwd.shape.slot_capacity, 2 * HIDDEN), float("nan"))
    simulated_moe_forward(w["xs"], w["scores"], w["indices"], w["w1s"], w["w2s"], w["w3s"], schedule="fused",
                          score_before_experts=score_before, params=params, workspace=fwd, saved_h13=saved)
    return saved


def saved_h13_reference(w, *, score_before=False, num_tokens=None):
    """What the forward saves, built in torch: each copy's h1 | h3 at its slot
    of the deterministic layout (``titan_uniep.layout``, the slots the route
    kernels assign), NaN in unused slots; ``num_tokens``: the token capacity
    of the backward workspace it is for (default: the most tokens of a rank)."""
    from titan_uniep.layout import compute_layout, count_per_expert, slot_capacity

    world, el, top_k = len(w["xs"]), w["el"], w["indices"][0].shape[1]
    counts_all = torch.stack([count_per_expert(idx, el * world) for idx in w["indices"]])
    layouts = [compute_layout(w["indices"][r], counts_all, r) for r in range(world)]
    capacity = slot_capacity(world, num_tokens or max(max(len(x) for x in w["xs"]), 1), top_k, el)
    saved = torch.full((world, capacity, 2 * HIDDEN), float("nan"))
    for src, lay in enumerate(layouts):
        for r in range(world):
            token, choice = (lay.dest_rank == r).nonzero(as_tuple=True)
            expert = w["indices"][src][token, choice] - r * el
            a = w["xs"][src][token]
            if score_before:
                a = a * w["scores"][src][token, choice, None]
            h1 = torch.einsum("nd,nhd->nh", a, w["w1s"][r][expert])
            h3 = torch.einsum("nd,nhd->nh", a, w["w3s"][r][expert])
            saved[r, lay.dest_slot[token, choice]] = torch.cat([h1, h3], 1)
    return saved


def float64_grads(w, score_before):
    """Autograd of the float64 reference; weight grads summed over ranks, split per owner."""
    leaves = [t.double().requires_grad_() for t in (w["w1"], w["w2"], w["w3"])]
    per_rank = []
    for r in range(len(w["xs"])):
        x = w["xs"][r].double().requires_grad_()
        s = w["scores"][r].double().requires_grad_()
        out = float64_moe_oracle(x, s, w["indices"][r], *leaves, score_before_experts=score_before)
        if not out.requires_grad:  # a rank without tokens
            per_rank.append([torch.zeros_like(x), torch.zeros_like(s)])
            continue
        dx, ds = torch.autograd.grad(out, (x, s), w["grads"][r].double(), retain_graph=True, allow_unused=True)
        per_rank.append([dx if dx is not None else torch.zeros_like(x), ds if ds is not None else torch.zeros_like(s)])
        (out * w["grads"][r].double()).sum().backward()
    el = w["el"]
    for r, item in enumerate(per_rank):
        item += [leaf.grad[r * el:(r + 1) * el] for leaf in leaves]
    return per_rank


def layout_grads(w, score_before):
    """Autograd of the layout reference (torch, same placement and order, fp32)."""
    leaf = lambda ts: [t.clone().requires_grad_() for t in ts]  # noqa: E731
    xs, scores, w1s, w2s, w3s = leaf(w["xs"]), leaf(w["scores"]), leaf(w["w1s"]), leaf(w["w2s"]), leaf(w["w3s"])
    outs = layout_oracle_forward(xs, scores, w["indices"], w1s, w2s, w3s, score_before_experts=score_before)
    torch.autograd.backward(outs, w["grads"])
    zero = lambda t: t.grad if t.grad is not None else torch.zeros_like(t)  # noqa: E731
    return [[zero(xs[r]), zero(scores[r]), zero(w1s[r]), zero(w2s[r]), zero(w3s[r])] for r in range(len(xs))]


def assert_correct(w, sequential, fused, *, score_before):
    exact = float64_grads(w, score_before)
    layout = layout_grads(w, score_before)
    for r in range(len(w["xs"])):
        for name, seq, fus, ex, lay in zip(NAMES, sequential[r], fused[r], exact[r], layout[r]):
            where = f"rank {r} {name}"
            assert torch.equal(seq, fus), f"{where}: fused differs from sequential"
            assert not torch.isnan(fus).any(), f"{where}: NaN (a row was read before it was written)"
            torch.testing.assert_close(fus.double(), ex, rtol=1e-4, atol=1e-4, msg=lambda m: f"{where} vs float64: {m}")
            torch.testing.assert_close(fus, lay, rtol=1e-4, atol=1e-5, msg=lambda m: f"{where} vs layout ref: {m}")


@pytest.mark.parametrize("score_before", [False, True], ids=["score_after", "score_before"])
@pytest.mark.parametrize("world,num_experts,top_k,num_tokens", [
    (1, 6, 4, [13]),  # EP = 1: the tiles read x and dOut in place
    (2, 8, 3, [13, 9]),
    (4, 8, 3, [7, 11, 5, 9]),
    (8, 16, 4, [5, 0, 9, 3, 7, 2, 6, 4]),  # EP = 8 (one 8-GPU node), a rank with no tokens
])
def test_backward_fused_matches_sequential_bitwise_and_references(world, num_experts, top_k, num_tokens,
                                                                   score_before):
    w = make_world(world, num_experts, top_k, num_tokens, seed=1 + world)
    ws = BackwardWorkspace.simulated(world, num_tokens=max(num_tokens), dim=DIM, hidden=HIDDEN,
                                     num_experts=num_experts, top_k=top_k, dtype=torch.float32,
                                     params=interpreter_params())
    saved = saved_h13_reference(w, score_before=score_before)
    seq, fus = run_both(w, score_before=score_before, workspace=ws, saved=saved)
    assert_correct(w, seq, fus, score_before=score_before)
    again = simulated_moe_backward(w["grads"], w["xs"], w["scores"], w["indices"], w["w1s"], w["w2s"], w["w3s"],
                                   schedule="fused", score_before_experts=score_before, workspace=ws,
                                   params=interpreter_params(), saved_h13=saved)
    for r in range(world):
        for name, a, b in zip(NAMES, fus[r], again[r]):
            assert torch.equal(a, b), f"rank {r} {name}: differs run to run"


def test_backward_needs_the_h1_h3_saved_by_the_forward():
    """There is no backward that recomputes h1 | h3: a call without the
    forward's buffer, or with one of another shape, fails before any launch
    and says what to pass."""
    from types import SimpleNamespace

    from titan_uniep.kernels.scoreboard import CTL_EPOCH
    from titan_uniep.runtime import moe_backward

    w = make_world(2, 8, 3, [13, 10], seed=81)
    cfg = interpreter_params()
    ws = BackwardWorkspace.simulated(2, num_tokens=13, dim=DIM, hidden=HIDDEN, num_experts=8, top_k=3,
                                     dtype=torch.float32, params=cfg)
    args = (w["grads"], w["xs"], w["scores"], w["indices"], w["w1s"], w["w2s"], w["w3s"])
    epochs = ws.inner.control[:, CTL_EPOCH].clone()
    fix = r"needs saved_h13.*run the forward \(runtime\.forward\.{}\) with saved_h13=BUFFER"
    with pytest.raises(ValueError, match=fix.format("simulated_moe_forward")):
        simulated_moe_backward(*args, schedule="fused", score_before_experts=False, params=cfg, workspace=ws)
    real_ep = SimpleNamespace(is_simulated=False)  # the check comes before anything touches the workspace
    with pytest.raises(ValueError, match=fix.format("moe_forward")):
        moe_backward(w["grads"][0], w["xs"][0], w["scores"][0], w["indices"][0], w["w1s"][0], w["w2s"][0],
                     w["w3s"][0], workspace=real_ep, score_before_experts=False)
    wrong = torch.zeros(2, ws.inner.shape.slot_capacity - 1, 2 * HIDDEN)
    with pytest.raises(ValueError, match="saved_h13 must be"):
        simulated_moe_backward(*args, schedule="fused", score_before_experts=False, params=cfg, workspace=ws,
                               saved_h13=wrong)
    assert torch.equal(ws.inner.control[:, CTL_EPOCH], epochs), "a refused call started a call epoch"


@pytest.mark.parametrize("score_before", [False, True], ids=["score_after", "score_before"])
@pytest.mark.parametrize("num_tokens", [[13, 10], [13]], ids=["world2", "world1"])
def test_backward_slot_rows_copied_by_dh_tasks_change_no_bits(num_tokens, score_before):
    """``LayerParams.dh_copies_rows``: dispatch_dh's dH tasks write the weight
    gradients' dense slot rows (a column chunk each) instead of the gather
    launch. Every gradient equals the gather path's bit for bit in both
    schedules (poisoned workspace: a chunk no task copies would show up as NaN
    in dW1 / dW2 / dW3); skewed routing with empty experts, odd T; at EP = 1
    both read x and dOut in place."""
    world = len(num_tokens)
    w = make_world(world, 8, 3, num_tokens, seed=83, allowed=[0, 1, 2, 3, 5])  # experts 4, 6, 7 empty
    cfg = interpreter_params()
    saved = saved_h13_of_forward(w, cfg, score_before=score_before)
    # the other tests' stand-in for the forward's buffer: the same slots (NaN where unused), the same values
    torch.testing.assert_close(saved_h13_reference(w, score_before=score_before), saved, rtol=1e-5, atol=1e-6,
                               equal_nan=True)
    ws = BackwardWorkspace.simulated(world, num_tokens=13, dim=DIM, hidden=HIDDEN, num_experts=8, top_k=3,
                                     dtype=torch.float32, params=cfg)
    outs = {}
    for copied in (False, True):
        for schedule in ("sequential", "fused"):
            ws.poison()
            outs[copied, schedule] = simulated_moe_backward(
                w["grads"], w["xs"], w["scores"], w["indices"], w["w1s"], w["w2s"], w["w3s"], schedule=schedule,
                score_before_experts=score_before, params=cfg.replace(dh_copies_rows=copied), workspace=ws,
                poison_outputs=True, saved_h13=saved)
    assert_correct(w, outs[True, "sequential"], outs[True, "fused"], score_before=score_before)
    for schedule in ("sequential", "fused"):
        for r in range(world):
            for name, a, b in zip(NAMES, outs[False, schedule][r], outs[True, schedule][r]):
                assert torch.equal(a, b), f"{schedule} rank {r} {name}: the copy by the dH tasks changed a value"


@pytest.mark.parametrize("world,num_tokens", [(2, [13, 10]), (4, [9, 0, 11, 6])])
def test_backward_local_first_schedule_changes_no_bits(world, num_tokens):
    """``LayerParams.local_first`` in dispatch_dh (rows that stay on a rank
    dispatched first by every program, tiles of only those first): every
    gradient equals the default schedule's bit for bit, in both schedules
    (skewed routing, a rank with no tokens)."""
    from titan_uniep.kernels.scoreboard import CTL_OWN_DISPATCH_TASKS

    w = make_world(world, 8, 3, num_tokens, seed=91 + world, force=5)
    base = interpreter_params(num_programs=3)
    saved_h13 = saved_h13_of_forward(w, base)
    ws = BackwardWorkspace.simulated(world, num_tokens=max(num_tokens), dim=DIM, hidden=HIDDEN, num_experts=8,
                                     top_k=3, dtype=torch.float32, params=base)
    outs = {}
    for flag in (False, True):
        for schedule in ("sequential", "fused"):
            ws.poison()
            outs[flag, schedule] = simulated_moe_backward(
                w["grads"], w["xs"], w["scores"], w["indices"], w["w1s"], w["w2s"], w["w3s"], schedule=schedule,
                score_before_experts=False, params=base.replace(local_first=flag), workspace=ws,
                poison_outputs=True, saved_h13=saved_h13)
        claimed = int(ws.inner.control[0, CTL_OWN_DISPATCH_TASKS])  # the last (fused) call's own-rows claims
        assert (claimed > 0) == flag, f"local_first={flag}: {claimed} own-rows dispatch claims"
    assert_correct(w, outs[True, "sequential"], outs[True, "fused"], score_before=False)
    for schedule in ("sequential", "fused"):
        for r in range(world):
            for name, a, b in zip(NAMES, outs[False, schedule][r], outs[True, schedule][r]):
                assert torch.equal(a, b), f"{schedule} rank {r} {name}: local_first changed a value"


@pytest.mark.parametrize("case", ["skewed_one_expert", "empty_experts", "rank_receives_nothing",
                                  "rank_with_no_tokens", "one_local_expert"])
def test_backward_bitwise_and_correct_under_edge_routing(case):
    if case == "skewed_one_expert":  # every token picks expert 5: many tiles of one expert
        w = make_world(2, 8, 3, [21, 17], seed=11, force=5)
    elif case == "empty_experts":  # odd experts never picked: zero weight grads
        w = make_world(2, 8, 2, [9, 6], seed=12, allowed=[0, 2, 4, 6])
    elif case == "rank_receives_nothing":
        w = make_world(2, 8, 3, [10, 7], seed=13, allowed=[0, 1, 2, 3])
    elif case == "rank_with_no_tokens":
        w = make_world(2, 8, 3, [0, 9], seed=14)
    else:  # El = 1
        w = make_world(2, 2, 2, [9, 5], seed=15)
    score_before = case in ("empty_experts", "one_local_expert")
    ws = BackwardWorkspace.simulated(2, num_tokens=max(max(len(x) for x in w["xs"]), 1), dim=DIM, hidden=HIDDEN,
                                     num_experts=w["el"] * 2, top_k=w["indices"][0].shape[1], dtype=torch.float32,
                                     params=interpreter_params())
    seq, fus = run_both(w, score_before=score_before, workspace=ws)
    assert_correct(w, seq, fus, score_before=score_before)


@pytest.mark.timeout(30)  # a wait that never gives up fails here, not at pyproject's 900 s
def test_backward_silent_rank_times_out_with_a_clear_error():
    from titan_uniep.layout import slot_capacity

    w = make_world(2, 8, 3, [6, 6], seed=31)
    params = interpreter_params(debug_silent_rank=1, interpreter_max_spins=3)
    saved = torch.randn(2, slot_capacity(2, 6, 3, w["el"]), 2 * HIDDEN)  # any values: the dH tiles never run
    with pytest.raises(RuntimeError, match=r"backward failed on EP rank 0 .*\[x \| dOut\] rows of tile \d+"):
        simulated_moe_backward(w["grads"], w["xs"], w["scores"], w["indices"], w["w1s"], w["w2s"], w["w3s"],
                               schedule="fused", score_before_experts=False, params=params, saved_h13=saved)


@pytest.mark.parametrize("local_first", [False, True])
def test_backward_per_rank_launches_match_the_simulated_world(local_first):
    """The real-EP path (one rank per launch: L = 1, rank_base = r), driven rank
    by rank in producer-first order on shared simulated arenas, gives the same
    bits as the whole-world launch (also with ``local_first``)."""
    from types import SimpleNamespace

    from titan_uniep.kernels.scoreboard import Route
    from titan_uniep.runtime.backward import launch_backward
    from titan_uniep.runtime.launch import CallArrays, route

    world, cfg = 2, interpreter_params(local_first=local_first, local_first_experts=1.0)
    w = make_world(world, 8, 3, [11, 6], seed=51)
    bws = BackwardWorkspace.simulated(world, num_tokens=11, dim=DIM, hidden=HIDDEN, num_experts=8, top_k=3,
                                      dtype=torch.float32, params=cfg)
    saved = saved_h13_reference(w)
    whole = simulated_moe_backward(w["grads"], w["xs"], w["scores"], w["indices"], w["w1s"], w["w2s"], w["w3s"],
                                   schedule="sequential", score_before_experts=False, workspace=bws, saved_h13=saved)
    ws = bws.inner
    per_rank = ("h", "control", "counts_all", "num_tokens", "block_counts", "route_tables", "dest_rank",
                "dest_slot", "dest_tile", "tile_expert", "tile_start", "tile_end", "num_tiles", "tile_order")
    views = []
    for r in range(world):
        # Local rank r as a real-EP rank sees it (L = 1, rank_base = r) on the shared arenas.
        route_args = Route(*(v[r:r + 1] if isinstance(v, torch.Tensor) else v for v in ws.route_args))
        inner = SimpleNamespace(shape=ws.shape, element_offsets=ws.element_offsets, offsets=ws.offsets,
                                arena_ptrs=ws.arena_ptrs, anchors=ws.anchors, anchor_rank=ws.anchor_rank,
                                arena_args=ws.arena_args, route_args=route_args, device=ws.device, rank_base=r,
                                num_local_ranks=1, is_simulated=False,
                                **{name: getattr(ws, name)[r:r + 1] for name in per_rank})
        assert route_args.tables.data_ptr() == inner.route_tables.data_ptr()
        parts = bws.ds_parts[r:r + 1]
        views.append(SimpleNamespace(inner=inner, dim=DIM, dh1=bws.dh1[r:r + 1], dh3=bws.dh3[r:r + 1],
                                     g32=bws.g32[r:r + 1], slot_rows=bws.slot_rows[r:r + 1],
                                     ds_parts_for=lambda n, parts=parts: parts))
    for step in ("count", "publish", "collect", "place"):
        for r in range(world):
            indices = w["indices"][r].unsqueeze(0)
            route(views[r].inner, indices, indices.shape[1], cfg, steps=[step])
    # One rank's arrays as moe_backward builds them (L = 1).
    u = lambda t: t.contiguous().unsqueeze(0)  # noqa: E731
    arrays = [CallArrays(x=u(w["xs"][r]), grad_out=u(w["grads"][r]), scores=u(w["scores"][r].float()),
                         w1=u(w["w1s"][r]), w2=u(w["w2s"][r]), w3=u(w["w3s"][r]), h13=saved[r:r + 1])
              for r in range(world)]
    outs = [None] * world
    for phase in ("dispatch", "dh", "swiglu", "da"):
        for r in range(world):
            launch_backward(views[r], arrays[r], cfg, False, [phase])
    for r in range(world):  # the outputs are allocated per launch: weight grads and reduce in one launch
        outs[r] = launch_backward(views[r], arrays[r], cfg, False, ["wgrad", "reduce"], poison=True)
    bws.check_errors()
    for r in range(world):
        for name, a, b in zip(NAMES, (o[0] for o in outs[r]), whole[r]):
            assert torch.equal(a, b), f"rank {r} {name}"


def test_backward_workspace_grows_when_asked_and_keeps_working():
    ws = BackwardWorkspace.simulated(2, num_tokens=4, dim=DIM, hidden=HIDDEN, num_experts=8, top_k=2,
                                     dtype=torch.float32, params=interpreter_params())
    w = make_world(2, 8, 2, [9, 6], seed=61)
    saved = saved_h13_reference(w)  # sized for 9 tokens
    with pytest.raises(RuntimeError, match="ensure_capacity"):
        run_both(w, score_before=False, workspace=ws, saved=saved)
    assert ws.ensure_capacity(9) and not ws.ensure_capacity(5)
    seq, fus = run_both(w, score_before=False, workspace=ws, saved=saved)
    assert_correct(w, seq, fus, score_before=False)


@pytest.mark.parametrize("two_a", [True, False])
def test_weight_grad_kernel_sums_each_experts_rows_only(two_a):
    """``kernels.wgrad.wgrad_kernel`` alone, two local ranks: every
    output block equals A_e^T B_e over exactly the expert's rows (the rows
    around them hold NaN), experts without rows give zeros, M and N are not
    multiples of the tiles; tensor-descriptor and pointer loads give the same bits."""
    import triton

    from titan_uniep.kernels.route import ROUTE_TABLE_ROWS, ROW_EXPERT_BASE, ROW_ROWS
    from titan_uniep.kernels.wgrad import wgrad_kernel

    gen = torch.Generator().manual_seed(71)
    world, el, m, n, cap = 2, 3, 40, 24, 64
    rows = [[0, 13, 30], [21, 1, 0]]
    a1 = torch.full((world, cap, m), float("nan"), dtype=torch.float16)
    a2, b = a1.clone(), torch.full((world, cap, n), float("nan"), dtype=torch.float16)
    tables = torch.zeros(world, ROUTE_TABLE_ROWS, world * el, dtype=torch.int32)
    for r in range(world):
        base = 0
        for e, count in enumerate(rows[r]):
            tables[r, ROW_EXPERT_BASE, r * el + e], tables[r, ROW_ROWS, r * el + e] = base, count
            for t in (a1, a2):
                t[r, base:base + count] = torch.randn(count, m, generator=gen).half()
            b[r, base:base + count] = torch.randn(count, n, generator=gen).half()
            base += count
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8))
    results = {}
    for tma in (False, True):
        out1 = torch.full((world, el, m, n), float("nan"))
        out2 = out1.clone()
        bm, bn, bk = 16, 16, 8
        wgrad_kernel[(el * triton.cdiv(m, bm) * triton.cdiv(n, bn), world)](
            a1, a2, m, cap * m, b, n, cap * n, tables, out1, out2, 0, M=m, N=n, NUM_EXPERTS_LOCAL=el,
            NUM_EXPERTS=world * el, BM=bm, BN=bn, BK=bk, GROUP=2, TWO_A=two_a, TMA=tma, STAGES=1,
            PRECISION="ieee", INTERPRET=True,
        )
        results[tma] = (out1, out2)
    assert torch.equal(results[False][0], results[True][0])
    out1, out2 = results[False]
    for r in range(world):
        base = 0
        for e, count in enumerate(rows[r]):
            sl = slice(base, base + count)
            for got, a in [(out1, a1)] + ([(out2, a2)] if two_a else []):
                want = a[r, sl].double().T @ b[r, sl].double()
                assert torch.allclose(got[r, e].double(), want, rtol=1e-5, atol=1e-5), (r, e, count)
            base += count
    if not two_a:
        assert torch.isnan(out2).all()  # the second output is untouched without TWO_A


def test_weight_grad_backend_choice_and_errors():
    from titan_uniep.runtime.backward import wgrad_backend

    cpu = torch.device("cpu")
    assert wgrad_backend("auto", torch.bfloat16, cpu) == "triton"
    assert wgrad_backend("triton", torch.float32, cpu) == "triton"
    with pytest.raises(ValueError, match="grouped_mm.*needs bf16 data on a CUDA GPU.*1024 local experts"):
        wgrad_backend("grouped_mm", torch.bfloat16, cpu, 1024)
    with pytest.raises(ValueError, match="must be one of"):
        wgrad_backend("cublas", torch.bfloat16, cpu)
