"""One-GPU probe: kernel times of the backward's dH and dA phases (sequential
schedule, simulated EP=2 world, h1|h3 saved by the forward) for overrides of
``fused_backward.BACKWARD_TILES``.

    python scripts/probe_dh.py --shape qwen3 --variants '[{}, {"dh": 64}, {"_recompute": true}]'

(``_recompute``: the backward recomputes h1 | h3 instead of reading them.)
"""

from __future__ import annotations

import argparse
import json

import torch
from torch.profiler import ProfilerActivity, profile

from titan_uniep import fused_backward
from titan_uniep.fused_backward import simulated_moe_backward

from probe_common import saved_forward, simulated_world


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3")
    ap.add_argument("--variants", default="[{}]")
    args = ap.parse_args()
    world = simulated_world(args.shape)
    xs, gs, scores, indices = world["xs"], world["grads"], world["scores"], world["indices"]
    w1s, w2s, w3s = world["w1s"], world["w2s"], world["w3s"]
    _, h13, bws = saved_forward(world)
    base = dict(fused_backward.BACKWARD_TILES)
    ref = None
    for override in json.loads(args.variants):
        fused_backward.BACKWARD_TILES.clear()
        tiles = dict(override)
        saved = None if tiles.pop("_recompute", False) else h13
        fused_backward.BACKWARD_TILES.update({**base, **tiles})
        try:
            def call():
                return simulated_moe_backward(gs, xs, scores, indices, w1s, w2s, w3s, schedule="sequential",
                                              score_before_experts=False, workspace=bws, saved_h13=saved)
            for _ in range(2):
                out = call()
            torch.cuda.synchronize()
            runs = []
            for _ in range(3):
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    call()
                    torch.cuda.synchronize()
                names = [(ev.name, ev.device_time / 1000) for ev in prof.events() if ev.device_type.name == "CUDA"]
                ba = [v for n, v in names if n.startswith("dispatch_grad_hidden")]
                bb = [v for n, v in names if n.startswith("grad_input_combine")]
                runs.append((ba[1], bb[0]))
            dh = sorted(r[0] for r in runs)[1]
            da = sorted(r[1] for r in runs)[1]
            same = "" if ref is None else f" dx equal to the first variant's: {torch.equal(out[0][0], ref)}"
            ref = out[0][0] if ref is None else ref
            print(f"{args.shape} {json.dumps(override):50s} dH {dh:7.3f} ms  dA {da:7.3f} ms{same}", flush=True)
        except Exception as exc:  # noqa: BLE001 - a probe reports and goes on
            print(f"{args.shape} {json.dumps(override):50s} FAILED {type(exc).__name__}: {str(exc)[:300]}", flush=True)
    fused_backward.BACKWARD_TILES.clear()
    fused_backward.BACKWARD_TILES.update(base)


if __name__ == "__main__":
    main()
