"""Host time of the op's calls, forward and backward, and where it goes.

    torchrun --standalone --nproc_per_node 1 scripts/op_host_time.py --shape 8192,2048,768,128,8

A training step is paced by the host where the host takes longer to issue a
layer's launches than the GPU takes to run them. For each ``--shape`` this
calls ``torch.ops.uniep.moe_experts`` and ``moe_experts_backward`` as
training does (bf16, fused, h1 | h3 saved, scores after the experts) and
prints per call the host time (until the call returns; the launches are
asynchronous) against the GPU time (CUDA events, after a sync), medians over
``--calls`` calls, then a cProfile of ``--profile-calls`` calls of both
ops sorted by the functions' own time. Without CUDA it runs the same on CPU
(fp32, Triton's interpreter: ``TRITON_INTERPRET=1``, small shapes), to try
the script, not to time anything.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist

import titan_uniep.op  # noqa: F401  (registers torch.ops.uniep)
from titan_uniep.op import reserve_tokens
from titan_uniep.shapes import add_shape_argument
from titan_uniep.tools.bench import make_routing


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_argument(ap, default=("qwen3_1gpu",))
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--profile-calls", type=int, default=10)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--schedule", default="fused", choices=("fused", "sequential"))
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    if cuda:
        torch.cuda.set_device(dev)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    group = dist.group.WORLD
    for name, (tokens, dim, hidden, experts, top_k) in args.shapes:
        gen = torch.Generator(device=dev).manual_seed(0)
        el = experts // dist.get_world_size()
        w1 = torch.randn(el, hidden, dim, generator=gen, device=dev).mul_(dim**-0.5).to(dtype)
        w3 = torch.randn(el, hidden, dim, generator=gen, device=dev).mul_(dim**-0.5).to(dtype)
        w2 = torch.randn(el, dim, hidden, generator=gen, device=dev).mul_(hidden**-0.5).to(dtype)
        x = torch.randn(tokens, dim, generator=gen, device=dev).to(dtype)
        grad = torch.randn(tokens, dim, generator=gen, device=dev).to(dtype)
        scores, indices = make_routing("balanced", tokens, experts, top_k, gen, dev)
        reserve_tokens(group, tokens)
        saved = {}

        def forward():
            saved["out"], saved["h13"] = torch.ops.uniep.moe_experts(
                x, scores, indices, w1, w2, w3, group.group_name, args.schedule, False, None)

        def backward():
            torch.ops.uniep.moe_experts_backward(grad, x, scores, indices, w1, w2, w3, saved["h13"], group.group_name,
                                                 args.schedule, False)

        host = {"forward": [], "backward": []}
        gpu = {"forward": [], "backward": []}
        for call in range(3 + args.calls):  # 3 warm-up calls (compiles the kernels)
            for direction, fn in (("forward", forward), ("backward", backward)):
                sync()
                if cuda:
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                t0 = time.perf_counter()
                fn()
                t1 = time.perf_counter()
                if cuda:
                    end.record()
                sync()
                if call >= 3:
                    host[direction].append((t1 - t0) * 1e3)
                    gpu[direction].append(start.elapsed_time(end) if cuda else float("nan"))
        print(f"== {name} (T={tokens} D={dim} H={hidden} E={experts} K={top_k}, {args.schedule}, "
              f"{dist.get_world_size()} rank(s))")
        print("| call | host ms | GPU ms |\n|---|---|---|")
        for direction in ("forward", "backward"):
            print(f"| {direction} | {statistics.median(host[direction]):.3f} | {statistics.median(gpu[direction]):.3f} |")
        profiler = cProfile.Profile()
        sync()
        profiler.enable()
        for _ in range(args.profile_calls):
            forward()
            backward()
        profiler.disable()
        sync()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(args.top)
        print(f"cProfile of {args.profile_calls} forward + backward calls, by own time:")
        print(text.getvalue())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
