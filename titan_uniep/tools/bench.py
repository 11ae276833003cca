"""Forward benchmark of one MoE layer's routed-expert path on an EP group.

    torchrun --nproc_per_node 2 -m titan_uniep.tools.bench --shape qwen3 --shape deepseek --shape mixtral --check
    torchrun --nproc_per_node 1 -m titan_uniep.tools.bench --shape qwen3_1gpu --shape 8192,2880,1440,64,4 --report out/r

For each ``--shape`` (``T`` tokens per rank, dim ``D``, expert hidden ``H``,
``E`` experts, top-``K``: a name of ``titan_uniep.shapes`` or ``T,D,H,E,K``;
default qwen3), on the same inputs and routing:

- ``titan_ep``: TorchTitan 0.2.2 standard EP -- ``MoE.forward`` after the
  router (TokenReorderer, gather, experts, unsort, combine) with
  ``ExpertParallel`` applied to a ``GroupedExperts`` on the EP mesh;
- ``uniep_sequential`` / ``uniep_fused``: ``titan_uniep.runtime.moe_forward``
  (counts exchange + layout + both megakernels) at the default point, as
  the custom op runs it in training: h1 | h3 saved for the backward, the
  schedule's default error check;
- ``uniep_tuned``: the fused schedule at the tuned point of the tuning cache
  (``--tuned-cache``, default the cache's default path), if it has an entry
  for the shape here (the record says why not otherwise);
- ``gemm_only``: ``torch._grouped_mm`` fc1 (w1, w3), SwiGLU and fc2 on the rows
  this rank receives (groups padded to 8 rows, as TorchTitan does);
- ``transfer_only``: a bare peer copy (symmetric memory, ``copy_``) of the
  bytes UniEP sends to other ranks: de-duplicated token rows + expert outputs;
- ``liger_fused_moe``: Liger-Kernel's fused MoE, a Triton peer (EP = 1 and
  scores after the experts only; ``titan_uniep.tools.peers``; the record
  says why it did not run otherwise);
- ``bound = max(gemm_only, transfer_only)``, and ratios; the TF/s of every
  path (the expert GEMMs' FLOPs of the slowest rank) and their share of the
  bf16 peak measured in the same run (an ``8192^3`` matmul).

Times: CUDA events around each call, warm-up first, median over ``--reps``,
slowest rank, in ``--rounds`` rounds of alternating path order
(``timing.time_alternating``: no path is always measured right after
itself). One JSON line per shape (prefixed ``JSON``), then a table.
``--check`` asserts fused == sequential (and tuned == default) bitwise,
UniEP against TorchTitan, and both against a float64 reference on the
first ``--check-tokens`` tokens of every rank (limits: ``titan_uniep.accuracy``);
it exits 1 beyond them. ``--report DIR`` writes ``forward.md`` and a PNG per
shape there (``titan_uniep.tools.report``), with the tuning model's prediction.
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

from titan_uniep.accuracy import LIMITS, enforce, failures, max_over_group, rel_diff
from titan_uniep.layout import compute_layout, count_per_expert, token_destinations
from titan_uniep.oracle import float64_moe_oracle
from titan_uniep.params import apply_overrides, default_params
from titan_uniep.runtime import Workspace, exchange_bytes, moe_forward
from titan_uniep.shapes import add_shape_argument
from titan_uniep.timing import time_alternating, time_ms
from titan_uniep.tools import require_gpu_under_torchrun
from titan_uniep.tools.peers import LIGER, liger_forward, liger_unavailable, measured_peak_tflops

__all__ = ["bench_shape", "build_parser", "check", "main"]

PROG = "python3 -m titan_uniep.tools.bench"
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
    tuned, tuned_reason = None, "no tuning cache given"
    if args.tuned_cache:
        from titan_uniep.tools.bench_backward import tuned_points

        tuned, tuned_reason = tuned_points(args.tuned_cache, shape, world, dtype, dev, args.score_before)["forward"]
    sizes = dict(num_tokens=num_tokens, dim=dim, hidden=hidden, num_experts=num_experts, top_k=top_k, dtype=dtype,
                 device=dev)
    ws = Workspace.for_group(group, **sizes, params=params)
    tuned_ws = None if tuned is None else Workspace.for_group(group, **sizes, params=tuned)
    sb = args.score_before
    slots = ws.shape.slot_capacity

    def uniep(schedule, point=params, workspace=ws):
        # As the custom op runs it: h1 | h3 saved into a buffer of its own, the schedule's default error check.
        return lambda: moe_forward(x, scores, indices, w1l, w2l, w3l, workspace=workspace, schedule=schedule,
                                   score_before_experts=sb, params=point,
                                   saved_h13=x.new_empty(slots, 2 * hidden))

    def titan():
        path = titan_ep_path(dim, hidden, num_experts, top_k, w1, w2, w3, mesh, sb)
        return lambda: path(x, scores, indices)

    transfer, keep_alive = transfer_only_path(bytes_to_peer, group, dev)
    record = dict(
        date=str(date.today()), shape=name, tokens=num_tokens, dim=dim, hidden=hidden, experts=num_experts,
        top_k=top_k, routing=args.routing, dtype=args.dtype, world=world, score_before_experts=sb,
        gpu=torch.cuda.get_device_name(dev), received_rows_rank=received_rows,
        **{f"{k}_bytes_rank{rank}": v for k, v in sent.items()},
        workspace_bytes=ws.memory_bytes()["total"],
        tuned={"forward": {"applied": tuned is not None, "reason": tuned_reason}},
    )
    paths = {
        "uniep_fused_ms": lambda: uniep("fused"),
        "uniep_sequential_ms": lambda: uniep("sequential"),
        "titan_ep_ms": titan,
        "gemm_only_ms": lambda: gemm_only_path(layout.tokens_per_local_expert, w1l, w2l, w3l, dim, dtype, gen, dev),
        "transfer_only_ms": lambda: transfer,
    }
    if tuned is not None:
        paths["uniep_tuned_ms"] = lambda: uniep("fused", tuned, tuned_ws)
    liger_reason = liger_unavailable(world, sb)
    if liger_reason is None:
        paths[f"{LIGER}_ms"] = lambda: liger_forward(x, scores, indices, w1, w2, w3)
    else:
        record[f"{LIGER}_not_run"] = liger_reason
    for change, point in zip(json.loads(args.sweep_params), sweep):
        key = "sweep_fused_ms[" + ",".join(f"{k}={v}" for k, v in change.items()) + "]"
        paths[key] = lambda point=point: uniep("fused", point)

    def report_error(key, trace):
        if rank == 0:
            print(f"{name} {key} failed:\n{trace}", flush=True)

    with torch.no_grad():
        record.update(time_alternating(paths, warmup=args.warmup, reps=args.reps, rounds=args.rounds, group=group,
                                       on_error=report_error))
        ws.check_errors()
        if args.graph:
            for schedule in ("fused", "sequential"):
                record[f"uniep_{schedule}_graph_ms"] = time_ms(graph_replay(uniep(schedule)), args.warmup, args.reps)
            ws.check_errors()
        if args.check:
            record["check"] = check(x, scores, indices, w1, w2, w3, w1l, w2l, w3l, ws, params, titan(), args, group,
                                    tuned, tuned_ws)
            if liger_reason is None:
                fused = run_fused(x, scores, indices, w1l, w2l, w3l, ws, params, sb)
                record["check"][f"{LIGER}_out_vs_peer"] = rel_diff(
                    fused, liger_forward(x, scores, indices, w1, w2, w3)())
            record["check_failures"] = failures(record["check"], LIMITS["forward"][args.dtype])
        if args.profile and name == next(iter(args.shape_names)):
            profile_kernels(uniep, rank)
    if args.report:
        from titan_uniep.tuning.search import MoELayer, predictions

        points = {"default": params, **({"tuned": tuned} if tuned is not None else {})}
        record["model"] = predictions(MoELayer(name, *shape, sb, dtype), indices, group, points, args.constants)
    flops = 2 * 3 * dim * hidden * received_rows
    total_flops = torch.tensor([flops], device=dev, dtype=torch.float64)
    dist.all_reduce(total_flops, op=dist.ReduceOp.MAX, group=group)
    measured = {k: v for k, v in record.items() if k.endswith("_ms") and isinstance(v, float)}
    record["peak_tflops"] = args.peak_tflops
    for key, ms in measured.items():
        if key != "transfer_only_ms" and ms:
            tflops = total_flops.item() / ms / 1e9
            record[key.removesuffix("_ms") + "_tflops"] = tflops
            record[key.removesuffix("_ms") + "_share_of_peak"] = tflops / args.peak_tflops
    if {"gemm_only_ms", "transfer_only_ms"} <= set(measured):
        record["bound_ms"] = max(measured["gemm_only_ms"], measured["transfer_only_ms"])
    for key in ("uniep_fused_ms", "uniep_sequential_ms", "uniep_tuned_ms"):
        if key in measured and "titan_ep_ms" in measured:
            record[f"speedup_{key.removesuffix('_ms').removeprefix('uniep_')}_vs_titan"] = (
                measured["titan_ep_ms"] / measured[key])
    if "uniep_fused_ms" in measured and measured.get(f"{LIGER}_ms"):
        record[f"speedup_fused_vs_{LIGER}"] = measured[f"{LIGER}_ms"] / measured["uniep_fused_ms"]
    if "uniep_fused_ms" in measured:
        for key in ("gemm_only_ms", "bound_ms"):
            if record.get(key):
                record[f"fused_over_{key.removesuffix('_ms')}"] = measured["uniep_fused_ms"] / record[key]
    del keep_alive  # the transfer path's symmetric buffer
    return record


def run_fused(x, scores, indices, w1l, w2l, w3l, ws, params, score_before) -> torch.Tensor:
    """One fused forward at ``params``, errors checked (the peers' reference)."""
    return moe_forward(x, scores, indices, w1l, w2l, w3l, workspace=ws, schedule="fused",
                       score_before_experts=score_before, params=params, error_check="sync")


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


def check(x, scores, indices, w1, w2, w3, w1l, w2l, w3l, ws, params, titan, args, group,
          tuned=None, tuned_ws=None) -> dict[str, float]:
    """The ``--check`` statistics (maxima over the ranks; ``accuracy.failures``
    reads them): fused == sequential (and the tuned point == the default)
    bitwise, UniEP against TorchTitan on every token, both against float64 on
    the first ``--check-tokens`` tokens of every rank."""
    n = min(args.check_tokens, x.shape[0])
    slots = ws.shape.slot_capacity

    def run(schedule, point=params, workspace=ws):
        return moe_forward(x, scores, indices, w1l, w2l, w3l, workspace=workspace, schedule=schedule,
                           score_before_experts=args.score_before, params=point, error_check="sync",
                           saved_h13=x.new_empty(slots, 2 * w1.shape[1]))

    outs = {s: run(s) for s in ("sequential", "fused")}
    exact = float64_moe_oracle(x[:n], scores[:n], indices[:n], w1, w2, w3, score_before_experts=args.score_before)
    tuned_out = None if tuned is None else run("fused", tuned, tuned_ws)
    stats = forward_stats(outs["sequential"], outs["fused"], titan(), exact, tuned_out)
    return max_over_group(stats, group, x.device)


def forward_stats(sequential: torch.Tensor, fused: torch.Tensor, titan: torch.Tensor, exact: torch.Tensor,
                  tuned: torch.Tensor | None = None) -> dict[str, float]:
    """One rank's ``--check`` statistics of the forward (``accuracy.failures``
    names): the outputs ``(T, D)`` of both schedules, of TorchTitan's path and
    (optional) of the tuned point, and the float64 oracle of the first
    ``exact.shape[0]`` tokens."""
    n = exact.shape[0]
    stats = {
        "out_fused_vs_sequential_bitwise_diff": float(not torch.equal(sequential, fused)),
        "out_vs_float64": rel_diff(fused[:n], exact),
        "out_titan_vs_float64": rel_diff(titan[:n], exact),
        "out_vs_titan": rel_diff(fused, titan),
    }
    if tuned is not None:
        stats["out_tuned_vs_default_bitwise_diff"] = float(not torch.equal(tuned, fused))
    return stats


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backward", action="store_true", help="forward + backward (titan_uniep.tools.bench_backward)")
    add_shape_argument(parser, default=("qwen3",))
    parser.add_argument("--routing", choices=("balanced", "skewed", "zipf"), default="balanced")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="bf16")
    parser.add_argument("--score-before", action="store_true", help="scores multiply the expert inputs")
    parser.add_argument("--check", action="store_true",
                        help="bitwise, vs TorchTitan and vs float64; exit 1 beyond the limits (titan_uniep.accuracy)")
    parser.add_argument("--check-tokens", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2, help="rounds of alternating path order")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="override a LayerParams field of the default point (repeatable)")
    parser.add_argument("--sweep-params", default="[]",
                        help='JSON list of LayerParams overrides whose fused forward to time too, e.g. '
                             '\'[{"dispatch_programs": 32}, {"fc2_defer_release": true}]\'')
    parser.add_argument("--tuned-cache", default=None,
                        help="tuning cache whose entry to time as uniep_tuned (default: the cache's default path)")
    parser.add_argument("--report", default="", metavar="DIR", help="write forward.md and PNG plots into DIR")
    parser.add_argument("--constants", default="", help="the tuning model's hardware constants (report)")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--graph", action="store_true", help="also time CUDA-graph replays of the UniEP forward")
    parser.add_argument("--json-out", type=str, default="", help="also append the JSON lines to this file")
    return parser


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--backward" in argv:
        # Forward + backward side by side lives in its own module.
        from titan_uniep.tools.bench_backward import main as backward_main

        argv.remove("--backward")
        return backward_main(argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    require_gpu_under_torchrun(parser, PROG, "titan_uniep.tools.bench")
    if args.tuned_cache is None:
        from titan_uniep.tuning.cache import default_cache_path

        args.tuned_cache = default_cache_path()

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dev = torch.device("cuda", local_rank)
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", device_id=dev)
    group = dist.group.WORLD
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cuda", (dist.get_world_size(),), mesh_dim_names=("ep",))
    shapes = dict(args.shapes)
    args.shape_names = list(shapes)
    args.peak_tflops = measured_peak_tflops(dev)
    if dist.get_rank() == 0:
        print(f"bf16 peak measured here: {args.peak_tflops:.0f} TF/s (8192^3 matmul)", flush=True)
    records = []
    for name, shape in shapes.items():
        record = bench_shape(name, shape, args, group, mesh, dev)
        torch.cuda.empty_cache()  # the shape's workspaces and weights, before the next shape's
        records.append(record)
        if dist.get_rank() == 0:
            line = json.dumps(record)
            print("JSON " + line, flush=True)
            if args.json_out:
                with open(args.json_out, "a") as f:
                    f.write(line + "\n")
    rank = dist.get_rank()
    if rank == 0:
        cols = ("titan_ep_ms", "uniep_sequential_ms", "uniep_fused_ms", "uniep_tuned_ms", "gemm_only_ms",
                f"{LIGER}_ms", "transfer_only_ms", "bound_ms", "speedup_fused_vs_titan", f"speedup_fused_vs_{LIGER}",
                "fused_over_gemm_only", "fused_over_bound", "uniep_fused_tflops", "uniep_fused_share_of_peak")
        if args.graph:
            cols += ("uniep_sequential_graph_ms", "uniep_fused_graph_ms")
        print("| shape | " + " | ".join(cols) + " |")
        for r in records:
            print(f"| {r['shape']} | " + " | ".join("-" if r.get(c) is None else f"{r[c]:.3f}" for c in cols) + " |")
        if args.report:
            from titan_uniep.tools.report import write_report

            for path in write_report(args.report, records, "forward"):
                print(f"wrote {path}", flush=True)
    dist.destroy_process_group()
    enforce(records, verbose=rank == 0)


if __name__ == "__main__":
    main()
