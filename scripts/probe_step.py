"""Two-GPU probe of one fused forward + backward step of the layer (as
``titan_uniep.bench_backward`` times it): the step, the forward with the
h1 | h3 store alone and the backward alone (CUDA events, median, slowest
rank), then each rank's kernel timeline of one profiled step with the idle
gaps between kernels.

    torchrun --nproc_per_node 2 scripts/probe_step.py --shape qwen3
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from titan_uniep.bench_backward import SHAPES, layer_inputs, time_ms
from titan_uniep.fused import moe_forward
from titan_uniep.fused_backward import BackwardWorkspace, moe_backward
from titan_uniep.symm import Workspace


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", device_id=dev)
    group, rank, world = dist.group.WORLD, dist.get_rank(), dist.get_world_size()
    t, d, h, e, k = SHAPES[args.shape]
    inputs = layer_inputs(SHAPES[args.shape], rank, world, dev)
    x, grad, scores, indices = (inputs[n] for n in ("x", "grad", "scores", "indices"))
    w1, w2, w3 = inputs["w1l"], inputs["w2l"], inputs["w3l"]
    fwd_ws = Workspace.for_group(group, num_tokens=t, dim=d, hidden=h, num_experts=e, top_k=k,
                                 dtype=torch.bfloat16, device=dev)
    bwd_ws = BackwardWorkspace.for_group(group, num_tokens=t, dim=d, hidden=h, num_experts=e, top_k=k,
                                         dtype=torch.bfloat16, device=dev)
    h13 = torch.empty(fwd_ws.shape.slot_capacity, 2 * h, dtype=torch.bfloat16, device=dev)

    def forward(save=True):
        moe_forward(x, scores, indices, w1, w2, w3, workspace=fwd_ws, schedule="fused", score_before_experts=False,
                    saved_h13=h13 if save else None)

    def backward():
        moe_backward(grad, x, scores, indices, w1, w2, w3, workspace=bwd_ws, schedule="fused",
                     score_before_experts=False, saved_h13=h13)

    def step():
        forward()
        backward()

    times = {name: round(time_ms(fn, 3, args.reps), 3) for name, fn in (
        ("step", step), ("forward_saving_h13", forward), ("forward_no_save", lambda: forward(False)),
        ("backward", backward), ("step_again", step))}
    if rank == 0:
        print("STEP " + " ".join(f"{n}={v}" for n, v in times.items()), flush=True)
    step()
    torch.cuda.synchronize()
    dist.barrier()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
    t0 = kernels[0].time_range.start
    end = t0
    lines, idle = [], 0.0
    for e in kernels:
        gap = (e.time_range.start - end) / 1e3
        if gap > 0.005:
            idle += gap
        lines.append(f"  +{(e.time_range.start - t0) / 1e3:7.3f} ms  gap {max(gap, 0):6.3f}  "
                     f"{e.time_range.elapsed_us() / 1e3:7.3f} ms  {e.name[:60]}")
        end = max(end, e.time_range.end)
    for r in range(world):
        if r == rank:
            print(f"TIMELINE rank {rank}: span {(end - t0) / 1e3:.3f} ms, idle gaps {idle:.3f} ms", flush=True)
            print("\n".join(lines), flush=True)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
