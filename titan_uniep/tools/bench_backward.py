"""Forward + backward benchmark of one MoE layer's routed-expert path on an EP group.

    torchrun --nproc_per_node 2 -m titan_uniep.tools.bench_backward --shape qwen3 --shape deepseek --check

For each ``--shape`` (``T`` tokens per rank, ``D``, ``H``, ``E``, ``K``: a name
of ``titan_uniep.shapes`` or ``T,D,H,E,K``; default qwen3 and deepseek), same
inputs and routing (random router-like scores, balanced):

- ``titan_ep``: TorchTitan 0.2.2 standard EP (``ExpertParallel`` on
  ``GroupedExperts``, the MoE.forward lines after the router) under autograd:
  forward, then ``backward`` of the output gradient (grads of x, scores, w1-3);
- ``uniep_sequential`` / ``uniep_fused``: ``runtime.moe_forward`` (saving h1 | h3
  per slot, as the custom op does) then
  ``runtime.moe_backward`` (each schedule for both directions);
  ``*_bwd`` the backward alone;
- ``uniep_tuned`` / ``uniep_tuned_bwd``: the fused schedule at the tuned
  points of the tuning cache (``--tuned-cache``, default the cache's default
  path; forward and backward entries), when it has an entry for the shape;
- ``gemm_only``: ``torch._grouped_mm`` fc1/SwiGLU/fc2 on the rows this rank
  receives (groups padded to 8 rows) under autograd, forward + backward;
- ``liger_fused_moe``: Liger-Kernel's fused MoE forward and backward
  (``titan_uniep.tools.peers``; EP = 1 and scores after the experts only).

Each path's TF/s counts the expert GEMMs of the slowest rank (forward
``6 D H`` FLOPs per received row, backward ``12 D H``) and its share of the
bf16 peak measured in the same run (an ``8192^3`` matmul).

Times: CUDA events, warm-up first, median over ``--reps``, slowest rank
(ms), in ``--rounds`` rounds of alternating path order
(``timing.time_alternating``); each path's own tensors (TorchTitan's module
and gradients, the GEMM-only operands) are built right before its turn and
freed after it, so only one path's are resident at a time (at DeepSeek
sizes on one GPU each set is tens of GB).
``--sweep-params '[{"wgrad_backend": "triton"}, ...]'``: the fused backward again with
each ``LayerParams`` override (``uniep_fused_bwd[...]``).
``--profile``: rank 0 prints, for one backward call of each schedule, every
CUDA kernel in launch order with its device time (the sequential schedule's
launches are its phases: exchange, dispatch, dH, dA, wgrad, reduce).
``--check``: every gradient bitwise equal across the schedules, close to
TorchTitan's on the full inputs and to a float64 oracle on the first
``--check-tokens`` tokens of every rank (``titan_uniep.accuracy`` has the
limits); exits 1 beyond them.
``--report DIR``: Markdown and PNG plots per shape (``titan_uniep.tools.report``).
One ``JSON`` line per shape, then a table. A failing path prints its error
and is reported as ``null`` (the others still run).
"""

from __future__ import annotations

import argparse
import json
import os
from datetime import date

import torch
import torch.distributed as dist
import torch.nn.functional as F

from titan_uniep.accuracy import LIMITS, enforce, failures, max_over_group, rel_diff
from titan_uniep.layout import compute_layout, count_per_expert
from titan_uniep.oracle import float64_moe_backward_oracle
from titan_uniep.runtime import BackwardWorkspace, Workspace, moe_backward, moe_forward
from titan_uniep.shapes import add_shape_argument, layer_inputs
from titan_uniep.timing import time_alternating
from titan_uniep.tools import require_gpu_under_torchrun
from titan_uniep.tools.peers import LIGER, liger_fwd_bwd, liger_unavailable, measured_peak_tflops

PROG = "python3 -m titan_uniep.tools.bench_backward"
GRAD_NAMES = ("dx", "dscores", "dw1", "dw2", "dw3")


