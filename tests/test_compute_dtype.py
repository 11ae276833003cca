"""The expert GEMMs run in the dtype TorchTitan's own experts would use.

A TorchTitan MoE swapped to UniEP on a one-rank gloo group, its schedule
wrapped by a spy that records what reaches it (the dtypes the schedule, and so
the kernels, compute in) and runs the reference schedule. Cases: fp32
parameters under AMP (TorchTitan's NGPU = 1 training), bf16 parameters (FSDP
mixed precision), grouped-GEMM experts (bf16 whatever the parameters) and
for-loop experts (the tokens' dtype, or autocast's), and ``[uniep]
compute_dtype = "float32"``. The output always has the tokens' dtype and
every gradient its tensor's dtype; the kernel schedules' own dtype handling
is tested in test_op.py (interpreter) and on the GPU (tests/gpu).
"""

from __future__ import annotations

import pytest
from torchtitan_release import requires_torchtitan

requires_torchtitan("0.2.2")  # the TorchTitan 0.2.2 edge

import torch
import torch.distributed as dist
from torchtitan.models.moe.moe import MoE, MoEArgs

from titan_uniep import compute_dtype
from titan_uniep.config import UniEP
from titan_uniep.torchtitan.v0_2.cpu import apply_cpu_tensor_shims
from titan_uniep.torchtitan.v0_2.parallelize import _swap_to_uniep
from titan_uniep.schedules import get_schedule, register_schedule

DIM, HIDDEN, EXPERTS = 32, 16, 4


@pytest.fixture(scope="module")
def group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


class Spy:
    """A schedule that records what it receives and runs the reference schedule."""

    def __init__(self):
        self.calls: list[dict] = []

    def __call__(self, x, routing, w1, w2, w3, *, group, score_before_experts, out_dtype=None):
        self.calls.append({"x": x.dtype, "weights": {w.dtype for w in (w1, w2, w3)}, "w1_ptr": w1.data_ptr(),
                           "out_dtype": out_dtype, "scores": routing.top_scores.dtype})
        return get_schedule("reference")(x, routing, w1, w2, w3, group=group,
                                         score_before_experts=score_before_experts, out_dtype=out_dtype)


@pytest.fixture
def spy():
    recorder = Spy()
    register_schedule("dtype_spy", recorder, needs_cuda=False)
    return recorder


def _args(use_grouped_mm: bool = True) -> MoEArgs:
    return MoEArgs(num_experts=EXPERTS, num_shared_experts=0, top_k=2, score_func="softmax", route_norm=True,
                   score_before_experts=False, use_grouped_mm=use_grouped_mm)


def _moe(param_dtype: torch.dtype, use_grouped_mm: bool, group, requested: str = "auto") -> MoE:
    apply_cpu_tensor_shims()  # TorchTitan's router: integer histc on CPU
    torch.manual_seed(7)
    moe = MoE(_args(use_grouped_mm), dim=DIM, hidden_dim=HIDDEN)
    with torch.no_grad():
        moe.init_weights(init_std=0.1, buffer_device=torch.device("cpu"))
    moe = moe.to(param_dtype)
    moe.expert_bias.data = moe.expert_bias.data.float()
    moe.tokens_per_expert.data = moe.tokens_per_expert.data.float()
    _swap_to_uniep(torch.nn.ModuleDict({"moe": moe}), UniEP(enable=True, compute_dtype=requested))
    moe.experts.schedule = "dtype_spy"
    moe.experts.ep_group = group
    return moe


def _train_step(moe: MoE, x_dtype: torch.dtype, autocast: torch.dtype | None):
    x = torch.randn(1, 11, DIM, dtype=x_dtype, requires_grad=True)  # odd T
    with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
        out = moe.experts(x.view(-1, DIM), _routing(moe, x))
    out.backward(torch.randn_like(out))
    return out, x


def _routing(moe: MoE, x: torch.Tensor):
    from titan_uniep.schedules import Routing

    scores, indices, _ = moe.router(x.detach().view(-1, DIM).to(moe.router.gate.weight.dtype), moe.expert_bias)
    return Routing(scores, indices)


CASES = {
    # name: (param dtype, grouped-GEMM experts, autocast dtype, requested, expected GEMM dtype)
    "amp_fp32_params_grouped_mm": (torch.float32, True, torch.bfloat16, "auto", torch.bfloat16),
    "fp32_params_grouped_mm_no_autocast": (torch.float32, True, None, "auto", torch.bfloat16),
    "bf16_params_grouped_mm": (torch.bfloat16, True, None, "auto", torch.bfloat16),
    "amp_fp32_params_for_loop": (torch.float32, False, torch.bfloat16, "auto", torch.bfloat16),
    "fp32_params_for_loop": (torch.float32, False, None, "auto", torch.float32),
    "explicit_float32_bf16_params": (torch.bfloat16, True, None, "float32", torch.float32),
    "explicit_float32_under_amp": (torch.float32, True, torch.bfloat16, "float32", torch.float32),
}


