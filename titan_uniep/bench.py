"""Forward benchmark of one MoE layer's routed-expert path on an EP group.

    torchrun --nproc_per_node 2 -m titan_uniep.bench --shapes qwen3,deepseek,mixtral --routing balanced --check

For each shape (``T`` tokens per rank, dim ``D``, expert hidden ``H``, ``E``
experts, top-``K``), on the same inputs and routing:

- ``titan_ep``: TorchTitan 0.2.2 standard EP -- ``MoE.forward`` after the
  router (TokenReorderer, gather, experts, unsort, combine) with
  ``ExpertParallel`` applied to a ``GroupedExperts`` on the EP mesh;
- ``uniep_sequential`` / ``uniep_fused``: ``titan_uniep.runtime.moe_forward``
  (counts exchange + layout + both megakernels);
- ``gemm_only``: ``torch._grouped_mm`` fc1 (w1, w3), SwiGLU and fc2 on the rows
  this rank receives (groups padded to 8 rows, as TorchTitan does);
- ``transfer_only``: a bare peer copy (symmetric memory, ``copy_``) of the
  bytes UniEP sends to other ranks: de-duplicated token rows + expert outputs;
- ``bound = max(gemm_only, transfer_only)``, and ratios.

Times: CUDA events around each call, warm-up first, median over ``--reps``,
slowest rank. One JSON line per shape (prefixed ``JSON``), then a table.
``--check`` compares UniEP (and TorchTitan) with a float64 reference on the
first ``--check-tokens`` tokens of every rank, and fused with sequential bitwise.
``--profile`` prints rank 0's CUDA kernel times of both schedules (first
shape); ``--sweep-params`` times the fused schedule at other parameter points;
``--graph`` also times both schedules replayed from a CUDA graph (no Python
launch overhead: the eager layer issues ~45 small launches per call, and on
qwen3-like shapes the host, not the GPU, sets the pace).
"""

from __future__ import annotations

import argparse
import sys
import json
import os
from datetime import date

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .params import apply_overrides, default_params
from .runtime import Workspace, exchange_bytes, moe_forward
from .timing import time_ms
from .layout import compute_layout, count_per_expert, token_destinations
from .oracle import float64_moe_oracle

