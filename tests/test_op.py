"""The custom ops ``torch.ops.uniep.moe_experts`` / ``moe_experts_backward`` on CPU, end to end.

A one-rank gloo group in this process: the ops build a ``Workspace.simulated(1)``
and run the kernels in Triton's interpreter (fp32). Forward and backward
(through the registered autograd) against the reference schedule (torch
collectives on the same group, autograd through torch) and the float64
oracle; every ``torch.empty`` is NaN-filled while the ops run (the ops'
outputs, h1 | h3 and every workspace buffer), and a reused workspace is
poisoned again before each call, so an element the kernels do not write shows
up. Edge routings, the fake implementations, and ``torch.compile`` of a
TorchTitan MoE holding the op (the eager bits, forward and every gradient).
Larger simulated worlds are tested through ``runtime.simulated_*``
(test_kernels.py, test_backward.py).
"""

import copy
from interpreter_env import request_interpreter

request_interpreter()  # before anything defines a Triton kernel

import pytest
from torchtitan_release import torchtitan_0_2
import torch
import torch.distributed as dist
import triton.language as tl
from torch._subclasses.fake_tensor import FakeTensorMode
from triton.runtime.interpreter import InterpretedFunction

from titan_uniep import op
from titan_uniep.accuracy import rel_diff
from titan_uniep.oracle import float64_moe_oracle
from titan_uniep.schedules import Routing, get_schedule

if torch.cuda.is_available():
    pytest.skip("CPU interpreter tests (GPU runs use tests/gpu/)", allow_module_level=True)
if not isinstance(tl.standard.cdiv, InterpretedFunction):
    # Triton was imported before TRITON_INTERPRET was set (see test_kernels.py):
    # test_interpreter_subprocess.py runs this file anew.
    pytest.skip("Triton was imported before TRITON_INTERPRET=1; run in a subprocess", allow_module_level=True)

DIM, HIDDEN = 16, 16
NAMES = ("out", "dx", "dscores", "dw1", "dw2", "dw3")


@pytest.fixture(scope="module")
def group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


@pytest.fixture
def poisoned_memory():
    """Every uninitialised allocation NaN (torch's deterministic mode fills
    torch.empty), and fresh workspaces for each test."""
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    assert torch.isnan(torch.empty(8)).all()
    op._workspaces.clear()
    yield
    op._workspaces.clear()
    torch.use_deterministic_algorithms(was)


def make_layer(num_tokens, num_experts, top_k, *, seed, allowed=None, force=None):
    gen = torch.Generator().manual_seed(seed)
    allowed = torch.arange(num_experts) if allowed is None else torch.tensor(allowed)
    picked = allowed[torch.rand(num_tokens, len(allowed), generator=gen).argsort(1)][:, :top_k]
    if force is not None:  # every token picks ``force`` (as its last choice if not already)
        lacks = (picked != force).all(1)
        picked[lacks, -1] = force
    return dict(
        x=torch.randn(num_tokens, DIM, generator=gen),
        scores=torch.rand(num_tokens, top_k, generator=gen),
        indices=picked.contiguous(),
        w1=torch.randn(num_experts, HIDDEN, DIM, generator=gen) / DIM**0.5,
        w2=torch.randn(num_experts, DIM, HIDDEN, generator=gen) / HIDDEN**0.5,
        w3=torch.randn(num_experts, HIDDEN, DIM, generator=gen) / DIM**0.5,
        grad=torch.randn(num_tokens, DIM, generator=gen),
    )


def _leaves(w, dtype=None):
    return {k: w[k].to(dtype or w[k].dtype, copy=True).requires_grad_() for k in ("x", "scores", "w1", "w2", "w3")}


def _grads(out, leaves, grad):
    out.backward(grad.to(out.dtype))
    return [out.detach()] + [leaves[k].grad for k in ("x", "scores", "w1", "w2", "w3")]


def run_op(w, group, schedule, score_before):
    """The op's output and gradients (autograd through the registered formula),
    every workspace it uses poisoned first."""
    for ws in op._workspaces.values():
        ws.poison()
    leaves = _leaves(w)
    out, h13 = torch.ops.uniep.moe_experts(
        leaves["x"], leaves["scores"], w["indices"], leaves["w1"], leaves["w2"], leaves["w3"], group.group_name,
        schedule, score_before,
    )
    assert not h13.requires_grad
    return _grads(out, leaves, w["grad"])


