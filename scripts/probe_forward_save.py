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

SHAPES = {"qwen3": (8192, 2048, 768, 128, 8), "deepseek": (4096, 7168, 2048, 256, 8),
          "mixtral": (8192, 4096, 14336, 8, 2)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="mixtral")
    args = ap.parse_args()
    t, d, h, e, k = SHAPES[args.shape]
    w, el, dev = 2, e // 2, torch.device("cuda")
    torch.manual_seed(0)
    xs = [torch.randn(t, d, device=dev, dtype=torch.bfloat16) for _ in range(w)]
    scores, indices = [], []
    for _ in range(w):
        s, i = torch.randn(t, e, device=dev).softmax(-1).topk(k, dim=-1)
        scores.append(s)
        indices.append(i)
    w1s = [torch.randn(el, h, d, device=dev, dtype=torch.bfloat16) * d ** -0.5 for _ in range(w)]
    w3s = [torch.randn(el, h, d, device=dev, dtype=torch.bfloat16) * d ** -0.5 for _ in range(w)]
    w2s = [torch.randn(el, d, h, device=dev, dtype=torch.bfloat16) * h ** -0.5 for _ in range(w)]
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
            torch.cuda.synchronize()
            times = []
            for _ in range(5):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                call()
                b.record()
                torch.cuda.synchronize()
                times.append(a.elapsed_time(b))
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                call()
                torch.cuda.synchronize()
            kern = defaultdict(float)
            for ev in prof.events():
                if ev.device_type.name == "CUDA":
                    kern[ev.name[:40]] += ev.device_time / 1000
            top = sorted(kern.items(), key=lambda kv: -kv[1])[:4]
            print(f"{args.shape} {schedule:10s} save={save!s:5s} median {sorted(times)[2]:.2f} ms; kernels: "
                  + ", ".join(f"{n} {v:.2f}" for n, v in top), flush=True)
    same = all(torch.equal(a, b) for a, b in zip(outs[("sequential", True)], outs[("fused", True)]))
    same2 = all(torch.equal(a, b) for a, b in zip(outs[("fused", False)], outs[("fused", True)]))
    print(f"fused == sequential (saving): {same}; saving changes no output bit: {same2}")


if __name__ == "__main__":
    main()
