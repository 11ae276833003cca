"""Forward + backward benchmark of one MoE layer's routed-expert path on an EP group.

    torchrun --nproc_per_node 2 -m titan_uniep.bench_backward --shapes qwen3,deepseek

For each shape (``T`` tokens per rank, ``D``, ``H``, ``E``, ``K``), same inputs
and routing (random router-like scores, balanced):

- ``titan_ep``: TorchTitan 0.2.2 standard EP (``ExpertParallel`` on
  ``GroupedExperts``, the MoE.forward lines after the router) under autograd:
  forward, then ``backward`` of the output gradient (grads of x, scores, w1-3);
- ``uniep_sequential`` / ``uniep_fused``: ``runtime.moe_forward`` (saving h1 | h3
  per slot, as the custom op does) then
  ``runtime.moe_backward`` (each schedule for both directions);
  ``*_bwd`` the backward alone; ``uniep_fused_recompute``: the fused
  forward + backward when nothing is saved (the backward recomputes fc1);
- ``gemm_only``: ``torch._grouped_mm`` fc1/SwiGLU/fc2 on the rows this rank
  receives (groups padded to 8 rows) under autograd, forward + backward.

Times: CUDA events, warm-up first, median over ``--reps``, slowest rank (ms).
``--sweep-tiles '[{"wgrad": "triton"}, ...]'``: the fused backward again with
each ``LayerParams`` override of ``--sweep-params`` (``uniep_fused_bwd[...]``).
``--profile``: rank 0 prints, for one backward call of each schedule, every
CUDA kernel in launch order with its device time (the sequential schedule's
launches are its phases: exchange, dispatch, dH, dA, wgrad, reduce).
One ``JSON`` line per shape, then a table. A failing path prints its error
and is reported as ``null`` (the others still run).
"""

from __future__ import annotations

import argparse
import json
import os
import traceback

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .runtime import BackwardWorkspace, Workspace, moe_backward, moe_forward
from .timing import time_ms
from .layout import compute_layout, count_per_expert

SHAPES = {  # T per rank, D, H, E, K
    "qwen3": (8192, 2048, 768, 128, 8),
    "deepseek": (4096, 7168, 2048, 256, 8),
    "mixtral": (8192, 4096, 14336, 8, 2),
}