def run_reference(w, group, score_before):
    leaves = _leaves(w)
    out = get_schedule("reference")(leaves["x"], Routing(leaves["scores"], w["indices"]), leaves["w1"], leaves["w2"],
                                    leaves["w3"], group=group, score_before_experts=score_before)
    return _grads(out, leaves, w["grad"])


def run_float64(w, score_before):
    leaves = _leaves(w, torch.float64)
    out = float64_moe_oracle(leaves["x"], leaves["scores"], w["indices"], leaves["w1"], leaves["w2"], leaves["w3"],
                             score_before_experts=score_before)
    got = _grads(out, leaves, w["grad"])
    return [g if g is not None else torch.zeros_like(leaf) for g, leaf in zip(got, [out, *leaves.values()])]


def assert_close_to_references(got, w, group, score_before, where):
    reference = run_reference(w, group, score_before)
    exact = run_float64(w, score_before)
    for name, g, ref, ex in zip(NAMES, got, reference, exact):
        ref = ref if ref is not None else torch.zeros_like(ex, dtype=g.dtype)
        assert g.dtype == ref.dtype and g.shape == ref.shape, f"{where} {name}: {g.dtype} {tuple(g.shape)}"
        assert not torch.isnan(g).any(), f"{where} {name}: NaN (an element the kernels never wrote)"
        torch.testing.assert_close(g, ref, rtol=1e-5, atol=1e-6, msg=lambda m: f"{where} {name} vs reference: {m}")
        torch.testing.assert_close(g.double(), ex, rtol=1e-4, atol=1e-5,
                                   msg=lambda m: f"{where} {name} vs float64: {m}")


@pytest.mark.parametrize("score_before", [False, True], ids=["score_after", "score_before"])
def test_op_forward_and_backward_match_the_reference_schedule_and_float64(group, poisoned_memory, score_before):
    w = make_layer(13, 4, 2, seed=3 + score_before)  # odd T
    got = {schedule: run_op(w, group, schedule, score_before) for schedule in ("sequential", "fused")}
    assert len(op._workspaces) == 2  # one forward and one backward workspace, reused by the second schedule
    for name, seq, fus in zip(NAMES, got["sequential"], got["fused"]):
        assert torch.equal(seq, fus), f"{name}: fused differs from sequential"
    assert_close_to_references(got["fused"], w, group, score_before, "fused")


def test_the_forward_and_backward_workspaces_share_their_scratch_in_any_order_of_calls(group, poisoned_memory):
    """One ``h`` serves both directions' workspaces, and the backward's ``g32``
    lies in the forward's returned rows (scratch within a call): two layers'
    forwards, then their backwards (as autograd runs a model), give each
    layer's bits of its own forward and backward run alone, and the forwards
    after them their first bits."""
    layers = [make_layer(11, 4, 2, seed=61), make_layer(11, 4, 2, seed=62)]
    alone = [run_op(w, group, "fused", False) for w in layers]
    fwd, bwd = (op._workspaces[k] for k in sorted(op._workspaces, key=lambda k: k[1]))
    assert bwd.inner.h.data_ptr() == fwd.h.data_ptr(), "the backward's h is not the forward's"
    start = fwd.arena.data_ptr() + fwd.offsets["returned"]
    end = start + fwd.shape.arena_sizes()["returned"]
    borrowed = [name for name in bwd.CALL_SCRATCH if start <= getattr(bwd, name).data_ptr() < end]
    assert borrowed == ["g32"], f"the backward's scratch in the forward's returned rows: {borrowed}"
    assert bwd.g32.data_ptr() + bwd.g32.nbytes <= end
    for i, (got, w) in enumerate(zip(alone, layers)):
        assert_close_to_references(got, w, group, False, f"layer {i} alone")
    for ws in op._workspaces.values():
        ws.poison()
    runs = []
    for w in layers:
        leaves = _leaves(w)
        out, _ = torch.ops.uniep.moe_experts(leaves["x"], leaves["scores"], w["indices"], leaves["w1"],
                                             leaves["w2"], leaves["w3"], group.group_name, "fused", False)
        runs.append((out, leaves, w))
    interleaved = [_grads(out, leaves, w["grad"]) for out, leaves, w in reversed(runs)][::-1]
    for i, (mine, ref) in enumerate(zip(interleaved, alone)):
        for name, a, b in zip(NAMES, mine, ref):
            assert torch.equal(a, b), f"layer {i} {name}: differs when the other layer's calls come between"
    # The next step's forwards, after the backwards wrote their scratch into the forward's returned rows.
    for i, (w, ref) in enumerate(zip(layers, alone)):
        leaves = _leaves(w)
        out, _ = torch.ops.uniep.moe_experts(leaves["x"], leaves["scores"], w["indices"], leaves["w1"],
                                             leaves["w2"], leaves["w3"], group.group_name, "fused", False)
        assert torch.equal(out, ref[0]), f"layer {i}: the forward after the backwards differs"