def titan_ep_module(w1, w2, w3, mesh, top_k: int):
    """TorchTitan 0.2.2's GroupedExperts with ExpertParallel on ``mesh`` and
    its TokenReorderer. The parameters share the given weights' storage (no
    copy: at DeepSeek sizes one is 22 GB); their gradients are the module's."""
    from torch.distributed.tensor.parallel import parallelize_module
    from torchtitan.distributed.expert_parallel import ExpertParallel
    from torchtitan.models.moe.moe import GroupedExperts, TokenReorderer

    num_experts, hidden, dim = w1.shape
    with torch.device("meta"):
        experts = GroupedExperts(dim, hidden, num_experts, use_grouped_mm=True)
    experts.w1 = torch.nn.Parameter(w1)
    experts.w2 = torch.nn.Parameter(w2)
    experts.w3 = torch.nn.Parameter(w3)
    parallelize_module(experts, mesh, ExpertParallel())
    return experts, TokenReorderer(num_experts=num_experts, top_k=top_k)


def titan_ep_fwd_bwd(x, scores, indices, grad, w1, w2, w3, mesh, score_before: bool, *, keep_grads: bool = False):
    """A step of TorchTitan's MoE.forward after the router, then its backward.
    ``keep_grads``: the step returns ``(dx, dscores, dw1, dw2, dw3)`` (this
    rank's expert shards), else it frees them and returns None."""
    top_k = indices.shape[1]
    dim = x.shape[1]
    experts, reorderer = titan_ep_module(w1, w2, w3, mesh, top_k)
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
        grads = None
        if keep_grads:
            grads = (x.grad, scores.grad, *(getattr(experts, w).grad.to_local() for w in ("w1", "w2", "w3")))
        experts.w1.grad = experts.w2.grad = experts.w3.grad = x.grad = scores.grad = None
        return grads

    return step


def gemm_only_fwd_bwd(tokens_per_local_expert, w1l, w2l, w3l, dim, dtype, gen, dev):
    sizes = (tokens_per_local_expert + 7) // 8 * 8
    offsets = torch.cumsum(sizes, 0).to(torch.int32)
    rows = torch.randn(int(sizes.sum()), dim, generator=gen, device=dev).to(dtype).requires_grad_()
    weights = [w.detach().requires_grad_() for w in (w1l, w2l, w3l)]  # same storage, own gradients
    grad = torch.randn(rows.shape, generator=gen, device=dev).to(dtype)

    def step():
        w1t, w2t, w3t = (w.transpose(-2, -1) for w in weights)
        h = F.silu(torch._grouped_mm(rows, w1t, offs=offsets)) * torch._grouped_mm(rows, w3t, offs=offsets)
        torch._grouped_mm(h, w2t, offs=offsets).backward(grad)
        rows.grad = None
        for w in weights:
            w.grad = None

    return step


def tuned_points(path: str, shape, world: int, dtype: torch.dtype, dev, score_before: bool) -> dict[str, tuple]:
    """``{"forward": (params | None, reason), "backward": ...}`` of ``shape`` (in that score mode) in the tuning
    cache at ``path``."""
    from titan_uniep.tuning.cache import CacheKey, lookup_file

    num_tokens, dim, hidden, num_experts, top_k = shape
    key = CacheKey.for_layer(gpu=torch.cuda.get_device_name(dev), ep_size=world, dtype=dtype, num_tokens=num_tokens,
                             dim=dim, hidden=hidden, num_experts=num_experts, top_k=top_k,
                             score_before_experts=score_before)
    return lookup_file(path, key)


