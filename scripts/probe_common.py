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


def variant_args(default_shape: str = "qwen3"):
    """Command line of the one-GPU variant probes: ``--shape``, ``--variants``
    (JSON list), ``--rounds``, ``--reps``, ``--tokens``."""
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default=default_shape)
    ap.add_argument("--variants", default="[{}]")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--tokens", type=int, default=None, help="T per rank instead of the shape's (GPU memory)")
    return ap.parse_args()


def saved_forward(world: dict, ranks: int = 2):
    """A simulated world's forward workspace after one sequential forward that
    saved h1 | h3, the saved buffer, and a fresh backward workspace."""
    from titan_uniep.fused import simulated_moe_forward
    from titan_uniep.fused_backward import BackwardWorkspace
    from titan_uniep.symm import Workspace

    t, d, h, e, k = (world[n] for n in "tdhek")
    dev = torch.device("cuda")
    ws = Workspace.simulated(ranks, num_tokens=t, dim=d, hidden=h, num_experts=e, top_k=k, dtype=torch.bfloat16,
                             device=dev)
    h13 = torch.empty(ranks, ws.shape.slot_capacity, 2 * h, device=dev, dtype=torch.bfloat16)
    simulated_moe_forward(world["xs"], world["scores"], world["indices"], world["w1s"], world["w2s"], world["w3s"],
                          schedule="sequential", score_before_experts=False, workspace=ws, saved_h13=h13)
    bws = BackwardWorkspace.simulated(ranks, num_tokens=t, dim=d, hidden=h, num_experts=e, top_k=k,
                                      dtype=torch.bfloat16, device=dev)
    return ws, h13, bws