@pytest.mark.parametrize("case", ["all_tokens_to_one_expert", "expert_without_tokens", "one_token"])
def test_op_under_edge_routing_with_a_poisoned_workspace(group, poisoned_memory, case):
    if case == "all_tokens_to_one_expert":  # K = 1: two tiles of expert 2, three experts with no rows
        w, schedule = make_layer(21, 4, 1, seed=11, force=2), "fused"
    elif case == "expert_without_tokens":  # expert 2 never picked: zero weight gradients
        w, schedule = make_layer(9, 4, 2, seed=12, allowed=[0, 1, 3]), "sequential"
    else:
        w, schedule = make_layer(1, 4, 2, seed=13), "fused"
    # A workspace built for more tokens than this call (as training's reserve_tokens does).
    op.reserve_tokens(group, 24)
    try:
        got = run_op(w, group, schedule, False)
    finally:
        op._reserved_tokens.clear()
    assert_close_to_references(got, w, group, False, f"{case} ({schedule})")
    if case == "expert_without_tokens":
        assert all(torch.equal(g[2], torch.zeros_like(g[2])) for g in got[3:]), "expert 2 has a nonzero gradient"


def run_op_16_bit(w, group, schedule, score_before, *, masters: bool):
    """The op on fp16 tokens and fp16 casts of fp32 weights (fp16: the
    interpreter's 16-bit dtype). ``masters``: the fp32 weights passed as the
    casts' masters receive the weight gradients; otherwise the casts do."""
    for ws in op._workspaces.values():
        ws.poison()
    x, scores = w["x"].half().requires_grad_(), w["scores"].clone().requires_grad_()
    fp32 = [w[k].clone().requires_grad_() for k in ("w1", "w2", "w3")]
    casts = [m.detach().half().requires_grad_(not masters) for m in fp32]
    out, _ = torch.ops.uniep.moe_experts(x, scores, w["indices"], *casts, group.group_name, schedule, score_before,
                                         None, *(fp32 if masters else (None, None, None)))
    out.backward(w["grad"].half())
    owners = fp32 if masters else casts
    assert all(m.grad is None for m in (casts if masters else fp32)), "a gradient reached the wrong weights"
    return [out.detach(), x.grad, scores.grad, *(t.grad for t in owners)]


@pytest.mark.parametrize("score_before", [False, True], ids=["score_after", "score_before"])
def test_master_weights_get_the_gemms_fp32_sums_as_gradients(group, poisoned_memory, score_before):
    """fp32 master weights next to their 16-bit casts: every schedule gives the
    same bits; the output, dx and dscores are those of the op on the casts
    alone; each weight gradient is fp32, is the 16-bit gradient before its
    rounding (rounded, the same bits), and is not rounded to 16 bits; every
    tensor is within 1e-2 of its largest value from float64 (checked
    against float64, not against the op without masters alone, so that a
    wrong output of both fails)."""
    w = make_layer(13, 4, 2, seed=51 + score_before, allowed=[0, 1, 3])  # odd T, expert 2 without tokens
    got = {schedule: run_op_16_bit(w, group, schedule, score_before, masters=True)
           for schedule in ("sequential", "fused")}
    for name, seq, fus in zip(NAMES, got["sequential"], got["fused"]):
        assert not torch.isnan(seq).any(), f"{name}: NaN (an element the kernels never wrote)"
        assert torch.equal(seq, fus), f"{name}: fused differs from sequential"
    plain = run_op_16_bit(w, group, "fused", score_before, masters=False)
    for name, mine, ref in zip(NAMES[:3], got["fused"][:3], plain[:3]):
        assert mine.dtype == ref.dtype and torch.equal(mine, ref), f"{name} differs from the op without masters"
    exact = run_float64({**w, "x": w["x"].half().double(), **{k: w[k].half().double() for k in ("w1", "w2", "w3")},
                         "grad": w["grad"].half().double()}, score_before)
    for name, mine, ex in zip(NAMES, got["fused"], exact):
        err = rel_diff(mine, ex)
        assert err < 1e-2, f"{name}: {err:.1e} from float64 (16-bit intermediates)"
    for name, mine, ref in zip(NAMES[3:], got["fused"][3:], plain[3:]):
        assert mine.dtype == torch.float32 and ref.dtype == torch.float16, name
        assert torch.equal(mine.half(), ref), f"{name}: the fp32 gradient rounded is not the 16-bit one"
        assert torch.equal(mine[2], torch.zeros_like(mine[2])), f"{name}: expert 2 has no tokens"
        used = mine[[0, 1, 3]]
        assert (used != used.half().float()).float().mean() > 0.5, f"{name}: rounded to 16 bits"


