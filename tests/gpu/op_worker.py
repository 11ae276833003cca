"""The custom op on ONE GPU at EP = 1: ``torch.ops.uniep.moe_experts`` and its
backward op on a one-rank group (the op's real path: ``Workspace.for_group``,
symmetric memory of one rank, no peer traffic), bf16.

Launched by ``test_gpu_op.py`` as
``torchrun --standalone --nproc_per_node 1 tests/gpu/op_worker.py``. Each check
raises on failure; the worker prints ``OP WORKER OK`` at the end.

1. eager: fused == sequential bitwise, forward and every gradient, close to
   the float64 oracle (bf16 tolerance), with a reused workspace, the
   backward's dh1 in the forward workspace's returned rows;
2. no device-to-host sync in the fused forward + backward (sync debug mode "error");
3. ``torch.compile`` (inductor, one graph) of a module whose compute is the
   op: the eager bits, forward and every gradient, on two calls with new data;
4. ``torch.compile`` (inductor, one graph) of a TorchTitan MoE swapped to
   UniEP (router, shared expert, schedule "fused"): runs forward and
   backward, close to eager (inductor rounds the router's own ops
   differently, so only closeness is claimed there);
5. fp32 master weights (TorchTitan's NGPU = 1 training: the layer casts
   them to bf16 and passes them as the casts' masters): fp32 weight
   gradients, fused == sequential bitwise, rounded to bf16 the bits of the
   op on bf16 weights with the Triton weight-gradient kernel; no host sync;
   compiled (inductor, one graph) == eager bitwise.
"""

import copy

import torch
import torch.distributed as dist

from titan_uniep import op
from titan_uniep.oracle import float64_moe_oracle

DIM, HIDDEN, EXPERTS, TOP_K, TOKENS = 512, 384, 16, 4, 777
GRADS = ("out", "dx", "dscores", "dw1", "dw2", "dw3")


def inputs(seed, dev):
    gen = torch.Generator(device=dev).manual_seed(seed)
    x = torch.randn(TOKENS, DIM, generator=gen, device=dev).bfloat16()
    scores = torch.rand(TOKENS, TOP_K, generator=gen, device=dev)
    indices = torch.rand(TOKENS, EXPERTS, generator=gen, device=dev).argsort(1)[:, :TOP_K].contiguous()
    grad = torch.randn(TOKENS, DIM, generator=gen, device=dev).bfloat16()
    return x, scores, indices, grad


def weights(dev):
    gen = torch.Generator(device=dev).manual_seed(1234)
    w1 = (torch.randn(EXPERTS, HIDDEN, DIM, generator=gen, device=dev) * DIM**-0.5).bfloat16()
    w3 = (torch.randn(EXPERTS, HIDDEN, DIM, generator=gen, device=dev) * DIM**-0.5).bfloat16()
    w2 = (torch.randn(EXPERTS, DIM, HIDDEN, generator=gen, device=dev) * HIDDEN**-0.5).bfloat16()
    return w1, w2, w3


class OpLayer(torch.nn.Module):
    """The routed experts as parameters; the forward is the op and nothing else."""

    def __init__(self, w1, w2, w3, group_name, schedule):
        super().__init__()
        self.w1, self.w2, self.w3 = (torch.nn.Parameter(w.clone()) for w in (w1, w2, w3))
        self.group_name, self.schedule = group_name, schedule

    def forward(self, x, scores, indices):
        out, _h13 = torch.ops.uniep.moe_experts(x, scores, indices, self.w1, self.w2, self.w3, self.group_name,
                                                self.schedule, False)
        return out


