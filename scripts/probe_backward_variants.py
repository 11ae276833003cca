"""One-GPU probe: the backward (h1 | h3 saved by the forward, the op's path)
of a simulated EP world for overrides of ``fused_backward.BACKWARD_TILES``,
measured in alternating order (A B A B ...): the fused call's median time,
and the kernel times of one profiled sequential call, by kernel name.

    python scripts/probe_backward_variants.py --shape qwen3 --variants '[{}, {"dh_copies_rows": true}]'

(``"_config": {...}``: ``KernelConfig`` changes, e.g. the reduce blocks, on
top of ``default_config(W)``.)

Every variant's gradients are compared bit for bit with the first one's.
In a simulated world both ranks' tasks share one GPU and "remote" stores are
local, so the communication share is not the 2-GPU one; kernels without
communication (GEMM tiles, passes, gathers) are comparable.
"""

from __future__ import annotations

import json
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from titan_uniep import fused_backward
from titan_uniep.fused_backward import simulated_moe_backward
from titan_uniep.kernels import default_config

from probe_common import saved_forward, simulated_world, time_ms, variant_args

KERNELS = ("dispatch_grad_hidden", "swiglu_backward", "grad_input_combine", "gather_slot_rows", "GroupMM",
           "grouped", "Kernel")


def main():
    args = variant_args()
    world = simulated_world(args.shape, tokens=args.tokens)
    t = world["t"]
    w = 2
    xs, gs, scores, indices = world["xs"], world["grads"], world["scores"], world["indices"]
    w1s, w2s, w3s = world["w1s"], world["w2s"], world["w3s"]
    _, h13, bws = saved_forward(world, w)
    base = dict(fused_backward.BACKWARD_TILES)
    variants = json.loads(args.variants)
    ref = None
    for rnd in range(args.rounds):
        for i, override in enumerate(variants):
            tiles = dict(override)
            config = default_config(w).replace(**tiles.pop("_config", {}))
            fused_backward.BACKWARD_TILES.clear()
            fused_backward.BACKWARD_TILES.update({**base, **tiles})
            try:
                def call(schedule):
                    return simulated_moe_backward(gs, xs, scores, indices, w1s, w2s, w3s, schedule=schedule,
                                                  score_before_experts=False, workspace=bws, saved_h13=h13,
                                                  config=config)
                fused_ms = time_ms(lambda: call("fused"), reps=args.reps)
                # (The outputs are fresh tensors: kept without copies, one variant's at a time.)
                out = call("fused")
                ref = out if ref is None else ref
                same = all(torch.equal(a, b) for ra, rb in zip(out, ref) for a, b in zip(ra, rb))
                del out
                seq = call("sequential")
                same_sched = all(torch.equal(a, b) for ra, rb in zip(seq, ref) for a, b in zip(ra, rb))
                del seq
                same_sched = same_sched if same else "n/a (differs from the first variant)"
                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    call("sequential")
                    torch.cuda.synchronize()
                times = defaultdict(float)
                for ev in prof.events():
                    if ev.device_type.name == "CUDA":
                        name = next((n for n in KERNELS if n in ev.name), "other")
                        times[name] += ev.device_time / 1000
                kern = " ".join(f"{n} {v:.3f}" for n, v in sorted(times.items(), key=lambda kv: -kv[1]))
                print(f"round {rnd} {args.shape} T={t} {json.dumps(override):40s} fused {fused_ms:7.3f} ms | "
                      f"sequential kernels (ms): {kern} | equal to the first variant {same}, "
                      f"sequential equal to it {same_sched}",
                      flush=True)
            except Exception as exc:  # noqa: BLE001 - a probe reports and goes on
                print(f"{args.shape} {json.dumps(override):40s} FAILED {type(exc).__name__}: {str(exc)[:300]}",
                      flush=True)
    fused_backward.BACKWARD_TILES.clear()
    fused_backward.BACKWARD_TILES.update(base)


if __name__ == "__main__":
    main()
