"""Two-GPU probe of the GEMM + combine megakernels (forward B: fc2 + combine,
backward BB: dA + combine) under tile and release variants, on one shape.

    torchrun --nproc_per_node 2 scripts/probe_combine.py --shape qwen3 \
        --forward '[{}, {"defer_release": true}]' --backward '[{}, {"da_defer_release": true}]'

Forward variants are ``KernelConfig`` changes on top of the shipped per-shape
config; backward variants are overrides of ``fused_backward.BACKWARD_TILES``
(``"_config": {...}``: ``KernelConfig`` changes for the backward, on top of
``default_config(W)``).
Per variant: the fused call's time (CUDA events, median, slowest rank), rank
0's kernel times of one fused call and of one sequential call (whose launches
are the phases), and whether fused == sequential bitwise and whether the
output equals the first variant's (other tiles may round differently).
Inputs: ``titan_uniep.bench_backward.layer_inputs`` (router-like routing).
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from titan_uniep import fused_backward
from titan_uniep.bench_backward import SHAPES, layer_inputs, time_ms
from titan_uniep.fused import moe_forward
from titan_uniep.fused_backward import BackwardWorkspace, moe_backward
from titan_uniep.kernels.tuning import default_config
from titan_uniep.symm import Workspace


def kernel_times(call, rank: int) -> list[tuple[str, float]]:
    call()
    torch.cuda.synchronize()
    dist.barrier()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return [(e.name[:40], round(e.time_range.elapsed_us() / 1e3, 3)) for e in kernels] if rank == 0 else []


def all_ranks(flag: bool, dev) -> bool:
    t = torch.tensor([int(flag)], device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3")
    ap.add_argument("--forward", default="[{}]")
    ap.add_argument("--backward", default="[]")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", device_id=dev)
    group, rank, world = dist.group.WORLD, dist.get_rank(), dist.get_world_size()
    t, d, h, e, k = SHAPES[args.shape]
    dtype = torch.bfloat16
    inputs = layer_inputs(SHAPES[args.shape], rank, world, dev, dtype)
    x, grad, scores, indices = (inputs[n] for n in ("x", "grad", "scores", "indices"))
    w1, w2, w3 = inputs["w1l"], inputs["w2l"], inputs["w3l"]
    fwd_ws = Workspace.for_group(group, num_tokens=t, dim=d, hidden=h, num_experts=e, top_k=k, dtype=dtype,
                                 device=dev)
    base = default_config(world, hidden=h)
    h13 = torch.empty(fwd_ws.shape.slot_capacity, 2 * h, dtype=dtype, device=dev)

    def forward(cfg, schedule):
        return moe_forward(x, scores, indices, w1, w2, w3, workspace=fwd_ws, schedule=schedule,
                           score_before_experts=False, config=cfg, saved_h13=h13)

    first = None
    for change in json.loads(args.forward):
        cfg = base.replace(**change)
        rec = {"shape": args.shape, "forward": change}
        try:
            rec["fused_ms"] = round(time_ms(lambda: forward(cfg, "fused"), args.warmup, args.reps), 3)
            rec["sequential_ms"] = round(time_ms(lambda: forward(cfg, "sequential"), args.warmup, args.reps), 3)
            rec["kernels_fused"] = kernel_times(lambda: forward(cfg, "fused"), rank)
            rec["kernels_sequential"] = kernel_times(lambda: forward(cfg, "sequential"), rank)
            fused, seq = forward(cfg, "fused").clone(), forward(cfg, "sequential").clone()
            rec["bitwise_fused_eq_sequential"] = all_ranks(torch.equal(fused, seq), dev)
            first = fused if first is None else first
            rec["equals_first_variant"] = all_ranks(torch.equal(fused, first), dev)
        except Exception as exc:  # noqa: BLE001 - report and go on with the next variant
            rec["error"] = repr(exc)[:300]
        if rank == 0:
            print("PROBE " + json.dumps(rec), flush=True)

    if not json.loads(args.backward):
        dist.destroy_process_group()
        return
    # The backward reads the h1 | h3 that the shipped forward saved.
    forward(base, "sequential")
    bwd_ws = BackwardWorkspace.for_group(group, num_tokens=t, dim=d, hidden=h, num_experts=e, top_k=k, dtype=dtype,
                                         device=dev)

    bwd_config = [default_config(world)]

    def backward(schedule):
        return moe_backward(grad, x, scores, indices, w1, w2, w3, workspace=bwd_ws, schedule=schedule,
                            score_before_experts=False, saved_h13=h13, config=bwd_config[0])

    tiles = dict(fused_backward.BACKWARD_TILES)
    first = None
    for change in json.loads(args.backward):
        label, change = change, dict(change)
        bwd_config[0] = default_config(world).replace(**change.pop("_config", {}))
        fused_backward.BACKWARD_TILES.update({**tiles, **change})
        rec = {"shape": args.shape, "backward": label}
        try:
            rec["fused_ms"] = round(time_ms(lambda: backward("fused"), args.warmup, args.reps), 3)
            rec["kernels_fused"] = kernel_times(lambda: backward("fused"), rank)
            rec["kernels_sequential"] = kernel_times(lambda: backward("sequential"), rank)
            fused = [g.clone() for g in backward("fused")]
            seq = backward("sequential")
            rec["bitwise_fused_eq_sequential"] = all_ranks(all(torch.equal(a, b) for a, b in zip(fused, seq)), dev)
            first = fused if first is None else first
            rec["equals_first_variant"] = all_ranks(all(torch.equal(a, b) for a, b in zip(fused, first)), dev)
        except Exception as exc:  # noqa: BLE001
            rec["error"] = repr(exc)[:300]
        finally:
            fused_backward.BACKWARD_TILES.clear()
            fused_backward.BACKWARD_TILES.update(tiles)
        if rank == 0:
            print("PROBE " + json.dumps(rec), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