@pytest.mark.parametrize("case", list(CASES))
def test_experts_compute_in_torchtitans_dtype_and_return_every_tensor_in_its_own(group, spy, case):
    param_dtype, grouped_mm, autocast, requested, expected = CASES[case]
    moe = _moe(param_dtype, grouped_mm, group, requested)
    out, x = _train_step(moe, param_dtype, autocast)
    (call,) = spy.calls
    assert call["x"] == expected and call["weights"] == {expected}, f"{case}: the schedule got {call}"
    # No copy of the weights where they are in the compute dtype already (FSDP's bf16).
    assert (call["w1_ptr"] == moe.experts.w1.data_ptr()) == (param_dtype == expected), case
    assert out.dtype == x.dtype == param_dtype, f"{case}: output {out.dtype}, tokens {x.dtype}"
    assert x.grad is not None and x.grad.dtype == x.dtype
    for name in ("w1", "w2", "w3"):
        p = getattr(moe.experts, name)
        assert p.grad is not None and p.grad.dtype == p.dtype == param_dtype, f"{case}: {name}.grad"
        assert torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, f"{case}: {name}.grad"


def test_under_amp_the_combine_rounds_as_torchtitans_bmm(group, spy):
    """Under AMP the tokens are fp32 and the GEMMs bf16. TorchTitan 0.2.2's MoE
    sums the K scored expert rows with ``torch.bmm``, which autocast runs in
    bf16: the scores and the sum are rounded to bf16, then cast back to fp32.
    The UniEP layer rounds the same (scores and the sum over k) and returns
    fp32, against TorchTitan's own MoE on the same weights; without autocast
    the fp32 sum is not rounded."""
    moe = _moe(torch.float32, True, group)
    x = torch.randn(13, DIM)
    routing = _routing(moe, x)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = moe.experts(x, routing)
    (call,) = spy.calls
    assert call["out_dtype"] == torch.bfloat16 and call["scores"] == torch.bfloat16, call
    assert out.dtype == torch.float32
    assert torch.equal(out, out.bfloat16().float()), "the sum over k was not rounded to bf16"

    # TorchTitan's own MoE (its grouped-GEMM experts, its bmm combine) on the same weights and routing.
    torchtitan_moe = MoE(_args(), dim=DIM, hidden_dim=HIDDEN)
    torchtitan_moe.load_state_dict(moe.state_dict())
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        theirs = torchtitan_moe(x.view(1, 13, DIM)).view(13, DIM)
    assert theirs.dtype == torch.float32 and torch.equal(theirs, theirs.bfloat16().float())
    # The same bf16 roundings; the expert GEMMs' sums (grouped GEMM against per-expert matmul) and the
    # bmm's order may differ in the last bits.
    torch.testing.assert_close(out, theirs, rtol=2**-6, atol=2**-8 * theirs.abs().max().item())

    with torch.no_grad():
        exact = moe.experts(x.bfloat16().float(), routing)
    assert not torch.equal(exact, exact.bfloat16().float()), "without autocast the fp32 sum was rounded"


def test_resolve_names_the_key_and_the_values():
    assert compute_dtype.resolve("auto", framework_casts_to_bf16=True) == torch.bfloat16
    assert compute_dtype.resolve("auto", framework_casts_to_bf16=False) is None
    assert compute_dtype.resolve("float32", framework_casts_to_bf16=True) == torch.float32
    with pytest.raises(ValueError, match=r"\[uniep\] compute_dtype = 'fp16'.*'auto', 'float32'"):
        compute_dtype.resolve("fp16", framework_casts_to_bf16=True)
    with pytest.raises(ValueError, match=r"\[uniep\] compute_dtype = 'bf16' is not a compute dtype"):
        UniEP(enable=True, compute_dtype="bf16")


def test_the_weight_gradients_dtype_of_a_job_follows_where_its_weights_arrive():
    """fp32 only where the kernels compute in 16 bits on fp32 weights: the
    masters of ``master_weights`` (no FSDP: AMP's fp32 parameters; or FSDP
    keeping fp32 parameters); the data's (None) under FSDP's bf16 weights or
    for fp32 GEMMs."""
    bf16, fp32 = torch.bfloat16, torch.float32
    assert compute_dtype.weight_grad_dtype(bf16, fp32) == fp32
    assert compute_dtype.weight_grad_dtype(torch.float16, fp32) == fp32
    assert compute_dtype.weight_grad_dtype(bf16, bf16) is None
    assert compute_dtype.weight_grad_dtype(fp32, fp32) is None
    job = compute_dtype.job_weight_grad_dtype
    assert job(bf16, fsdp=False, mixed_precision_param="bfloat16") == fp32
    assert job(bf16, fsdp=True, mixed_precision_param="bfloat16") is None
    assert job(bf16, fsdp=True, mixed_precision_param="float32") == fp32
    assert job(fp32, fsdp=False, mixed_precision_param="bfloat16") is None
    with pytest.raises(ValueError, match="mixed-precision dtype 'half'"):
        job(bf16, fsdp=True, mixed_precision_param="half")
    # master_weights takes the same rule: masters exactly where the gradients are fp32.
    w = torch.randn(2, 3, 4)
    casts, masters = compute_dtype.master_weights(bf16, w, w, w)
    assert masters is not None and all(c.dtype == bf16 and not c.requires_grad for c in casts)
    assert compute_dtype.master_weights(bf16, w.to(bf16), w, w)[1] is None
