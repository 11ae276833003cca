"""UniEP backward kernels in bf16 on ONE GPU, simulated world of W ranks.

Run on the GPU machine: ``python -m pytest tests/gpu/test_gpu_backward.py``.
"""

import pytest
import torch

from titan_uniep.oracle import float64_moe_oracle
from titan_uniep.params import default_params
from titan_uniep.runtime import BackwardWorkspace, Workspace, simulated_moe_backward, simulated_moe_forward

import worlds

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

DIM, HIDDEN = 256, 384
NAMES = ("dx", "dscores", "dw1", "dw2", "dw3")


def make_world(world, num_experts, top_k, num_tokens, *, seed, force=None, dtype=torch.bfloat16):
    """Random inputs of a simulated world on the GPU (``worlds.make_world`` at this file's dims)."""
    return worlds.make_world(world, num_experts, top_k, num_tokens, seed=seed, dim=DIM, hidden=HIDDEN, force=force,
                             device="cuda", dtype=dtype)


def float64_grads(w, score_before):
    leaves = [t.double().requires_grad_() for t in (w["w1"], w["w2"], w["w3"])]
    per_rank = []
    for r in range(len(w["xs"])):
        x = w["xs"][r].double().requires_grad_()
        s = w["scores"][r].double().requires_grad_()
        out = float64_moe_oracle(x, s, w["indices"][r], *leaves, score_before_experts=score_before)
        if not out.requires_grad:
            per_rank.append([torch.zeros_like(x), torch.zeros_like(s)])
            continue
        dx, ds = torch.autograd.grad(out, (x, s), w["grads"][r].double(), retain_graph=True)
        per_rank.append([dx, ds])
        (out * w["grads"][r].double()).sum().backward()
    el = w["el"]
    for r, item in enumerate(per_rank):
        item += [leaf.grad[r * el:(r + 1) * el] for leaf in leaves]
    return per_rank


def check(w, *, score_before, wgrad="auto", overrides=None):
    """Fused == sequential == run again bitwise, no NaN, close to float64;
    returns the fused gradients. The backward runs the shape's default
    ``LayerParams`` with ``wgrad_backend=wgrad`` and ``overrides``, on the
    h1 | h3 the fused forward saved (as the custom op runs it)."""
    world = len(w["xs"])
    params = default_params(world, hidden=HIDDEN).replace(wgrad_backend=wgrad, **(overrides or {}))
    return _check(w, world, score_before, params)


def _check(w, world, score_before, params):
    num_tokens, top_k = max(max(len(x) for x in w["xs"]), 1), w["indices"][0].shape[1]
    ws = BackwardWorkspace.simulated(world, num_tokens=num_tokens, dim=DIM, hidden=HIDDEN,
                                     num_experts=w["el"] * world, top_k=top_k, dtype=torch.bfloat16, device="cuda",
                                     params=params)
    fwd = Workspace.simulated(world, num_tokens=num_tokens, dim=DIM, hidden=HIDDEN,
                              num_experts=w["el"] * world, top_k=top_k, dtype=torch.bfloat16, device="cuda")
    h13 = torch.full((world, fwd.shape.slot_capacity, 2 * HIDDEN), float("nan"), device="cuda", dtype=torch.bfloat16)
    simulated_moe_forward(w["xs"], w["scores"], w["indices"], w["w1s"], w["w2s"], w["w3s"], schedule="fused",
                          score_before_experts=score_before, workspace=fwd, saved_h13=h13)
    outs = {}
    for schedule in ("sequential", "fused", "fused_again"):
        ws.poison()
        outs[schedule] = simulated_moe_backward(
            w["grads"], w["xs"], w["scores"], w["indices"], w["w1s"], w["w2s"], w["w3s"],
            schedule=schedule.replace("_again", ""), score_before_experts=score_before, workspace=ws,
            params=params, poison_outputs=True, saved_h13=h13,
        )
    exact = float64_grads(w, score_before)
    for r in range(world):
        for i, name in enumerate(NAMES):
            seq, fus, again, ref = (outs["sequential"][r][i], outs["fused"][r][i], outs["fused_again"][r][i],
                                    exact[r][i])
            assert torch.equal(seq, fus), f"rank {r} {name}: fused differs from sequential"
            assert torch.equal(fus, again), f"rank {r} {name}: differs run to run"
            assert not torch.isnan(fus).any(), f"rank {r} {name}: NaN"
            if ref.numel():
                err = (fus.double() - ref).abs().max().item() / max(ref.abs().max().item(), 1e-6)
                assert err < 3e-2, f"rank {r} {name}: relative max error {err:.3g} vs float64"
    return outs["fused"]


