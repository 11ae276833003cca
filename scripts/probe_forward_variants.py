"""One-GPU probe: the forward megakernels of a simulated EP world for
``KernelConfig`` changes on top of the shipped per-shape config
(``default_config(W, hidden=H)``), in alternating order (A B A B ...): the
fused call's median time and the kernel times of one profiled sequential call,
launch by launch (route kernels, dispatch, fc1, fc2, reduce).

    python scripts/probe_forward_variants.py --shape qwen3 \\
        --variants '[{}, {"reduce_block_tokens": 8}, {"_save": true}]'

``"_save": true``: the forward also stores h1 | h3 (the custom op's path).
Outputs are compared bit for bit with the first variant's. Both ranks' tasks
share the GPU and "remote" stores are local (see probe_backward_variants.py).
"""

from __future__ import annotations

import json

import torch
from torch.profiler import ProfilerActivity, profile

from titan_uniep.fused import simulated_moe_forward
from titan_uniep.kernels import default_config
from titan_uniep.symm import Workspace

from probe_common import simulated_world, time_ms, variant_args


def main():
    args = variant_args()
    world = simulated_world(args.shape, tokens=args.tokens)
    t, d, h, e, k = (world[n] for n in "tdhek")
    w, dev = 2, torch.device("cuda")
    xs, scores, indices = world["xs"], world["scores"], world["indices"]
    w1s, w2s, w3s = world["w1s"], world["w2s"], world["w3s"]
    base = default_config(w, hidden=h)
    ws = Workspace.simulated(w, num_tokens=t, dim=d, hidden=h, num_experts=e, top_k=k, dtype=torch.bfloat16,
                             device=dev, config=base)
    h13 = torch.empty(w, ws.shape.slot_capacity, 2 * h, device=dev, dtype=torch.bfloat16)
    ref = None
    for rnd in range(args.rounds):
        for override in json.loads(args.variants):
            changes = dict(override)
            save = changes.pop("_save", False)
            cfg = base.replace(**changes)
            try:
                def call(schedule):
                    return simulated_moe_forward(xs, scores, indices, w1s, w2s, w3s, schedule=schedule,
                                                 score_before_experts=False, workspace=ws, config=cfg,
                                                 saved_h13=h13 if save else None)
                fused_ms = time_ms(lambda: call("fused"), reps=args.reps)
                out = [o.clone() for o in call("fused")]
                ref = out if ref is None else ref
                same = all(torch.equal(a, b) for a, b in zip(out, ref))
                same_sched = all(torch.equal(a, b) for a, b in zip(call("sequential"), out))
                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    call("sequential")
                    torch.cuda.synchronize()
                launches = [(ev.name, ev.device_time / 1000) for ev in prof.events()
                            if ev.device_type.name == "CUDA" and ("kernel" in ev.name or "Kernel" in ev.name)]
                kern = " ".join(f"{n.replace('_kernel', '')[:14]} {v:.3f}" for n, v in launches)
                print(f"round {rnd} {args.shape} T={t} {json.dumps(override):40s} fused {fused_ms:7.3f} ms | "
                      f"sequential launches (ms): {kern} | equal to the first variant {same}, "
                      f"fused == sequential {same_sched}", flush=True)
            except Exception as exc:  # noqa: BLE001 - a probe reports and goes on
                print(f"{args.shape} {json.dumps(override):40s} FAILED {type(exc).__name__}: {str(exc)[:300]}",
                      flush=True)


if __name__ == "__main__":
    main()
