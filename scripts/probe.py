"""Time UniEP's kernels at parameter points on one GPU, and check their bits.

    python scripts/probe.py --shape qwen3 --world 2 --variants '[{}, {"fc2_block_n": 256}]'
    python scripts/probe.py --shape 2048,7168,2048,256,8 --set da_block_k=64
    python scripts/probe.py --shape qwen3 --world 1 --real-path
    python scripts/probe.py --shape 8192,2048,768,128,8 --world 1 --weight-grad-dtype float32 \
        --variants '[{}, {"wgrad_backend": "grouped_mm"}]'

A simulated EP world of ``--world`` ranks runs on this GPU (every rank's
buffers in one process, one launch per kernel for the whole world; weights
passed stacked, so nothing is copied per call). For each variant (a dict of
``LayerParams`` overrides of the shape's default point, the first one the
baseline) it times the fused forward (saving h1 | h3, as the custom op runs
it), the fused backward, and their sequential schedules, in alternating
rounds, and checks that the variant's outputs and gradients equal the
baseline's bit for bit (a schedule field never changes a bit; a numerics
field, such as ``*_block_k``, may). ``--weight-grad-dtype float32``: the
backward writes the weight gradients in fp32, as for fp32 master weights
(TorchTitan's NGPU = 1 training under AMP). ``--real-path`` (world 1)
also times ``moe_forward`` on a one-rank process group against the simulated
one-rank world: the harness must cost nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

from titan_uniep.params import apply_overrides, default_params
from titan_uniep.runtime import (BackwardWorkspace, Workspace, moe_forward, simulated_moe_backward,
                                 simulated_moe_forward)
from titan_uniep.shapes import add_shape_argument
from titan_uniep.timing import time_ms


def world_inputs(t, d, h, e, k, world, seed=0):
    """Random bf16 inputs of a simulated world, stacked per rank (W, ...)."""
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(seed)
    el = e // world

    def randn(*size, scale=1.0):
        return (torch.randn(*size, device=dev, generator=gen) * scale).to(torch.bfloat16)

    logits = torch.randn(world, t, e, device=dev, generator=gen)
    scores, indices = logits.softmax(-1).topk(k, dim=-1)
    return dict(x=randn(world, t, d), grad=randn(world, t, d), scores=scores.contiguous(), indices=indices.contiguous(),
                w1=randn(world, el, h, d, scale=d ** -0.5), w2=randn(world, el, d, h, scale=h ** -0.5),
                w3=randn(world, el, h, d, scale=d ** -0.5))


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_argument(ap, default=("qwen3",))
    ap.add_argument("--world", type=int, default=2, help="simulated EP ranks on this GPU")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="change the default point")
    ap.add_argument("--variants", default="[{}]", help="JSON list of LayerParams overrides; the first is the baseline")
    ap.add_argument("--score-before", action="store_true")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--real-path", action="store_true", help="world 1: also time moe_forward on a one-rank group")
    ap.add_argument("--weight-grad-dtype", choices=("data", "float32"), default="data",
                    help="the weight gradients' dtype: the data's (bf16), or fp32 as for fp32 master weights")
    ap.add_argument("--forward-only", action="store_true", help="time the fused forward only (bits: forward and "
                    "every gradient, as always)")
    return ap


def main() -> None:
    ap = build_parser()
    args = ap.parse_args()
    if len(args.shapes) != 1:
        ap.error("the probe times one layer: give one --shape")
    shape_name, (t, d, h, e, k) = args.shapes[0]
    world, sb = args.world, args.score_before
    grad_dtype = torch.float32 if args.weight_grad_dtype == "float32" else None
    base = apply_overrides(default_params(world, hidden=h), args.set)
    points = [base.replace(**change) for change in json.loads(args.variants)]
    inp = world_inputs(t, d, h, e, k, world)
    sizes = dict(num_tokens=t, dim=d, hidden=h, num_experts=e, top_k=k, dtype=torch.bfloat16, device="cuda")
    ws = Workspace.simulated(world, **sizes, params=base)
    bws = BackwardWorkspace.simulated(world, **sizes, params=base)
    h13 = torch.empty(world, ws.shape.slot_capacity, 2 * h, dtype=torch.bfloat16, device="cuda")
    out = torch.empty_like(inp["x"])
    print(f"shape {shape_name}: T={t} per rank, D={d}, H={h}, E={e}, K={k}, simulated world {world}, "
          f"{torch.cuda.get_device_name()}, weight gradients in {args.weight_grad_dtype}", flush=True)

    def forward(p, schedule):
        return lambda: simulated_moe_forward(inp["x"], inp["scores"], inp["indices"], inp["w1"], inp["w2"], inp["w3"],
                                             schedule=schedule, score_before_experts=sb, params=p, workspace=ws,
                                             out=out, saved_h13=h13, error_check="lazy")

    def backward(p, schedule):
        return lambda: simulated_moe_backward(inp["grad"], inp["x"], inp["scores"], inp["indices"], inp["w1"],
                                              inp["w2"], inp["w3"], schedule=schedule, score_before_experts=sb,
                                              params=p, workspace=bws, saved_h13=h13, error_check="lazy",
                                              weight_grad_dtype=grad_dtype)

    times = {(i, what): [] for i in range(len(points)) for what in ("fwd", "bwd", "fwd_seq", "bwd_seq")}
    for r in range(args.rounds):
        order = range(len(points)) if r % 2 == 0 else reversed(range(len(points)))
        for i in order:
            p = points[i]
            times[(i, "fwd")].append(time_ms(forward(p, "fused"), 2, args.reps))
            if args.forward_only:
                continue
            times[(i, "bwd")].append(time_ms(backward(p, "fused"), 2, args.reps))
            times[(i, "fwd_seq")].append(time_ms(forward(p, "sequential"), 1, args.reps))
            times[(i, "bwd_seq")].append(time_ms(backward(p, "sequential"), 1, args.reps))
    ws.check_errors()
    bws.check_errors()

    def results(p):
        y = torch.stack(forward(p, "fused")()).clone()
        return [y, *[g.clone() for rank in backward(p, "fused")() for g in rank]]

    reference = results(points[0])
    print(f"{'variant':60s} {'fwd':>8s} {'bwd':>8s} {'fwd seq':>8s} {'bwd seq':>8s}  bits")
    for i, (change, p) in enumerate(zip(json.loads(args.variants), points)):
        same = all(torch.equal(a, b) for a, b in zip(reference, results(p)))
        med = {what: statistics.median(times[(i, what)]) if times[(i, what)] else None
               for what in ("fwd", "bwd", "fwd_seq", "bwd_seq")}
        label = json.dumps(change) if change else "default"
        cols = " ".join("       -" if med[w] is None else f"{med[w]:8.3f}" for w in ("fwd", "bwd", "fwd_seq", "bwd_seq"))
        print(f"{label[:60]:60s} {cols}  "
              f"{'= baseline' if same else 'DIFFER'}", flush=True)
        print("JSON " + json.dumps(dict(shape=shape_name, tokens=t, world=world, variant=change, **med,
                                        bitwise_equal_to_baseline=same)))

    if args.real_path:
        if world != 1:
            raise SystemExit("--real-path needs --world 1")
        import torch.distributed as dist

        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
        group = dist.group.WORLD
        real_ws = Workspace.for_group(group, **{**sizes, "device": torch.device("cuda", 0)}, params=base)
        real_h13 = torch.empty(real_ws.shape.slot_capacity, 2 * h, dtype=torch.bfloat16, device="cuda")
        args1 = (inp["x"][0], inp["scores"][0], inp["indices"][0], inp["w1"][0], inp["w2"][0], inp["w3"][0])

        def real():
            return moe_forward(*args1, workspace=real_ws, schedule="fused", score_before_experts=sb,
                               saved_h13=real_h13, error_check="lazy")

        sim, rp = [], []
        for r in range(args.rounds * 2):
            pair = (forward(base, "fused"), real) if r % 2 == 0 else (real, forward(base, "fused"))
            for fn in pair:
                (sim if fn is not real else rp).append(time_ms(fn, 2, args.reps))
        same = torch.equal(real(), forward(base, "fused")()[0])
        print(f"simulated one-rank world {statistics.median(sim):.3f} ms, moe_forward on a one-rank group "
              f"{statistics.median(rp):.3f} ms: ratio {statistics.median(sim) / statistics.median(rp):.3f}; "
              f"outputs {'bitwise equal' if same else 'DIFFER'}", flush=True)
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
