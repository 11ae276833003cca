"""Shared pieces of the one-GPU probes in scripts/ (shapes, a CUDA-event timer,
a simulated EP world's random inputs)."""

from __future__ import annotations

import torch

from titan_uniep.bench import SHAPES  # noqa: F401  (T per rank, D, H, E, K), re-exported for the probes


def time_ms(fn, reps: int = 10, warmup: int = 2) -> float:
    """Median of ``reps`` CUDA-event timings of ``fn()`` after ``warmup`` calls (ms)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[reps // 2]


def simulated_world(shape: str, world: int = 2, seed: int = 0, tokens: int | None = None) -> dict:
    """Random bf16 inputs of a simulated EP world of ``world`` ranks at ``shape``
    (``tokens``: T per rank instead of the shape's): per rank x, dOut
    (``grads``), router-like scores and top-k expert ids, and the rank's local
    w1, w2, w3; plus the sizes ``t, d, h, e, k``."""
    t, d, h, e, k = SHAPES[shape]
    t = tokens or t
    el, dev = e // world, torch.device("cuda")
    torch.manual_seed(seed)

    def randn(*size, scale=1.0):
        return (torch.randn(*size, device=dev) * scale).to(torch.bfloat16)

    out = dict(t=t, d=d, h=h, e=e, k=k, xs=[], grads=[], scores=[], indices=[], w1s=[], w2s=[], w3s=[])
    for _ in range(world):
        out["xs"].append(randn(t, d))
        out["grads"].append(randn(t, d))
        scores, ids = torch.randn(t, e, device=dev).softmax(-1).topk(k, dim=-1)
        out["scores"].append(scores)
        out["indices"].append(ids)
        out["w1s"].append(randn(el, h, d, scale=d ** -0.5))
        out["w3s"].append(randn(el, h, d, scale=d ** -0.5))
        out["w2s"].append(randn(el, d, h, scale=h ** -0.5))
    return out