def test_master_weights_all_three_in_fp32_and_in_their_casts_shape(group, poisoned_memory):
    w = make_layer(5, 4, 2, seed=53)
    args = (w["x"].half(), w["scores"], w["indices"], *(w[k].half() for k in ("w1", "w2", "w3")), group.group_name,
            "fused", False, None)
    with pytest.raises(ValueError, match="all of w1, w2, w3 or for none"):
        torch.ops.uniep.moe_experts(*args, w["w1"], None, None)
    with pytest.raises(ValueError, match="master_w2 must be the fp32 weight"):
        torch.ops.uniep.moe_experts(*args, w["w1"], w["w2"].double(), w["w3"])
    with pytest.raises(ValueError, match="master_w3 must be the fp32 weight"):
        torch.ops.uniep.moe_experts(*args, w["w1"], w["w2"], w["w3"][:2])
    # The kernel schedules refuse casts that autograd would differentiate (their gradient would be dropped).
    masters = tuple(w[k].clone().requires_grad_() for k in ("w1", "w2", "w3"))
    with pytest.raises(ValueError, match="must be detached casts"):
        get_schedule("fused")(w["x"].half(), Routing(w["scores"], w["indices"]), *(m.half() for m in masters),
                              group=group, score_before_experts=False, master_weights=masters)
    assert not op._workspaces


def test_fake_implementations_give_the_real_shapes_without_touching_a_workspace(group, poisoned_memory):
    w = make_layer(7, 4, 2, seed=21)
    args = (w["x"], w["scores"], w["indices"], w["w1"], w["w2"], w["w3"])
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(t) for t in (*args, w["grad"])]
        fake_out = torch.ops.uniep.moe_experts(*fake[:6], group.group_name, "fused", False)
        fake_grads = torch.ops.uniep.moe_experts_backward(fake[6], *fake[:6], fake_out[1], group.group_name,
                                                          "fused", False)
    assert not op._workspaces, "a fake implementation built a workspace"
    out = torch.ops.uniep.moe_experts(*args, group.group_name, "fused", False)
    grads = torch.ops.uniep.moe_experts_backward(w["grad"], *args, out[1], group.group_name, "fused", False)
    for name, f, r in zip(("out", "h13", "dx", "dscores", "dw1", "dw2", "dw3"), (*fake_out, *fake_grads),
                          (*out, *grads)):
        assert (f.shape, f.stride(), f.dtype) == (r.shape, r.stride(), r.dtype), f"{name}: fake {f.shape} " \
            f"{f.stride()} {f.dtype}, real {r.shape} {r.stride()} {r.dtype}"