def bench_shape(name, shape, args, group, mesh, dev):
    num_tokens, dim, hidden, num_experts, top_k = shape
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    dtype = torch.bfloat16
    inputs = layer_inputs(shape, rank, world, dev, dtype)
    x, grad, scores, indices = (inputs[n] for n in ("x", "grad", "scores", "indices"))
    w1, w2, w3, w1l, w2l, w3l = (inputs[n] for n in ("w1", "w2", "w3", "w1l", "w2l", "w3l"))
    gen = torch.Generator(device=dev).manual_seed(4321 + rank)  # the GEMM-only path's own inputs
    score_before = args.score_before
    result = {"date": str(date.today()), "shape": name, "T": num_tokens, "D": dim, "H": hidden, "E": num_experts,
              "K": top_k, "world": world, "score_before": score_before, "dtype": "bf16",
              "gpu": torch.cuda.get_device_name(dev)}
    sizes = dict(num_tokens=num_tokens, dim=dim, hidden=hidden, num_experts=num_experts, top_k=top_k, dtype=dtype,
                 device=dev)
    fwd_ws = Workspace.for_group(group, **sizes)
    bwd_ws = BackwardWorkspace.for_group(group, **sizes)
    tuned = tuned_points(args.tuned_cache, shape, world, dtype, dev, args.score_before) if args.tuned_cache else {}
    tuned_fwd, tuned_bwd = (tuned.get(d, (None, ""))[0] for d in ("forward", "backward"))
    result["tuned"] = {d: {"applied": p is not None, "reason": why} for d, (p, why) in tuned.items()}
    tuned_fwd_ws = tuned_bwd_ws = None
    if tuned_fwd is not None:
        tuned_fwd_ws = Workspace.for_group(group, **sizes, params=tuned_fwd)
    if tuned_bwd is not None:
        tuned_bwd_ws = BackwardWorkspace.for_group(group, **sizes, params=tuned_bwd)
    # As the custom op runs it: the forward saves h1 | h3 per slot, the backward reads them.
    h13 = torch.empty(fwd_ws.shape.slot_capacity, 2 * hidden, dtype=dtype, device=dev)
    moe_forward(x, scores, indices, w1l, w2l, w3l, workspace=fwd_ws, schedule="sequential",
                score_before_experts=score_before, saved_h13=h13)

    def fwd_call(schedule, params=None, ws=None):
        return moe_forward(x, scores, indices, w1l, w2l, w3l, workspace=ws or fwd_ws, schedule=schedule,
                           score_before_experts=score_before, saved_h13=h13, params=params)

    def bwd_call(schedule, params=None, ws=None):
        return moe_backward(grad, x, scores, indices, w1l, w2l, w3l, workspace=ws or bwd_ws, schedule=schedule,
                            score_before_experts=score_before, saved_h13=h13, params=params)

    def fwd_bwd(schedule, fwd=(None, None), bwd=(None, None)):
        def step():
            fwd_call(schedule, *fwd)
            bwd_call(schedule, *bwd)
        return step

    counts_all = torch.empty(world, num_experts, dtype=torch.int64, device=dev)
    dist.all_gather_into_tensor(counts_all, count_per_expert(indices, num_experts), group=group)
    layout = compute_layout(indices, counts_all, rank)

    def gemm_only():
        return gemm_only_fwd_bwd(layout.tokens_per_local_expert, w1l, w2l, w3l, dim, dtype, gen, dev)

    paths = {
        "titan_ep": lambda: titan_ep_fwd_bwd(x, scores, indices, grad, w1, w2, w3, mesh, score_before),
        "uniep_sequential_bwd": lambda: lambda: bwd_call("sequential"),
        "uniep_fused_bwd": lambda: lambda: bwd_call("fused"),
        "uniep_sequential": lambda: fwd_bwd("sequential"),
        "uniep_fused": lambda: fwd_bwd("fused"),
        "gemm_only": gemm_only,
    }
    if tuned_fwd is not None or tuned_bwd is not None:
        fwd_point, bwd_point = (tuned_fwd, tuned_fwd_ws), (tuned_bwd, tuned_bwd_ws)
        paths["uniep_tuned"] = lambda: fwd_bwd("fused", fwd=fwd_point, bwd=bwd_point)
    if tuned_bwd is not None:
        paths["uniep_tuned_bwd"] = lambda: lambda: bwd_call("fused", *bwd_point)
    liger_reason = liger_unavailable(world, score_before)
    if liger_reason is None:
        paths[LIGER] = lambda: liger_fwd_bwd(x, scores, indices, grad, w1, w2, w3)[0]
    else:
        result[f"{LIGER}_not_run"] = liger_reason
    for override in json.loads(args.sweep_params):
        point = bwd_ws.inner.params.replace(**override)
        key = "uniep_fused_bwd[" + ",".join(f"{k}={v}" for k, v in override.items()) + "]"
        paths[key] = lambda point=point: lambda: bwd_call("fused", params=point)

    def report_error(key, trace):
        if rank == 0:
            print(f"{name} {key} failed:\n{trace}", flush=True)

    times = time_alternating(paths, warmup=args.warmup, reps=args.reps, rounds=args.rounds, group=group,
                             on_error=report_error)
    result.update({key: None if ms is None else round(ms, 3) for key, ms in times.items()})
    if args.profile:
        profile_backward(bwd_call, rank, name)
    if args.check:
        stats = check(inputs, fwd_ws, bwd_ws, h13, args, group, mesh, dev,
                      tuned=None if tuned_bwd is None else (tuned_bwd, tuned_bwd_ws))
        if liger_reason is None:
            stats.update(check_liger(inputs, fwd_ws, bwd_ws, h13, score_before, group, dev))
        result["check"] = stats
        result["check_failures"] = failures(stats, LIMITS["backward"]["bf16"])
    if args.report:
        from titan_uniep.tuning.search import MoELayer, predictions

        default = bwd_ws.inner.params
        points = {"default": (fwd_ws.params, default)}
        if tuned_fwd is not None or tuned_bwd is not None:
            points["tuned"] = (tuned_fwd or fwd_ws.params, tuned_bwd or default)
        result["model"] = predictions(MoELayer(name, *shape, score_before, dtype), indices, group, points,
                                      args.constants)
    for key in ("uniep_sequential", "uniep_fused", "uniep_tuned", "gemm_only"):
        if result.get(key) and result.get("titan_ep"):
            result[f"speedup_{key}_vs_titan"] = round(result["titan_ep"] / result[key], 3)
    if result.get("uniep_fused") and result.get(LIGER):
        result[f"speedup_uniep_fused_vs_{LIGER}"] = round(result[LIGER] / result["uniep_fused"], 3)
    rows = torch.tensor([float(layout.expert_offsets[-1])], dtype=torch.float64, device=dev)
    dist.all_reduce(rows, op=dist.ReduceOp.MAX, group=group)
    result["peak_tflops"] = round(args.peak_tflops, 1)
    for key, ms in times.items():
        if ms:
            flops = (12 if key.endswith("_bwd") or "_bwd[" in key else 18) * dim * hidden * rows.item()
            result[f"{key}_tflops"] = round(flops / ms / 1e9, 1)
            result[f"{key}_share_of_peak"] = round(flops / ms / 1e9 / args.peak_tflops, 3)
    return result


