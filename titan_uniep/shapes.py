"""Named MoE layer shapes of the benchmarks and the tuner: ``(T, D, H, E, K)``
with ``T`` tokens per rank, dim ``D``, expert hidden ``H``, ``E`` experts,
top-``K``; and the seeded random inputs of one (``layer_inputs``).

The first three are per rank at EP 2 (the 2 x H200 log of
``docs/performance.md``); the ``*_1gpu`` ones hold the same layers' whole
batch on one rank, and with ``small_experts`` (many narrow experts) and
``odd_dim`` (dims that are not powers of two) they are the shapes the
tuner is held to (``scripts/tune_h200.sh``).
"""

from __future__ import annotations

import argparse

import torch

__all__ = ["SHAPES", "TUNING_SHAPES", "add_shape_argument", "layer_inputs", "parse_shape"]

SHAPES: dict[str, tuple[int, int, int, int, int]] = {
    "qwen3": (8192, 2048, 768, 128, 8),
    "deepseek": (4096, 7168, 2048, 256, 8),
    "mixtral": (8192, 4096, 14336, 8, 2),
    "qwen3_1gpu": (16384, 2048, 768, 128, 8),
    "deepseek_1gpu": (8192, 7168, 2048, 256, 8),
    "mixtral_1gpu": (16384, 4096, 14336, 8, 2),
    "small_experts": (16384, 2048, 512, 256, 8),
    "odd_dim": (8192, 2880, 1440, 64, 4),
}

TUNING_SHAPES = ("qwen3_1gpu", "deepseek_1gpu", "mixtral_1gpu", "small_experts", "odd_dim")


def parse_shape(text: str) -> tuple[str, tuple[int, int, int, int, int]]:
    """``(name, (T, D, H, E, K))`` of a ``SHAPES`` name or of ``"T,D,H,E,K"``."""
    if text in SHAPES:
        return text, SHAPES[text]
    parts = text.split(",")
    try:
        values = tuple(int(p) for p in parts)
    except ValueError:
        values = ()
    if len(values) != 5 or min(values) < 1:
        raise ValueError(f"shape {text!r}: expected one of {', '.join(SHAPES)} or T,D,H,E,K (five positive integers)")
    return "x".join(parts), values


SHAPE_HELP = (f"a layer shape: one of {', '.join(SHAPES)} (titan_uniep.shapes), or T,D,H,E,K (T tokens per rank, "
              "dim D, expert hidden H, E experts, top-K); repeatable")


def _shape_argument(text: str) -> tuple[str, tuple[int, int, int, int, int]]:
    try:
        return parse_shape(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


class _AppendShape(argparse.Action):
    """Append like ``action="append"``, except that the first ``--shape`` replaces the
    default shapes instead of adding to them."""

    def __call__(self, parser, namespace, value, option_string=None):
        given = getattr(namespace, self.dest)
        setattr(namespace, self.dest, [*([] if given is self.default else given), value])


def add_shape_argument(parser: argparse.ArgumentParser, default: tuple[str, ...] = (), **kwargs) -> None:
    """``--shape NAME|T,D,H,E,K``, repeatable: the one shape option of every tool. Each
    value is parsed by ``parse_shape`` into ``args.shapes``, a list of
    ``(name, (T, D, H, E, K))``; without any ``--shape`` it holds ``default``'s shapes."""
    suffix = f" (default: {' '.join(default)})" if default else ""
    parser.add_argument("--shape", dest="shapes", action=_AppendShape, type=_shape_argument,
                        default=[parse_shape(name) for name in default], metavar="NAME|T,D,H,E,K",
                        help=SHAPE_HELP + suffix, **kwargs)


def layer_inputs(shape, rank: int, world: int, dev, dtype=torch.bfloat16) -> dict:
    """This rank's inputs of a layer of ``shape`` (``dtype``, seeded: the same
    every run): x, the output gradient ``grad``, router-like
    ``scores``/``indices`` (top-k of a softmax of Gaussian logits: balanced
    routing), the whole ``w1``, ``w2``, ``w3`` (the same on every rank) and
    its local ``w1l``, ``w2l``, ``w3l`` (views at EP 1)."""
    num_tokens, dim, hidden, num_experts, top_k = shape
    el = num_experts // world
    gen = torch.Generator(device=dev).manual_seed(1234 + rank)
    wgen = torch.Generator(device=dev).manual_seed(99)
    out = dict(x=torch.randn(num_tokens, dim, generator=gen, device=dev).to(dtype),
               grad=torch.randn(num_tokens, dim, generator=gen, device=dev).to(dtype))
    probs = torch.softmax(torch.randn(num_tokens, num_experts, generator=gen, device=dev), 1)
    out["scores"], out["indices"] = (t.contiguous() for t in probs.topk(top_k, dim=1))
    out["w1"] = (torch.randn(num_experts, hidden, dim, generator=wgen, device=dev) * dim**-0.5).to(dtype)
    out["w3"] = (torch.randn(num_experts, hidden, dim, generator=wgen, device=dev) * dim**-0.5).to(dtype)
    out["w2"] = (torch.randn(num_experts, dim, hidden, generator=wgen, device=dev) * hidden**-0.5).to(dtype)
    mine = slice(rank * el, (rank + 1) * el)
    for w in ("w1", "w2", "w3"):
        out[w + "l"] = out[w][mine].contiguous()
    return out