class MasterOpLayer(torch.nn.Module):
    """fp32 expert weights; the forward casts them to bf16 (detached) and
    passes them as the casts' masters, as ``UniEPExperts.run_uniep`` does."""

    def __init__(self, w1, w2, w3, group_name, schedule):
        super().__init__()
        self.w1, self.w2, self.w3 = (torch.nn.Parameter(w.float()) for w in (w1, w2, w3))
        self.group_name, self.schedule = group_name, schedule

    def forward(self, x, scores, indices):
        masters = (self.w1, self.w2, self.w3)
        casts = [m.detach().bfloat16() for m in masters]
        out, _h13 = torch.ops.uniep.moe_experts(x, scores, indices, *casts, self.group_name, self.schedule, False,
                                                None, *masters)
        return out


def run(layer, x, scores, indices, grad):
    layer.zero_grad(set_to_none=True)
    xx, ss = x.clone().requires_grad_(), scores.clone().requires_grad_()
    out = layer(xx, ss, indices)
    out.backward(grad)
    return [out.detach(), xx.grad, ss.grad, layer.w1.grad, layer.w2.grad, layer.w3.grad]


def without_host_sync(fn) -> None:
    """Run ``fn`` with CUDA's sync debug mode "error": a device-to-host sync raises."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def check_float64(got, x, scores, indices, grad, w):
    leaves = [t.double().requires_grad_() for t in (x, scores, *w)]
    ref = float64_moe_oracle(leaves[0], leaves[1], indices, *leaves[2:], score_before_experts=False)
    ref.backward(grad.double())
    for name, g, exact in zip(GRADS, got, [ref.detach()] + [t.grad for t in leaves]):
        scale = exact.abs().max().item()
        torch.testing.assert_close(g.double(), exact, rtol=3e-2, atol=3e-2 * scale,
                                   msg=lambda m: f"{name} vs float64: {m}")


def main():
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", device_id=dev)
    group = dist.group.WORLD
    assert dist.get_world_size(group) == 1, "run with --nproc_per_node 1"
    op.reserve_tokens(group, TOKENS)
    w = weights(dev)
    data = inputs(1, dev)

    # 1. Eager: the two schedules' bits, and float64.
    layers = {s: OpLayer(*w, group.group_name, s) for s in ("sequential", "fused")}
    got = {s: run(layers[s], *data) for s in layers}
    again = run(layers["fused"], *data)
    for name, a, b, c in zip(GRADS, got["sequential"], got["fused"], again):
        assert not torch.isnan(b).any(), f"{name}: NaN"
        assert torch.equal(a, b), f"eager {name}: fused differs from sequential"
        assert torch.equal(b, c), f"eager {name}: a second fused call differs"
    check_float64(got["fused"], *data, w)
    fwd_ws, bwd_ws = (next(v for k, v in op._workspaces.items() if k[1] == d) for d in (False, True))
    offset = bwd_ws.dh1.data_ptr() - fwd_ws.arena.data_ptr() - fwd_ws.offsets["returned"]
    assert 0 <= offset and offset + bwd_ws.dh1.nbytes <= fwd_ws.shape.arena_sizes()["returned"], \
        "the backward's dh1 is not in the forward's returned rows"
    print("1. eager fused == sequential bitwise, close to float64 (the backward's dh1 in the forward's returned rows)",
          flush=True)

    # 2. No host sync on the fused path, forward and backward.
    without_host_sync(lambda: run(layers["fused"], *data))
    print("2. fused forward + backward: no host sync", flush=True)

    # 3. Compiled (inductor, one graph) == eager, bit for bit, on two calls.
    compiled = torch.compile(OpLayer(*w, group.group_name, "fused"), fullgraph=True)
    for seed in (1, 2):
        batch = inputs(seed, dev)
        eager = run(layers["fused"], *batch)
        comp = run(compiled, *batch)
        for name, a, b in zip(GRADS, eager, comp):
            assert torch.equal(a, b), f"compiled {name} differs from eager (inputs {seed})"
    print("3. torch.compile (inductor, fullgraph) of the op: eager bits, forward and every gradient", flush=True)

    # 4. A TorchTitan MoE holding the op, compiled whole.
    from torchtitan.models.moe.moe import MoE, MoEArgs

    from titan_uniep.config import UniEP
    from titan_uniep.torchtitan.v0_2.parallelize import _swap_to_uniep

    torch.manual_seed(5)
    args = MoEArgs(num_experts=EXPERTS, num_shared_experts=1, top_k=TOP_K, score_func="softmax", route_norm=True,
                   score_before_experts=False)
    base = MoE(args, dim=DIM, hidden_dim=HIDDEN).to(dev)
    with torch.no_grad():
        base.init_weights(init_std=0.02, buffer_device=dev)
    base = base.bfloat16()
    base.expert_bias.data = base.expert_bias.data.float()  # as TorchTitan keeps them
    base.tokens_per_expert.data = base.tokens_per_expert.data.float()
    x = torch.randn(1, TOKENS, DIM, device=dev).bfloat16()
    results = []
    for compile_it in (False, True):
        moe = copy.deepcopy(base)
        _swap_to_uniep(torch.nn.ModuleDict({"moe": moe}), UniEP(enable=True, schedule="fused"))
        moe.experts.ep_group = group
        model = torch.compile(moe, fullgraph=True) if compile_it else moe
        xx = x.clone().requires_grad_()
        out = model(xx)
        out.float().square().mean().backward()
        results.append([out.detach(), xx.grad] + [p.grad for p in moe.parameters()])
    for i, (a, b) in enumerate(zip(*results)):
        assert b is not None and not torch.isnan(b).any(), f"compiled MoE: gradient {i} missing or NaN"
        scale = a.abs().max().item()
        torch.testing.assert_close(b.float(), a.float(), rtol=5e-2, atol=5e-2 * scale,
                                   msg=lambda m: f"compiled MoE tensor {i} vs eager: {m}")
    print("4. torch.compile (inductor, fullgraph) of a TorchTitan MoE on UniEP: close to eager", flush=True)

    # 5. fp32 master weights.
    masters = {s: MasterOpLayer(*w, group.group_name, s) for s in ("sequential", "fused")}
    got = {s: run(masters[s], *data) for s in masters}
    for name, a, b in zip(GRADS, got["sequential"], got["fused"]):
        assert not torch.isnan(b).any(), f"masters {name}: NaN"
        assert torch.equal(a, b), f"masters {name}: fused differs from sequential"
    assert all(g.dtype == torch.float32 for g in got["fused"][3:])
    backward_ws = [v.inner for k, v in op._workspaces.items() if k[1]]  # the backward workspaces
    for ws in backward_ws:  # the bf16 op's weight gradients from the Triton kernel (default: torch._grouped_mm)
        ws.params = ws.params.replace(wgrad_backend="triton")
    plain = run(OpLayer(*w, group.group_name, "fused"), *data)
    for ws in backward_ws:
        ws.params = ws.params.replace(wgrad_backend="auto")
    for name, a, b in zip(GRADS, got["fused"], plain):
        ok = torch.equal(a.bfloat16(), b) if name.startswith("dw") else torch.equal(a, b)
        assert ok, f"masters {name}: not the bf16 op's bits (rounded)"
    without_host_sync(lambda: run(masters["fused"], *data))
    compiled = torch.compile(MasterOpLayer(*w, group.group_name, "fused"), fullgraph=True)
    for seed in (3, 4):
        batch = inputs(seed, dev)
        eager, comp = run(masters["fused"], *batch), run(compiled, *batch)
        for name, a, b in zip(GRADS, eager, comp):
            assert torch.equal(a, b), f"compiled masters {name} differs from eager (inputs {seed})"
    print("5. fp32 master weights: fp32 weight gradients, fused == sequential, the bf16 op's bits rounded, "
          "no host sync, compiled == eager", flush=True)

    op._workspaces.clear()
    dist.destroy_process_group()
    print("OP WORKER OK", flush=True)


if __name__ == "__main__":
    main()