def check_liger(inputs, fwd_ws, bwd_ws, h13, score_before, group, dev) -> dict[str, float]:
    """UniEP's fused output and gradients against Liger's on the same inputs
    (``<name>_vs_peer``; EP = 1: every expert is local)."""
    x, grad, scores, indices = (inputs[n] for n in ("x", "grad", "scores", "indices"))
    local = (inputs["w1l"], inputs["w2l"], inputs["w3l"])
    out = moe_forward(x, scores, indices, *local, workspace=fwd_ws, schedule="fused", score_before_experts=score_before,
                      saved_h13=h13, error_check="sync")
    ours = dict(zip(GRAD_NAMES, moe_backward(grad, x, scores, indices, *local, workspace=bwd_ws, schedule="fused",
                                             score_before_experts=score_before, saved_h13=h13)))
    ours["out"] = out
    step, gradients = liger_fwd_bwd(x, scores, indices, grad, inputs["w1"], inputs["w2"], inputs["w3"])
    step()
    theirs = gradients()
    stats = {f"{LIGER}_{name}_vs_peer": rel_diff(ours[name].to(theirs[name].dtype), theirs[name])
             for name in ("out", *GRAD_NAMES)}
    return max_over_group(stats, group, dev)


def check(inputs, fwd_ws, bwd_ws, h13, args, group, mesh, dev, tuned=None) -> dict[str, float]:
    """The ``--check`` statistics of one shape (maxima over the ranks), in an
    order that keeps at most two sets of gradients resident. ``tuned``: the
    tuned backward point and its workspace, whose gradients must be the
    default's bits."""
    x, grad, scores, indices = (inputs[n] for n in ("x", "grad", "scores", "indices"))
    local = (inputs["w1l"], inputs["w2l"], inputs["w3l"])
    sb = args.score_before
    stats = {}

    def backward(schedule, params=None, workspace=bwd_ws):
        return moe_backward(grad, x, scores, indices, *local, workspace=workspace, schedule=schedule,
                            score_before_experts=sb, saved_h13=h13, params=params)

    def bitwise(name, a, b):
        stats[f"{name}_bitwise_diff"] = float(not all(torch.equal(u, v) for u, v in zip(a, b)))

    moe_forward(x, scores, indices, *local, workspace=fwd_ws, schedule="sequential", score_before_experts=sb,
                saved_h13=h13)
    fused = backward("fused")
    titan = titan_ep_fwd_bwd(x, scores, indices, grad, inputs["w1"], inputs["w2"], inputs["w3"], mesh, sb,
                             keep_grads=True)()
    for grad_name, ours, theirs in zip(GRAD_NAMES, fused, titan):
        stats[f"{grad_name}_vs_titan"] = rel_diff(ours, theirs)
    del titan
    bitwise("grads_fused_vs_sequential", fused, backward("sequential"))
    if tuned is not None:
        bitwise("grads_tuned_vs_default", fused, backward("fused", *tuned))
    del fused
    stats.update(check_float64(inputs, fwd_ws, bwd_ws, args, group, dev))
    return max_over_group(stats, group, dev)