TOKENS = {2: [300, 257], 4: [300, 170, 0, 257], 8: [300, 170, 0, 257, 64, 1, 129, 200]}


@pytest.mark.parametrize("world,score_before", [(2, False), (2, True), (4, True), (8, False)])
def test_gpu_backward_bitwise_and_close_to_float64(world, score_before):
    """The op's path: dH tiles compute G only (two programs per SM), the
    SwiGLU backward runs as its own pass. W = 4 and 8: EP on one 8-GPU node,
    simulated on one GPU (ranks with 0 and 1 tokens)."""
    check(make_world(world, 16, 4, TOKENS[world], seed=world), score_before=score_before)


def test_gpu_backward_skewed_routing():
    check(make_world(2, 8, 3, [400, 333], seed=7, force=5), score_before=False)


@pytest.mark.parametrize("wgrad", ["grouped_mm", "triton"])
@pytest.mark.parametrize("score_before", [False, True])
def test_gpu_backward_weight_grad_backends(wgrad, score_before):
    """Both weight-gradient backends (torch._grouped_mm; the Triton kernel with
    tensor descriptors): few tokens, so several experts get no rows (zeros),
    and slots past the used ones hold NaN (the workspace is poisoned)."""
    if wgrad == "grouped_mm" and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("torch._grouped_mm runs on sm_90+")
    check(make_world(2, 16, 2, [5, 3], seed=11), score_before=score_before, wgrad=wgrad)
    check(make_world(2, 8, 3, [400, 333], seed=12, force=5), score_before=score_before, wgrad=wgrad)


@pytest.mark.parametrize("world", [2, 4])
def test_gpu_tma_operands_change_no_bits(world, monkeypatch):
    """fc2_combine's fc2 (``LayerParams.fc2_tma``) and da_combine's dA
    (``LayerParams.da_tma``) read their dense operands through tensor
    descriptors: the same bits as pointer loads, in both schedules, with
    several simulated ranks per launch (row offsets per local rank)."""
    from titan_uniep.runtime import backward, launch

    made, original = [], launch.ensure_tma_allocator

    def spy():  # the host side sets the allocator exactly when it launches with descriptors
        made.append(1)
        original()

    monkeypatch.setattr(launch, "ensure_tma_allocator", spy)  # tma_rows (fc2, dA)
    monkeypatch.setattr(backward, "ensure_tma_allocator", spy)  # the Triton weight gradients
    w = make_world(world, 16, 4, TOKENS[world], seed=30 + world)
    num_tokens = max(len(x) for x in w["xs"])
    fwd = Workspace.simulated(world, num_tokens=num_tokens, dim=DIM, hidden=HIDDEN, num_experts=16, top_k=4,
                              dtype=torch.bfloat16, device="cuda")
    base = default_params(world, hidden=HIDDEN)
    h13 = torch.full((world, fwd.shape.slot_capacity, 2 * HIDDEN), float("nan"), device="cuda", dtype=torch.bfloat16)
    outs = {}
    for tma in (False, True):
        for schedule in ("sequential", "fused"):
            fwd.poison()
            outs[tma, schedule] = [o.clone() for o in simulated_moe_forward(
                w["xs"], w["scores"], w["indices"], w["w1s"], w["w2s"], w["w3s"], schedule=schedule,
                score_before_experts=False, workspace=fwd, params=base.replace(fc2_tma=tma), saved_h13=h13)]
    assert made, "the forward did not take the tensor-descriptor path"
    for r in range(world):
        for key in outs:
            assert torch.equal(outs[key][r], outs[False, "sequential"][r]), f"forward rank {r} {key}"
    bws = BackwardWorkspace.simulated(world, num_tokens=num_tokens, dim=DIM, hidden=HIDDEN, num_experts=16,
                                      top_k=4, dtype=torch.bfloat16, device="cuda")
    made.clear()
    grads = {}
    assert HIDDEN % base.da_block_k == 0  # (runtime.backward reads dA's operands by descriptors only then)
    for tma in (False, True):
        for schedule in ("sequential", "fused"):
            bws.poison()
            grads[tma, schedule] = [[g.clone() for g in rank] for rank in simulated_moe_backward(
                w["grads"], w["xs"], w["scores"], w["indices"], w["w1s"], w["w2s"], w["w3s"], schedule=schedule,
                score_before_experts=False, workspace=bws, poison_outputs=True, params=base.replace(da_tma=tma),
                saved_h13=h13)]
    assert made, "the backward did not take the tensor-descriptor path"
    for r in range(world):
        for key in grads:
            for name, a, b in zip(NAMES, grads[key][r], grads[False, "sequential"][r]):
                assert torch.equal(a, b), f"backward rank {r} {name} {key}"
                assert not torch.isnan(a).any(), f"backward rank {r} {name} {key}: NaN"