def titan_ep_fwd_bwd(x, scores, indices, grad, w1, w2, w3, mesh, score_before: bool):
    """TorchTitan 0.2.2 MoE.forward after the router, with ExpertParallel, under autograd."""
    from torch.distributed.tensor.parallel import parallelize_module
    from torchtitan.distributed.expert_parallel import ExpertParallel
    from torchtitan.models.moe.moe import GroupedExperts, TokenReorderer

    num_experts, hidden, dim = w1.shape
    top_k = indices.shape[1]
    with torch.device("meta"):
        experts = GroupedExperts(dim, hidden, num_experts, use_grouped_mm=True)
    experts.w1 = torch.nn.Parameter(w1.clone())
    experts.w2 = torch.nn.Parameter(w2.clone())
    experts.w3 = torch.nn.Parameter(w3.clone())
    parallelize_module(experts, mesh, ExpertParallel())
    reorderer = TokenReorderer(num_experts=num_experts, top_k=top_k)
    x = x.detach().requires_grad_()
    scores = scores.detach().requires_grad_()

    def step():
        top_scores_sorted, token_indices_sorted, num_tokens_per_expert = reorderer(scores, indices)
        routed_input = x[token_indices_sorted // top_k]
        if score_before:
            routed_input = (routed_input.to(torch.float32) * top_scores_sorted.reshape(-1, 1)).to(x.dtype)
        routed_output = experts(routed_input, num_tokens_per_expert)
        unsorted = torch.zeros((x.shape[0] * top_k, dim), dtype=routed_output.dtype, device=x.device)
        unsorted[token_indices_sorted] = routed_output
        unsorted = unsorted.reshape(-1, top_k, dim)
        if not score_before:
            out = torch.bmm(scores.reshape(-1, 1, top_k), unsorted.float()).to(x.dtype).squeeze(1)
        else:
            out = unsorted.sum(dim=1)
        out.backward(grad)
        experts.w1.grad = experts.w2.grad = experts.w3.grad = x.grad = scores.grad = None

    return step


def gemm_only_fwd_bwd(tokens_per_local_expert, w1l, w2l, w3l, dim, dtype, gen, dev):
    sizes = (tokens_per_local_expert + 7) // 8 * 8
    offsets = torch.cumsum(sizes, 0).to(torch.int32)
    rows = torch.randn(int(sizes.sum()), dim, generator=gen, device=dev).to(dtype).requires_grad_()
    weights = [w.detach().clone().requires_grad_() for w in (w1l, w2l, w3l)]
    grad = torch.randn(rows.shape, generator=gen, device=dev).to(dtype)

    def step():
        w1t, w2t, w3t = (w.transpose(-2, -1) for w in weights)
        h = F.silu(torch._grouped_mm(rows, w1t, offs=offsets)) * torch._grouped_mm(rows, w3t, offs=offsets)
        torch._grouped_mm(h, w2t, offs=offsets).backward(grad)
        rows.grad = None
        for w in weights:
            w.grad = None

    return step


def layer_inputs(shape, rank: int, world: int, dev, dtype=torch.bfloat16) -> dict:
    """This rank's bf16 inputs of the benchmark's layer: x, the output gradient
    ``grad``, router-like ``scores``/``indices`` (top-k of a softmax), the
    whole ``w1``, ``w2``, ``w3`` (same on every rank) and its local
    ``w1l``, ``w2l``, ``w3l``."""
    num_tokens, dim, hidden, num_experts, top_k = shape
    el = num_experts // world
    gen = torch.Generator(device=dev).manual_seed(1234 + rank)
    wgen = torch.Generator(device=dev).manual_seed(99)
    out = dict(x=torch.randn(num_tokens, dim, generator=gen, device=dev).to(dtype),
               grad=torch.randn(num_tokens, dim, generator=gen, device=dev).to(dtype))
    probs = torch.softmax(torch.randn(num_tokens, num_experts, generator=gen, device=dev), 1)
    out["scores"], out["indices"] = (t.contiguous() for t in probs.topk(top_k, dim=1))
    out["w1"] = (torch.randn(num_experts, hidden, dim, generator=wgen, device=dev) * dim**-0.5).to(dtype)
    out["w3"] = (torch.randn(num_experts, hidden, dim, generator=wgen, device=dev) * dim**-0.5).to(dtype)
    out["w2"] = (torch.randn(num_experts, dim, hidden, generator=wgen, device=dev) * hidden**-0.5).to(dtype)
    mine = slice(rank * el, (rank + 1) * el)
    for w in ("w1", "w2", "w3"):
        out[w + "l"] = out[w][mine].contiguous()
    return out


def bench_shape(name, shape, args, group, mesh, dev):
    num_tokens, dim, hidden, num_experts, top_k = shape
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    dtype = torch.bfloat16
    inputs = layer_inputs(shape, rank, world, dev, dtype)
    x, grad, scores, indices = (inputs[n] for n in ("x", "grad", "scores", "indices"))
    w1, w2, w3, w1l, w2l, w3l = (inputs[n] for n in ("w1", "w2", "w3", "w1l", "w2l", "w3l"))
    gen = torch.Generator(device=dev).manual_seed(4321 + rank)  # the GEMM-only path's own inputs
    score_before = args.score_before
    result = {"shape": name, "T": num_tokens, "D": dim, "H": hidden, "E": num_experts, "K": top_k, "world": world,
              "score_before": score_before}

    def measure(key, make):
        try:
            result[key] = round(time_ms(make(), args.warmup, args.reps), 3)
        except Exception:  # noqa: BLE001 - one failing path must not hide the others
            if rank == 0:
                print(f"{name} {key} failed:\n{traceback.format_exc()}", flush=True)
            result[key] = None
            torch.cuda.synchronize()
            dist.barrier()

    measure("titan_ep", lambda: titan_ep_fwd_bwd(x, scores, indices, grad, w1, w2, w3, mesh, score_before))
    fwd_ws = bwd_ws = None
    try:
        fwd_ws = Workspace.for_group(group, num_tokens=num_tokens, dim=dim, hidden=hidden, num_experts=num_experts,
                                     top_k=top_k, dtype=dtype, device=dev)
    except Exception:  # noqa: BLE001
        if rank == 0:
            print(f"forward workspace failed:\n{traceback.format_exc()}", flush=True)
    bwd_ws = BackwardWorkspace.for_group(group, num_tokens=num_tokens, dim=dim, hidden=hidden,
                                         num_experts=num_experts, top_k=top_k, dtype=dtype, device=dev)
    # As the custom op runs it: the forward saves h1 | h3 per slot, the backward reads them.
    h13 = torch.empty(fwd_ws.shape.slot_capacity, 2 * hidden, dtype=dtype, device=dev)
    moe_forward(x, scores, indices, w1l, w2l, w3l, workspace=fwd_ws, schedule="sequential",
                score_before_experts=score_before, saved_h13=h13)

    def bwd_call(schedule, saved=True, params=None):
        return moe_backward(grad, x, scores, indices, w1l, w2l, w3l, workspace=bwd_ws, schedule=schedule,
                            score_before_experts=score_before, saved_h13=h13 if saved else None, params=params)

    for schedule in ("sequential", "fused"):
        def fwd_bwd(schedule=schedule, saved=True):
            def step():
                moe_forward(x, scores, indices, w1l, w2l, w3l, workspace=fwd_ws, schedule=schedule,
                            score_before_experts=score_before, saved_h13=h13 if saved else None)
                bwd_call(schedule, saved)
            return step

        measure(f"uniep_{schedule}_bwd", lambda schedule=schedule: lambda: bwd_call(schedule))
        measure(f"uniep_{schedule}", fwd_bwd)
    # The backward that recomputes h1, h3 (nothing saved beyond the inputs).
    measure("uniep_fused_recompute", lambda: fwd_bwd("fused", saved=False))
    counts_all = torch.empty(world, num_experts, dtype=torch.int64, device=dev)
    dist.all_gather_into_tensor(counts_all, count_per_expert(indices, num_experts), group=group)
    layout = compute_layout(indices, counts_all, rank)
    measure("gemm_only", lambda: gemm_only_fwd_bwd(layout.tokens_per_local_expert, w1l, w2l, w3l, dim, dtype,
                                                   gen, dev))
    for override in json.loads(args.sweep_params):
        point = bwd_ws.inner.params.replace(**override)
        key = "uniep_fused_bwd[" + ",".join(f"{k}={v}" for k, v in override.items()) + "]"
        measure(key, lambda point=point: lambda: bwd_call("fused", params=point))
    if args.profile:
        profile_backward(bwd_call, rank, name)
    if args.check:
        outs = [bwd_call(s, saved) for saved in (True, False) for s in ("sequential", "fused")]
        same = all(torch.equal(a, b) for a, b in zip(outs[0], outs[1])) and all(
            torch.equal(a, b) for a, b in zip(outs[2], outs[3]))
        # Saved h1 | h3 against recomputed: the same math, up to the GEMMs' rounding.
        diff = max(((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()
                   for a, b in zip(outs[1], outs[3]))
        result["saved_vs_recompute_max_rel_diff"] = diff
        flag = torch.tensor([int(same)], device=dev)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        result["bitwise_fused_eq_sequential"] = bool(flag.item())
    for key in ("uniep_sequential", "uniep_fused", "gemm_only"):
        if result.get(key) and result.get("titan_ep"):
            result[f"speedup_{key}_vs_titan"] = round(result["titan_ep"] / result[key], 3)
    return result


def profile_backward(call, rank: int, name: str) -> None:
    """Rank 0 prints one call's CUDA kernels, in launch order, per schedule."""
    from torch.profiler import ProfilerActivity, profile

    for schedule in ("sequential", "fused"):
        call(schedule)
        torch.cuda.synchronize()
        dist.barrier()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            call(schedule)
            torch.cuda.synchronize()
        if rank == 0:
            kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
            total = sum(e.time_range.elapsed_us() for e in kernels) / 1e3
            print(f"PROFILE {name} {schedule}: {len(kernels)} kernels, {total:.3f} ms of kernel time", flush=True)
            for e in kernels:
                print(f"PROFILE   {e.time_range.elapsed_us() / 1e3:8.3f} ms  {e.name[:90]}", flush=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="qwen3,deepseek")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--score-before", action="store_true")
    parser.add_argument("--check", action="store_true", help="fused == sequential bitwise (all grads)")
    parser.add_argument("--json-out", default=None)
    parser.add_argument("--profile", action="store_true", help="rank 0: one call's kernels, in order")
    parser.add_argument("--sweep-params", default="[]",
                        help="JSON list of LayerParams overrides whose fused backward to time")
    args = parser.parse_args(argv)
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dev = torch.device("cuda", local_rank)
    dist.init_process_group("nccl", device_id=dev)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cuda", (dist.get_world_size(),), mesh_dim_names=("ep",))
    group = dist.group.WORLD
    results = []
    for name in args.shapes.split(","):
        res = bench_shape(name, SHAPES[name], args, group, mesh, dev)
        results.append(res)
        torch.cuda.empty_cache()
        if dist.get_rank() == 0:
            print("JSON " + json.dumps(res), flush=True)
            if args.json_out:
                with open(args.json_out, "a") as f:
                    f.write(json.dumps(res) + "\n")
    if dist.get_rank() == 0:
        keys = ("titan_ep", "uniep_sequential", "uniep_fused", "uniep_sequential_bwd", "uniep_fused_bwd",
                "uniep_fused_recompute", "gemm_only")
        print("| shape | " + " | ".join(keys) + " | fused vs TT |")
        print("|---" * (len(keys) + 2) + "|")
        for res in results:
            cells = [f"{res.get(k):.2f}" if res.get(k) else "-" for k in keys]
            ratio = res.get("speedup_uniep_fused_vs_titan")
            print(f"| {res['shape']} | " + " | ".join(cells) + f" | {ratio if ratio else '-'} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