def test_fake_implementations_of_16_bit_casts_with_fp32_masters(group, poisoned_memory):
    w = make_layer(7, 4, 2, seed=22)
    masters = tuple(w[k] for k in ("w1", "w2", "w3"))
    args = (w["x"].half(), w["scores"], w["indices"], *(m.half() for m in masters))
    grad = w["grad"].half()
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(t) for t in (*args, grad, *masters)]
        fake_out = torch.ops.uniep.moe_experts(*fake[:6], group.group_name, "fused", False, None, *fake[7:])
        fake_grads = torch.ops.uniep.moe_experts_backward(fake[6], *fake[:6], fake_out[1], group.group_name,
                                                          "fused", False, torch.float32)
    assert not op._workspaces, "a fake implementation built a workspace"
    out = torch.ops.uniep.moe_experts(*args, group.group_name, "fused", False, None, *masters)
    grads = torch.ops.uniep.moe_experts_backward(grad, *args, out[1], group.group_name, "fused", False,
                                                 torch.float32)
    assert [g.dtype for g in grads] == [torch.float16, torch.float32] + [torch.float32] * 3
    for name, f, r in zip(("out", "h13", "dx", "dscores", "dw1", "dw2", "dw3"), (*fake_out, *fake_grads),
                          (*out, *grads)):
        assert (f.shape, f.stride(), f.dtype) == (r.shape, r.stride(), r.dtype), f"{name}: fake {f.shape} " \
            f"{f.stride()} {f.dtype}, real {r.shape} {r.stride()} {r.dtype}"


def test_interpreted_op_refuses_bf16_naming_the_fix(group, poisoned_memory):
    w = make_layer(5, 4, 2, seed=41)
    bf16 = [w[k].bfloat16() for k in ("x", "scores", "indices", "w1", "w2", "w3")]
    bf16[1], bf16[2] = w["scores"], w["indices"]
    with pytest.raises(ValueError, match=r"bf16 .*mixed_precision_param = \"float32\""):
        torch.ops.uniep.moe_experts(*bf16, group.group_name, "fused", False)
    assert not op._workspaces


def eager_and_compiled_moe(group, *, seed, num_shared_experts, tokens, autocast=None):
    """A TorchTitan 0.2.2 MoE (router, shared experts, load-balancing buffer,
    for-loop experts) swapped to UniEP by the 0.2.2 edge, schedule "fused" on
    the one-rank group, trained one step eager and compiled in one graph
    (``aot_eager``: AOT autograd traces the backward through the backward
    op's fake), each from the same weights and on the same batch, under
    ``autocast`` (a dtype) or none. Returns both runs' output, input gradient,
    ``tokens_per_expert`` and parameter gradients."""
    from torchtitan.models.moe.moe import MoE, MoEArgs

    from titan_uniep.config import UniEP
    from titan_uniep.torchtitan.v0_2.cpu import apply_cpu_tensor_shims
    from titan_uniep.torchtitan.v0_2.parallelize import _swap_to_uniep

    apply_cpu_tensor_shims()  # int histc of TorchTitan's router on CPU
    torch.manual_seed(seed)
    args = MoEArgs(num_experts=4, num_shared_experts=num_shared_experts, top_k=2, score_func="softmax",
                   route_norm=True, score_before_experts=False, use_grouped_mm=False)
    base = MoE(args, dim=DIM, hidden_dim=HIDDEN)
    with torch.no_grad():
        base.init_weights(init_std=0.1, buffer_device=torch.device("cpu"))
    x = torch.randn(1, tokens, DIM)
    grad = torch.randn(1, tokens, DIM)

    def run(compiled: bool):
        moe = copy.deepcopy(base)
        _swap_to_uniep(torch.nn.ModuleDict({"moe": moe}), UniEP(enable=True, schedule="fused"))
        moe.experts.ep_group = group
        model = torch.compile(moe, backend="aot_eager", fullgraph=True) if compiled else moe
        for ws in op._workspaces.values():
            ws.poison()
        xx = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
            out = model(xx)
        out.float().backward(grad)
        return {"out": out.detach(), "x.grad": xx.grad, "tokens_per_expert": moe.tokens_per_expert.clone(),
                **{f"{n}.grad": p.grad for n, p in moe.named_parameters()}}

    return run(False), run(True)


def assert_same_bits(eager: dict, compiled: dict) -> None:
    assert eager.keys() == compiled.keys()
    for name in eager:
        assert eager[name] is not None and not torch.isnan(eager[name]).any(), name
        assert torch.equal(eager[name], compiled[name]), f"{name}: compiled differs from eager"


@torchtitan_0_2  # TorchTitan 0.2.2's MoE and the 0.2.2 edge's swap
def test_compiled_moe_holding_the_op_gives_the_eager_bits(group, poisoned_memory):
    assert_same_bits(*eager_and_compiled_moe(group, seed=31, num_shared_experts=1, tokens=13))