def check_float64(inputs, fwd_ws, bwd_ws, args, group, dev, max_experts: int = 4) -> dict[str, float]:
    """The fused forward + backward of every rank's first ``--check-tokens``
    tokens against the float64 oracle: dx and the score gradients of this
    rank's tokens, and the weight gradients of (at most ``max_experts``, the
    most loaded) local experts, which sum over every rank's subsample
    (gathered here)."""
    n = min(args.check_tokens, inputs["x"].shape[0])
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    sb = args.score_before
    sub = {k: inputs[k][:n].contiguous() for k in ("x", "grad", "scores", "indices")}
    local = (inputs["w1l"], inputs["w2l"], inputs["w3l"])
    h13 = torch.empty(fwd_ws.shape.slot_capacity, 2 * local[0].shape[1], dtype=sub["x"].dtype, device=dev)
    moe_forward(sub["x"], sub["scores"], sub["indices"], *local, workspace=fwd_ws, schedule="fused",
                score_before_experts=sb, saved_h13=h13)
    ours = moe_backward(sub["grad"], sub["x"], sub["scores"], sub["indices"], *local, workspace=bwd_ws,
                        schedule="fused", score_before_experts=sb, saved_h13=h13, error_check="sync")
    weights = (inputs["w1"], inputs["w2"], inputs["w3"])
    dx, dscores, _, _, _ = float64_moe_backward_oracle(sub["x"], sub["scores"], sub["indices"], sub["grad"],
                                                       *weights, score_before_experts=sb, weight_grads=False)
    stats = {"dx_vs_float64": rel_diff(ours[0], dx), "dscores_vs_float64": rel_diff(ours[1], dscores)}
    every = {k: torch.empty(world * n, *v.shape[1:], dtype=v.dtype, device=dev) for k, v in sub.items()}
    for k, v in sub.items():
        dist.all_gather_into_tensor(every[k], v, group=group)
    num_local = local[0].shape[0]
    mine = range(rank * num_local, (rank + 1) * num_local)
    load = torch.bincount(every["indices"].flatten(), minlength=world * num_local)[mine.start:mine.stop]
    picked = sorted(load.argsort(descending=True)[:max_experts].tolist())
    _, _, dw1, dw2, dw3 = float64_moe_backward_oracle(every["x"], every["scores"], every["indices"], every["grad"],
                                                      *weights, score_before_experts=sb,
                                                      experts=[mine.start + e for e in picked])
    for name, got, want in zip(("dw1", "dw2", "dw3"), ours[2:], (dw1, dw2, dw3)):
        stats[f"{name}_vs_float64"] = rel_diff(got[picked], want)
    return stats


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_argument(parser, default=("qwen3", "deepseek"))
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2, help="rounds of alternating path order")
    parser.add_argument("--score-before", action="store_true")
    parser.add_argument("--check", action="store_true",
                        help="bitwise across schedules, close to TorchTitan and float64; exit 1 beyond the limits")
    parser.add_argument("--check-tokens", type=int, default=256, help="tokens per rank of the float64 check")
    parser.add_argument("--json-out", default=None)
    parser.add_argument("--profile", action="store_true", help="rank 0: one call's kernels, in order")
    parser.add_argument("--sweep-params", default="[]",
                        help="JSON list of LayerParams overrides whose fused backward to time")
    parser.add_argument("--tuned-cache", default=None,
                        help="tuning cache whose entries to time as uniep_tuned (default: the cache's default path)")
    parser.add_argument("--report", default=None, metavar="DIR", help="write backward.md and PNG plots into DIR")
    parser.add_argument("--constants", default="", help="the tuning model's hardware constants (report)")
    return parser


