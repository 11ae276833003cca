"""One-GPU probe: forward megakernels with and without the h1|h3 store (simulated EP=2 world).

Kernel times (torch profiler) of one sequential and one fused forward per mode.

    python scripts/probe_forward_save.py [--shape mixtral]
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from titan_uniep.fused import simulated_moe_forward
from titan_uniep.symm import Workspace

from probe_common import simulated_world, time_ms


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="mixtral")
    args = ap.parse_args()
    world = simulated_world(args.shape)
    t, d, h, e, k = (world[n] for n in "tdhek")
    w, dev = 2, torch.device("cuda")
    xs, scores, indices = world["xs"], world["scores"], world["indices"]
    w1s, w2s, w3s = world["w1s"], world["w2s"], world["w3s"]
    ws = Workspace.simulated(w, num_tokens=t, dim=d, hidden=h, num_experts=e, top_k=k, dtype=torch.bfloat16,
                             device=dev)
    h13 = torch.empty(w, ws.shape.slot_capacity, 2 * h, device=dev, dtype=torch.bfloat16)
    outs = {}
    for schedule in ("sequential", "fused"):
        for save in (False, True):
            def call():
                return simulated_moe_forward(xs, scores, indices, w1s, w2s, w3s, schedule=schedule,
                                             score_before_experts=False, workspace=ws,
                                             saved_h13=h13 if save else None)
            for _ in range(2):
                o = call()
            outs[(schedule, save)] = [x.clone() for x in o]
            median = time_ms(call, reps=5, warmup=0)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                call()
                torch.cuda.synchronize()
            kern = defaultdict(float)
            for ev in prof.events():
                if ev.device_type.name == "CUDA":
                    kern[ev.name[:40]] += ev.device_time / 1000
            top = sorted(kern.items(), key=lambda kv: -kv[1])[:4]
            print(f"{args.shape} {schedule:10s} save={save!s:5s} median {median:.2f} ms; kernels: "
                  + ", ".join(f"{n} {v:.2f}" for n, v in top), flush=True)
    same = all(torch.equal(a, b) for a, b in zip(outs[("sequential", True)], outs[("fused", True)]))
    same2 = all(torch.equal(a, b) for a, b in zip(outs[("fused", False)], outs[("fused", True)]))
    print(f"fused == sequential (saving): {same}; saving changes no output bit: {same2}")


if __name__ == "__main__":
    main()
