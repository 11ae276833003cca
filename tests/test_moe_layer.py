"""UniEP's MoE layer (reference schedule) against TorchTitan's MoE + ExpertParallel.

Two gloo ranks on CPU; both layers get the same weights and inputs; both are
checked against a float64 computation of the same routing, and against each
other (bf16 tolerance in bf16, 1e-6 in float32). Forward and every gradient.
"""

from __future__ import annotations

import pytest
from torchtitan_release import requires_torchtitan

requires_torchtitan("0.2.2")  # the TorchTitan 0.2.2 edge

import copy
import json
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module
from torchtitan.distributed.expert_parallel import ExpertParallel
from torchtitan.models.moe.moe import MoE, MoEArgs

from distributed import run_distributed
from titan_uniep.torchtitan.v0_2.cpu import apply_cpu_tensor_shims
from titan_uniep.torchtitan.v0_2.parallelize import UniEPExpertParallel, _swap_to_uniep
from titan_uniep.config import UniEP

DIM, HIDDEN, EXPERTS = 64, 32, 8


def _rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.double() - ref).norm() / ref.norm().clamp_min(1e-30))


def _moe_float64(moe: MoE, x: torch.Tensor, scores: torch.Tensor, indices: torch.Tensor, weights) -> torch.Tensor:
    """out = shared(x) + sum_k combine(score, FFN_e(x)) in float64, same routing."""
    w1, w2, w3 = (w.double() for w in weights)
    xd = x.double()
    out = torch.zeros_like(xd)
    for k in range(indices.shape[1]):
        e = indices[:, k]
        s = scores[:, k : k + 1].double()
        inp = xd * s if moe.score_before_experts else xd
        h = torch.nn.functional.silu(torch.einsum("td,thd->th", inp, w1[e])) * torch.einsum("td,thd->th", inp, w3[e])
        y = torch.einsum("th,tdh->td", h, w2[e])
        out += y if moe.score_before_experts else s * y
    if moe.shared_experts is not None:
        se = moe.shared_experts
        h = torch.nn.functional.silu(xd @ se.w1.weight.double().T) * (xd @ se.w3.weight.double().T)
        out += h @ se.w2.weight.double().T
    return out


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _layer_check(rank: int, world: int, dtype: torch.dtype, score_before: bool, routing: str, tokens: int) -> None:
    apply_cpu_tensor_shims()
    torch.manual_seed(1234)  # same weights on every rank
    args = MoEArgs(
        num_experts=EXPERTS,
        num_shared_experts=1,
        top_k=3,
        score_func="sigmoid" if score_before else "softmax",
        route_norm=not score_before,
        score_before_experts=score_before,
        # TorchTitan's grouped-mm path computes in bf16 whatever the dtype;
        # its for-loop path computes in the input dtype (the 1e-6 fp32 check).
        use_grouped_mm=dtype == torch.bfloat16,
        load_balance_coeff=1e-3,
    )
    base = MoE(args, dim=DIM, hidden_dim=HIDDEN)
    with torch.no_grad():
        base.init_weights(init_std=0.1, buffer_device=torch.device("cpu"))
        if routing == "skewed":
            # Every token prefers experts 0..2 (rank 0's): rank 1 receives nothing.
            base.expert_bias.copy_(torch.tensor([9.0, 8.0, 7.0] + [0.0] * (EXPERTS - 3)))
    base = base.to(dtype)
    base.expert_bias.data = base.expert_bias.data.float()
    base.tokens_per_expert.data = base.tokens_per_expert.data.float()
    uni = copy.deepcopy(base)

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    parallelize_module(base.experts, mesh, ExpertParallel())
    _swap_to_uniep(_Model(uni), UniEP(enable=True))
    parallelize_module(uni.experts, mesh, UniEPExpertParallel())

    torch.manual_seed(100 + rank)  # different tokens on every rank
    num_tokens = tokens + rank  # odd and uneven token counts
    x = torch.randn(1, num_tokens, DIM, dtype=dtype)
    grad_out = torch.randn(1, num_tokens, DIM, dtype=dtype)
    xb = x.clone().requires_grad_(True)
    xu = x.clone().requires_grad_(True)
    out_b = base(xb)
    out_u = uni(xu)
    out_b.backward(grad_out)
    out_u.backward(grad_out)

    # float64 reference of the same routing (the router itself is shared code).
    with torch.no_grad():
        scores, indices, _ = uni.router(x.view(-1, DIM), uni.expert_bias)
        weights = [_full(p) for p in (uni.experts.w1, uni.experts.w2, uni.experts.w3)]
        ref = _moe_float64(uni, x.view(-1, DIM), scores, indices, weights).view_as(x)
    if routing == "skewed":
        assert int((indices >= EXPERTS // world).sum()) == 0, "skewed routing must leave rank 1 empty"

    bound = 2e-2 if dtype == torch.bfloat16 else 1e-5
    err_u, err_b = _rel_err(out_u.detach(), ref), _rel_err(out_b.detach(), ref)
    assert err_u < bound, f"rank {rank}: uniep vs float64 rel err {err_u:.3e}"
    assert err_b < bound, f"rank {rank}: torchtitan vs float64 rel err {err_b:.3e}"

    pairs = {
        "out": (out_u.detach(), out_b.detach()),
        "x.grad": (xu.grad, xb.grad),
        "router.gate.weight.grad": (uni.router.gate.weight.grad, base.router.gate.weight.grad),
        "shared_experts.w1.grad": (uni.shared_experts.w1.weight.grad, base.shared_experts.w1.weight.grad),
    }
    for name in ("w1", "w2", "w3"):
        pairs[f"experts.{name}.grad"] = (
            getattr(uni.experts, name).grad.to_local(),
            getattr(base.experts, name).grad.to_local(),
        )
    tol = 1e-6 if dtype == torch.float32 else 3e-2
    for name, (u, b) in pairs.items():
        assert u is not None and b is not None, f"rank {rank}: {name} missing"
        assert torch.isfinite(u).all(), f"rank {rank}: {name} not finite"
        err = _rel_err(u, b.double())
        assert err < tol, f"rank {rank}: {name} uniep vs torchtitan rel err {err:.3e} (tol {tol})"
    # The load-balancing buffer is updated identically.
    assert torch.equal(uni.tokens_per_expert, base.tokens_per_expert)


class _Model(torch.nn.Module):
    def __init__(self, moe: MoE):
        super().__init__()
        self.moe = moe


CASES = [
    (dtype, score_before, routing)
    for dtype in ("float32", "bfloat16")
    for score_before in (False, True)
    for routing in ("balanced", "skewed")
]


def _all_cases(rank: int, world: int, result_dir: str) -> None:
    # One process group for every case: spawning and importing TorchTitan
    # dominates a case's cost. Checks are local (after the collectives), so a
    # failing case does not desynchronise the ranks.
    results = {}
    for dtype, score_before, routing in CASES:
        try:
            _layer_check(rank, world, getattr(torch, dtype), score_before, routing, 37)
            results[f"{dtype}-{score_before}-{routing}"] = None
        except AssertionError as e:
            results[f"{dtype}-{score_before}-{routing}"] = str(e)
    with open(os.path.join(result_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)


@pytest.fixture(scope="module")
def layer_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("layer")
    run_distributed(_all_cases, 2, str(out))
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("dtype,score_before,routing", CASES, ids=[f"{d}-{'before' if b else 'after'}-{r}" for d, b, r in CASES])
def test_reference_layer_matches_torchtitan_expert_parallel(layer_results, dtype, score_before, routing):
    for rank, results in enumerate(layer_results):
        error = results[f"{dtype}-{score_before}-{routing}"]
        assert error is None, f"rank {rank}: {error}"


def test_reference_schedule_warns_nothing_of_its_own(tmp_path):
    """A training log carries no titan_uniep warning (torch 2.13 deprecates the
    all_gather_tensor wrapper); one gloo rank in this process, forward and backward."""
    import warnings

    from titan_uniep.oracle import float64_moe_oracle
    from titan_uniep.schedules import Routing, get_schedule

    torch.manual_seed(5)
    tokens, experts, top_k = 11, 4, 2
    x = torch.randn(tokens, DIM, requires_grad=True)
    scores, ids = torch.rand(tokens, experts).softmax(-1).topk(top_k, dim=-1)
    w1, w3 = (torch.randn(experts, HIDDEN, DIM) / DIM**0.5 for _ in range(2))
    w2 = torch.randn(experts, DIM, HIDDEN) / HIDDEN**0.5
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = get_schedule("reference")(x, Routing(scores, ids), w1, w2, w3, group=dist.group.WORLD,
                                            score_before_experts=False)
            out.sum().backward()
    finally:
        dist.destroy_process_group()
    ours = [f"{w.filename}:{w.lineno}: {w.message}" for w in caught if "titan_uniep" in w.filename]
    assert not ours, ours
    ref = float64_moe_oracle(x.detach(), scores, ids, w1, w2, w3, score_before_experts=False)
    assert _rel_err(out.detach(), ref) < 1e-5
    assert x.grad is not None and torch.isfinite(x.grad).all()