def main(argv=None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    require_gpu_under_torchrun(parser, PROG, "titan_uniep.tools.bench_backward")
    if args.tuned_cache is None:
        from titan_uniep.tuning.cache import default_cache_path

        args.tuned_cache = default_cache_path()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dev = torch.device("cuda", local_rank)
    dist.init_process_group("nccl", device_id=dev)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cuda", (dist.get_world_size(),), mesh_dim_names=("ep",))
    group = dist.group.WORLD
    args.peak_tflops = measured_peak_tflops(dev)
    if dist.get_rank() == 0:
        print(f"bf16 peak measured here: {args.peak_tflops:.0f} TF/s (8192^3 matmul)", flush=True)
    results = []
    for name, shape in args.shapes:
        res = bench_shape(name, shape, args, group, mesh, dev)
        results.append(res)
        torch.cuda.empty_cache()
        if dist.get_rank() == 0:
            print("JSON " + json.dumps(res), flush=True)
            if args.json_out:
                with open(args.json_out, "a") as f:
                    f.write(json.dumps(res) + "\n")
    rank = dist.get_rank()
    if rank == 0:
        keys = ("titan_ep", "uniep_sequential", "uniep_fused", "uniep_tuned", "uniep_sequential_bwd",
                "uniep_fused_bwd", "uniep_tuned_bwd", "gemm_only", LIGER, "speedup_uniep_fused_vs_titan",
                f"speedup_uniep_fused_vs_{LIGER}", "uniep_fused_tflops", "uniep_fused_share_of_peak")
        print("| shape | " + " | ".join(keys) + " |")
        print("|---" * (len(keys) + 1) + "|")
        for res in results:
            cells = [f"{res.get(k):.3f}" if res.get(k) else "-" for k in keys]
            print(f"| {res['shape']} | " + " | ".join(cells) + " |")
        if args.report:
            from titan_uniep.tools.report import write_report

            for path in write_report(args.report, results, "backward"):
                print(f"wrote {path}", flush=True)
    dist.destroy_process_group()
    enforce(results, verbose=rank == 0)


if __name__ == "__main__":
    main()