@pytest.mark.parametrize("option", ["dh_copies_rows"])
@pytest.mark.parametrize("world,score_before", [(2, False), (2, True), (8, False)])
def test_gpu_backward_options_change_no_bits(world, score_before, option):
    """``LayerParams.dh_copies_rows``: dispatch_dh's dH tasks (two per SM,
    under a register cap) write the weight gradients' dense slot rows instead
    of the gather launch. Every gradient equals the other setting's bit for
    bit (and is bitwise across schedules, close to float64)."""
    w = make_world(world, 16, 4, TOKENS[world], seed=40 + world)
    off = check(w, score_before=score_before, overrides={option: False})
    on = check(w, score_before=score_before, overrides={option: True})
    for r in range(world):
        for name, a, b in zip(NAMES, off[r], on[r]):
            assert torch.equal(a, b), f"rank {r} {name}: {option} changed a value"


@pytest.mark.parametrize("world", [2, 4])
def test_gpu_local_first_changes_no_bits(world):
    """``LayerParams.local_first`` (dispatch_fc1 and dispatch_dh: rows that
    stay on a rank dispatched first by every program, tiles holding only those
    first, 16 programs sending the rest while the others compute): forward
    output and every gradient equal the default schedule's bit for bit, both
    schedules, with all simulated ranks' programs co-resident in one grid."""
    w = make_world(world, 16, 4, TOKENS[world], seed=50 + world)
    num_tokens = max(len(x) for x in w["xs"])
    fwd = Workspace.simulated(world, num_tokens=num_tokens, dim=DIM, hidden=HIDDEN, num_experts=16, top_k=4,
                              dtype=torch.bfloat16, device="cuda")
    bws = BackwardWorkspace.simulated(world, num_tokens=num_tokens, dim=DIM, hidden=HIDDEN, num_experts=16,
                                      top_k=4, dtype=torch.bfloat16, device="cuda")
    h13 = torch.full((world, fwd.shape.slot_capacity, 2 * HIDDEN), float("nan"), device="cuda", dtype=torch.bfloat16)
    outs, grads = {}, {}
    for flag in (False, True):
        cfg = default_params(world, hidden=HIDDEN).replace(dispatch_programs=16, local_first=flag)
        for schedule in ("sequential", "fused"):
            fwd.poison()
            outs[flag, schedule] = [o.clone() for o in simulated_moe_forward(
                w["xs"], w["scores"], w["indices"], w["w1s"], w["w2s"], w["w3s"], schedule=schedule,
                score_before_experts=False, workspace=fwd, params=cfg, saved_h13=h13)]
            bws.poison()
            grads[flag, schedule] = [[g.clone() for g in rank] for rank in simulated_moe_backward(
                w["grads"], w["xs"], w["scores"], w["indices"], w["w1s"], w["w2s"], w["w3s"], schedule=schedule,
                score_before_experts=False, workspace=bws, poison_outputs=True, saved_h13=h13, params=cfg)]
    for r in range(world):
        for key in outs:
            assert torch.equal(outs[key][r], outs[False, "sequential"][r]), f"forward rank {r} {key}"
            for name, a, b in zip(NAMES, grads[key][r], grads[False, "sequential"][r]):
                assert torch.equal(a, b), f"backward rank {r} {name} {key}"
                assert not torch.isnan(a).any(), f"backward rank {r} {name} {key}: NaN"