@torchtitan_0_2  # TorchTitan 0.2.2's MoE and the 0.2.2 edge's swap
def test_fp32_parameters_under_autocast_get_fp32_gradients_from_the_kernels_eager_and_compiled(group,
                                                                                             poisoned_memory):
    """TorchTitan's NGPU = 1 case on the interpreter: fp32 parameters, autocast
    to a 16-bit dtype (fp16 here: the interpreter's bf16 dot products are
    wrong), for-loop experts, which compute in autocast's dtype. The layer
    passes fp16 casts and the fp32 weights as their masters: the experts'
    gradients are fp32 and not rounded to 16 bits; compiled gives the eager bits."""
    eager, compiled = eager_and_compiled_moe(group, seed=47, num_shared_experts=0, tokens=11,
                                             autocast=torch.float16)
    assert {key[-2] for key in op._workspaces} == {torch.float16}, "the kernels did not run in fp16"
    for name in ("w1", "w2", "w3"):
        g = eager[f"experts.{name}.grad"]
        assert g.dtype == torch.float32 and (g != g.half().float()).float().mean() > 0.5, f"{name}: rounded"
    assert_same_bits(eager, compiled)


@torchtitan_0_2  # TorchTitan 0.2.2's MoE and the 0.2.2 edge's swap
def test_float32_compute_of_bf16_parameters_runs_the_kernels_in_fp32_and_returns_bf16(group, poisoned_memory):
    """``[uniep] compute_dtype = "float32"`` on bf16 parameters (FSDP mixed
    precision): the op gets fp32 tokens and weights (an fp32 workspace), the
    layer returns bf16 and every gradient is bf16, all within bf16 rounding
    of the float64 oracle."""
    from torchtitan.models.moe.moe import MoE, MoEArgs

    from titan_uniep.config import UniEP
    from titan_uniep.torchtitan.v0_2.cpu import apply_cpu_tensor_shims
    from titan_uniep.torchtitan.v0_2.parallelize import _swap_to_uniep

    apply_cpu_tensor_shims()
    torch.manual_seed(43)
    args = MoEArgs(num_experts=4, num_shared_experts=0, top_k=2, score_func="softmax", route_norm=True,
                   score_before_experts=False, use_grouped_mm=True)
    moe = MoE(args, dim=DIM, hidden_dim=HIDDEN)
    with torch.no_grad():
        moe.init_weights(init_std=0.1, buffer_device=torch.device("cpu"))
    moe = moe.bfloat16()
    moe.expert_bias.data = moe.expert_bias.data.float()
    _swap_to_uniep(torch.nn.ModuleDict({"moe": moe}), UniEP(enable=True, schedule="fused", compute_dtype="float32"))
    moe.experts.ep_group = group
    x = torch.randn(11, DIM).bfloat16().requires_grad_()
    scores, indices, _ = moe.router(x.detach(), moe.expert_bias)
    out = moe.experts(x, Routing(scores, indices))
    grad = torch.randn_like(out)
    out.backward(grad)
    assert {key[-2] for key in op._workspaces} == {torch.float32}, "the kernels did not run in fp32"
    assert out.dtype == torch.bfloat16 and x.grad.dtype == torch.bfloat16
    weights = [getattr(moe.experts, n) for n in ("w1", "w2", "w3")]
    assert all(w.grad is not None and w.grad.dtype == torch.bfloat16 for w in weights)
    leaves = {"x": x.detach().double().requires_grad_(), **{n: w.detach().double().requires_grad_()
                                                            for n, w in zip(("w1", "w2", "w3"), weights)}}
    ref = float64_moe_oracle(leaves["x"], scores.detach().double(), indices, leaves["w1"], leaves["w2"], leaves["w3"],
                             score_before_experts=False)
    ref.backward(grad.double())
    for name, got, want in [("out", out.detach(), ref.detach()), ("dx", x.grad, leaves["x"].grad),
                            *[(f"d{n}", w.grad, leaves[n].grad) for n, w in zip(("w1", "w2", "w3"), weights)]]:
        assert not torch.isnan(got).any(), name
        # Relative to each tensor's largest value: the output's is 0.012, so an absolute
        # tolerance of 2e-2 would pass an all-zero output.
        err = rel_diff(got, want)
        assert err < 1e-2, f"{name}: {err:.1e} of its largest value from float64 (bf16 roundings: 2e-3 to 5e-3)"