SHAPES = {  # T per rank, D, H, E, K
    "qwen3": (8192, 2048, 768, 128, 8),
    "deepseek": (4096, 7168, 2048, 256, 8),
    "mixtral": (8192, 4096, 14336, 8, 2),
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def make_routing(kind: str, num_tokens: int, num_experts: int, top_k: int, gen, dev):
    """Router-like ``(scores (T, K) fp32, indices (T, K) int64)``.
    balanced: random logits; skewed: the first E/8 experts get +3 (all on
    rank 0); zipf: logit bias -1.2 log(e + 1) (popularity falls as a power law)."""
    logits = torch.randn(num_tokens, num_experts, generator=gen, device=dev)
    expert = torch.arange(num_experts, device=dev, dtype=torch.float32)
    if kind == "skewed":
        logits[:, : max(1, num_experts // 8)] += 3.0
    elif kind == "zipf":
        logits -= 1.2 * torch.log(expert + 1.0)
    elif kind != "balanced":
        raise ValueError(f"--routing must be balanced, skewed or zipf, got {kind!r}")
    probs = torch.softmax(logits, dim=1)
    scores, indices = probs.topk(top_k, dim=1)
    return scores.contiguous(), indices.contiguous()


def titan_ep_path(dim, hidden, num_experts, top_k, w1, w2, w3, mesh, score_before: bool):
    """TorchTitan 0.2.2 MoE.forward after the router, with ExpertParallel."""
    from torch.distributed.tensor.parallel import parallelize_module
    from torchtitan.distributed.expert_parallel import ExpertParallel
    from torchtitan.models.moe.moe import GroupedExperts, TokenReorderer

    with torch.device("meta"):
        experts = GroupedExperts(dim, hidden, num_experts, use_grouped_mm=True)
    experts.w1 = torch.nn.Parameter(w1, requires_grad=False)
    experts.w2 = torch.nn.Parameter(w2, requires_grad=False)
    experts.w3 = torch.nn.Parameter(w3, requires_grad=False)
    parallelize_module(experts, mesh, ExpertParallel())
    reorderer = TokenReorderer(num_experts=num_experts, top_k=top_k)

    def forward(x, top_scores, selected_experts_indices):
        # Lines of torchtitan/models/moe/moe.py MoE.forward (0.2.2), router excluded.
        top_scores_sorted, token_indices_sorted, num_tokens_per_expert = reorderer(top_scores, selected_experts_indices)
        routed_input = x[token_indices_sorted // top_k]
        if score_before:
            routed_input = (routed_input.to(torch.float32) * top_scores_sorted.reshape(-1, 1)).to(x.dtype)
        routed_output = experts(routed_input, num_tokens_per_expert)
        unsorted = torch.zeros((x.shape[0] * top_k, x.shape[1]), dtype=routed_output.dtype, device=x.device)
        unsorted[token_indices_sorted] = routed_output
        unsorted = unsorted.reshape(-1, top_k, x.shape[1])
        if not score_before:
            return torch.bmm(top_scores.reshape(-1, 1, top_k), unsorted.float()).to(x.dtype).squeeze(1)
        return unsorted.sum(dim=1)

    return forward


def gemm_only_path(tokens_per_local_expert, w1l, w2l, w3l, dim, dtype, gen, dev):
    sizes = (tokens_per_local_expert + 7) // 8 * 8
    offsets = torch.cumsum(sizes, 0).to(torch.int32)
    rows = torch.randn(int(sizes.sum()), dim, generator=gen, device=dev).to(dtype)
    w1t, w2t, w3t = w1l.transpose(-2, -1), w2l.transpose(-2, -1), w3l.transpose(-2, -1)

    def forward():
        h = F.silu(torch._grouped_mm(rows, w1t, offs=offsets)) * torch._grouped_mm(rows, w3t, offs=offsets)
        return torch._grouped_mm(h, w2t, offs=offsets)

    return forward


def transfer_only_path(bytes_to_peer: list[int], group, dev):
    """Copy ``bytes_to_peer[p]`` bytes into every other rank's symmetric buffer."""
    import torch.distributed._symmetric_memory as symm_mem

    world, rank = dist.get_world_size(group), dist.get_rank(group)
    most = max(1, max(bytes_to_peer))
    counts = torch.tensor([most], device=dev)
    dist.all_reduce(counts, op=dist.ReduceOp.MAX, group=group)
    region = int(counts.item() + 255) // 256 * 256
    buf = symm_mem.empty(world * region, dtype=torch.uint8, device=dev)
    handle = symm_mem.rendezvous(buf, group)
    src = torch.randint(0, 255, (region,), dtype=torch.uint8, device=dev)
    copies = []
    for peer in range(world):
        if peer != rank and bytes_to_peer[peer]:
            dst = handle.get_buffer(peer, (region,), torch.uint8, storage_offset=rank * region)
            copies.append((dst[: bytes_to_peer[peer]], src[: bytes_to_peer[peer]]))

    def forward():
        for dst, s in copies:
            dst.copy_(s)

    return forward, (buf, handle)


def bench_shape(name, shape, args, group, mesh, dev):
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    num_tokens, dim, hidden, num_experts, top_k = shape
    dtype = DTYPES[args.dtype]
    el = num_experts // world
    wgen = torch.Generator(device=dev).manual_seed(args.seed)  # same weights on every rank
    w1 = (torch.randn(num_experts, hidden, dim, generator=wgen, device=dev) * dim**-0.5).to(dtype)
    w3 = (torch.randn(num_experts, hidden, dim, generator=wgen, device=dev) * dim**-0.5).to(dtype)
    w2 = (torch.randn(num_experts, dim, hidden, generator=wgen, device=dev) * hidden**-0.5).to(dtype)
    w1l, w2l, w3l = (w[rank * el:(rank + 1) * el] for w in (w1, w2, w3))
    gen = torch.Generator(device=dev).manual_seed(args.seed * 1000 + rank)
    x = torch.randn(num_tokens, dim, generator=gen, device=dev).to(dtype)
    scores, indices = make_routing(args.routing, num_tokens, num_experts, top_k, gen, dev)

    # What moves and what each rank computes (host sync is fine here).
    counts = count_per_expert(indices, num_experts).to(dev)
    counts_all = torch.empty(world, num_experts, dtype=torch.int64, device=dev)
    dist.all_gather_into_tensor(counts_all, counts, group=group)
    layout = compute_layout(indices, counts_all, rank)
    sent = {k: int(v) for k, v in exchange_bytes(layout, dim, x.element_size()).items()}
    dedup_rows = token_destinations(layout).sum(0).tolist()
    bytes_to_peer = [(dedup_rows[p] + int(layout.recv_counts[p])) * dim * x.element_size() for p in range(world)]
    bytes_to_peer[rank] = 0
    received_rows = int(layout.expert_offsets[-1])

    # The shipped per-shape default, as the custom op runs it, with the --set overrides.
    params = apply_overrides(default_params(world, hidden=hidden), args.set)
    sweep = [params.replace(**change) for change in json.loads(args.sweep_params)]
    # A workspace built for the presum combine serves every combine mode.
    needs_y = any(point.combine != "direct" for point in (params, *sweep))
    ws = Workspace.for_group(group, num_tokens=num_tokens, dim=dim, hidden=hidden, num_experts=num_experts,
                             top_k=top_k, dtype=dtype, device=dev,
                             params=params.replace(combine="presum") if needs_y else params)
    sb = args.score_before

    def uniep(schedule):
        return lambda: moe_forward(x, scores, indices, w1l, w2l, w3l, workspace=ws, schedule=schedule,
                                   score_before_experts=sb, params=params, error_check="lazy")

    titan = titan_ep_path(dim, hidden, num_experts, top_k, w1, w2, w3, mesh, sb)
    gemm = gemm_only_path(layout.tokens_per_local_expert, w1l, w2l, w3l, dim, dtype, gen, dev)
    transfer, keep_alive = transfer_only_path(bytes_to_peer, group, dev)

    record = dict(
        date=str(date.today()), shape=name, tokens=num_tokens, dim=dim, hidden=hidden, experts=num_experts,
        top_k=top_k, routing=args.routing, dtype=args.dtype, world=world, score_before_experts=sb,
        received_rows_rank=received_rows, **{f"{k}_bytes_rank{rank}": v for k, v in sent.items()},
        workspace_bytes=ws.memory_bytes()["total"],
    )
    with torch.no_grad():
        record["uniep_fused_ms"] = time_ms(uniep("fused"), args.warmup, args.reps)
        record["uniep_sequential_ms"] = time_ms(uniep("sequential"), args.warmup, args.reps)
        ws.check_errors()
        if args.graph:
            for schedule in ("fused", "sequential"):
                record[f"uniep_{schedule}_graph_ms"] = time_ms(graph_replay(uniep(schedule)), args.warmup, args.reps)
            ws.check_errors()
        record["titan_ep_ms"] = time_ms(lambda: titan(x, scores, indices), args.warmup, args.reps)
        record["gemm_only_ms"] = time_ms(gemm, args.warmup, args.reps)
        record["transfer_only_ms"] = time_ms(transfer, args.warmup, args.reps)
        if args.check:
            record.update(check(x, scores, indices, w1, w2, w3, w1l, w2l, w3l, ws, params, titan, args, group))
        for change, point in zip(json.loads(args.sweep_params), sweep):
            key = "sweep_fused_ms[" + ",".join(f"{k}={v}" for k, v in change.items()) + "]"
            record[key] = time_ms(
                lambda point=point: moe_forward(x, scores, indices, w1l, w2l, w3l, workspace=ws, schedule="fused",
                                                score_before_experts=sb, params=point, error_check="lazy"),
                args.warmup, args.reps)
            ws.check_errors()
        if args.profile and name == next(iter(args.shape_names)):
            profile_kernels(uniep, rank)
    flops = 2 * 3 * dim * hidden * received_rows
    total_flops = torch.tensor([flops], device=dev, dtype=torch.float64)
    dist.all_reduce(total_flops, op=dist.ReduceOp.MAX, group=group)
    record["gemm_tflops_slowest_rank"] = total_flops.item() / record["gemm_only_ms"] / 1e9
    record["bound_ms"] = max(record["gemm_only_ms"], record["transfer_only_ms"])
    record["speedup_fused_vs_titan"] = record["titan_ep_ms"] / record["uniep_fused_ms"]
    record["speedup_sequential_vs_titan"] = record["titan_ep_ms"] / record["uniep_sequential_ms"]
    record["fused_over_gemm_only"] = record["uniep_fused_ms"] / record["gemm_only_ms"]
    record["fused_over_bound"] = record["uniep_fused_ms"] / record["bound_ms"]
    del ws, keep_alive
    torch.cuda.empty_cache()
    return record


def graph_replay(fn):
    """Capture one call of ``fn`` in a CUDA graph (after a warm-up on a side
    stream, as torch.cuda.graph requires) and return the replay callable."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    dist.barrier()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def profile_kernels(uniep, rank):
    """Rank 0 prints its CUDA kernel times for a few calls of each schedule."""
    from torch.profiler import ProfilerActivity, profile

    for schedule in ("fused", "sequential"):
        fn = uniep(schedule)
        fn()
        torch.cuda.synchronize()
        dist.barrier()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
        if rank == 0:
            print(f"PROFILE {schedule} (3 calls, rank 0)")
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60))


def check(x, scores, indices, w1, w2, w3, w1l, w2l, w3l, ws, params, titan, args, group):
    n = min(args.check_tokens, x.shape[0])
    outs = {s: moe_forward(x, scores, indices, w1l, w2l, w3l, workspace=ws, schedule=s,
                           score_before_experts=args.score_before, params=params, error_check="sync")
            for s in ("sequential", "fused")}
    tt = titan(x, scores, indices)
    exact = float64_moe_oracle(x[:n], scores[:n], indices[:n], w1, w2, w3, score_before_experts=args.score_before)
    scale = exact.abs().max().clamp_min(1e-30)
    stats = torch.tensor([
        float(not torch.equal(outs["sequential"], outs["fused"])),
        ((outs["fused"][:n].double() - exact).abs().max() / scale).item(),
        ((tt[:n].double() - exact).abs().max() / scale).item(),
        ((outs["fused"].double() - tt.double()).abs().max() / tt.double().abs().max()).item(),
    ], device=x.device, dtype=torch.float64)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX, group=group)
    return dict(
        check_fused_equals_sequential=stats[0].item() == 0.0,
        check_fused_rel_err_vs_f64=stats[1].item(),
        check_titan_rel_err_vs_f64=stats[2].item(),
        check_fused_vs_titan_rel_diff=stats[3].item(),
    )


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--backward" in argv:
        # Forward + backward side by side lives in its own module.
        from titan_uniep.bench_backward import main as backward_main

        argv.remove("--backward")
        return backward_main(argv)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backward", action="store_true", help="forward + backward (titan_uniep.bench_backward)")
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per rank")
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--shapes", type=str, default="", help=f"comma list of {', '.join(SHAPES)} (overrides the sizes)")
    parser.add_argument("--routing", choices=("balanced", "skewed", "zipf"), default="balanced")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="bf16")
    parser.add_argument("--score-before", action="store_true", help="scores multiply the expert inputs")
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--check-tokens", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="override a LayerParams field of the default point (repeatable)")
    parser.add_argument("--sweep-params", default="[]",
                        help='JSON list of LayerParams overrides whose fused forward to time too, e.g. '
                             '\'[{"dispatch_programs": 32}, {"combine": "staged"}]\'')
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--graph", action="store_true", help="also time CUDA-graph replays of the UniEP forward")
    parser.add_argument("--json-out", type=str, default="", help="also append the JSON lines to this file")
    args = parser.parse_args(argv)

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dev = torch.device("cuda", local_rank)
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", device_id=dev)
    group = dist.group.WORLD
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cuda", (dist.get_world_size(),), mesh_dim_names=("ep",))
    if args.shapes:
        shapes = {name: SHAPES[name] for name in args.shapes.split(",")}
    else:
        shapes = {"custom": (args.tokens, args.dim, args.hidden, args.experts, args.topk)}
    args.shape_names = list(shapes)
    records = []
    for name, shape in shapes.items():
        record = bench_shape(name, shape, args, group, mesh, dev)
        records.append(record)
        if dist.get_rank() == 0:
            line = json.dumps(record)
            print("JSON " + line, flush=True)
            if args.json_out:
                with open(args.json_out, "a") as f:
                    f.write(line + "\n")
    if dist.get_rank() == 0:
        cols = ("titan_ep_ms", "uniep_sequential_ms", "uniep_fused_ms", "gemm_only_ms", "transfer_only_ms",
                "bound_ms", "speedup_fused_vs_titan", "fused_over_gemm_only", "fused_over_bound")
        if args.graph:
            cols += ("uniep_sequential_graph_ms", "uniep_fused_graph_ms")
        print("| shape | " + " | ".join(cols) + " |")
        for r in records:
            print(f"| {r['shape']} | " + " | ".join(f"{r[c]:.3f}" for c in cols) + " |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
