"""The thresholds the benchmarks' ``--check`` asserts, and how they compare.

Two kinds of claims, for the forward output and for every gradient:

- *bitwise*: the fused schedule gives the sequential schedule's bits (and a
  tuned point the default point's); any difference fails;
- *close*: UniEP against TorchTitan's EP path on the same inputs, and
  against a float64 oracle (``titan_uniep.oracle``) on a subsample of
  tokens, as ``max |a - b| / max |b|`` over the tensor (one number per
  tensor, insensitive to where the large values sit).

``LIMITS[direction][dtype]`` holds the limits. Forward: about four times
the error of a pipeline that rounds where the kernels round (the layout
oracle against float64 on random layers of D 512-1024: 0.005-0.008 in
bf16, 0.0006-0.0008 in fp16), and UniEP's error may exceed TorchTitan's
own only by ``titan_slack`` times it; a peer (``tools.peers``) is held to
TorchTitan's limit (``vs_peer``). Backward (bf16): the 3e-2 against
float64 that the GPU tests assert for every gradient (``tests/gpu``), and
5e-2 against TorchTitan, whose gradients round at other points (its
autograd keeps h1, h3 and the SwiGLU output in bf16). ``failures`` turns
the statistics of one shape into messages; the benches print them and
exit 1 if there is any.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["LIMITS", "enforce", "failures", "max_over_group", "rel_diff"]

LIMITS: dict[str, dict[str, dict[str, float]]] = {
    "forward": {
        "bf16": {"vs_float64": 0.03, "vs_titan": 0.03, "vs_peer": 0.03, "titan_slack": 1.5},
        "fp16": {"vs_float64": 0.004, "vs_titan": 0.004, "vs_peer": 0.004, "titan_slack": 1.5},
    },
    "backward": {
        "bf16": {"vs_float64": 0.03, "vs_titan": 0.05, "vs_peer": 0.05, "titan_slack": 1.5},
    },
}


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """``max |a - b| / max |b|`` in float64 (``b`` the reference; 0 when both are
    empty; ``inf`` if ``a`` has a NaN or ``b`` is zero where ``a`` is not).
    Computed in chunks of rows, so two weight gradients of a large layer need
    no float64 copies of their own (DeepSeek-V3-like dW1: 28 GiB in float64)."""
    if a.shape != b.shape:
        raise ValueError(f"rel_diff of tensors of shapes {tuple(a.shape)} and {tuple(b.shape)}")
    if a.numel() == 0:
        return 0.0
    flat_a, flat_b = a.reshape(-1), b.reshape(-1)
    diff = torch.zeros((), dtype=torch.float64, device=a.device)
    scale = torch.zeros((), dtype=torch.float64, device=a.device)
    for start in range(0, flat_a.numel(), _CHUNK):
        part_a = flat_a[start:start + _CHUNK].double()
        part_b = flat_b[start:start + _CHUNK].double()
        # NaN propagates through max (torch.maximum), so a NaN anywhere is seen.
        diff = torch.maximum(diff, (part_a - part_b).abs().max())
        scale = torch.maximum(scale, part_b.abs().max())
    if torch.isnan(diff):
        return float("inf")
    if scale == 0:
        return 0.0 if diff == 0 else float("inf")
    return float(diff / scale)


_CHUNK = 1 << 27  # elements per float64 chunk (1 GiB)


def max_over_group(stats: dict[str, float], group: dist.ProcessGroup | None, device) -> dict[str, float]:
    """Every statistic's maximum over the ranks of ``group`` (unchanged without a process group)."""
    if not (dist.is_available() and dist.is_initialized()) or not stats:
        return dict(stats)
    values = torch.tensor([float(v) for v in stats.values()], dtype=torch.float64, device=device)
    dist.all_reduce(values, op=dist.ReduceOp.MAX, group=group)
    return dict(zip(stats, values.tolist()))


def failures(stats: dict[str, float], limit: dict[str, float]) -> list[str]:
    """Messages for the statistics of one shape beyond ``limit`` (an entry of ``LIMITS``):

    - ``"<name>_bitwise_diff"``: must be 0 (1 means the tensors differ);
    - ``"<name>_vs_float64"``, ``"<name>_vs_titan"``, ``"<name>_vs_peer"``: at most the limit;
    - ``"<name>_titan_vs_float64"`` next to ``"<name>_vs_float64"``: UniEP's
      error at most ``titan_slack`` times TorchTitan's plus a tenth of the limit.

    Unknown names fail too (a statistic no rule reads asserts nothing)."""
    out = []
    for name, value in stats.items():
        if name.endswith("_bitwise_diff"):
            if value != 0:
                out.append(f"{name.removesuffix('_bitwise_diff')}: not bitwise equal")
        elif name.endswith("_titan_vs_float64"):
            ours = stats.get(name.replace("_titan_vs_float64", "_vs_float64"))
            if ours is None:
                out.append(f"{name}: no UniEP statistic to compare with")
            elif not ours <= limit["titan_slack"] * value + 0.1 * limit["vs_float64"]:
                out.append(f"{name.removesuffix('_titan_vs_float64')}: error vs float64 {ours:.3g} exceeds "
                           f"{limit['titan_slack']} x TorchTitan's {value:.3g} + {0.1 * limit['vs_float64']:.3g}")
        elif name.endswith(("_vs_float64", "_vs_titan", "_vs_peer")):
            kind = "vs_" + name.rsplit("_vs_", 1)[1]
            if not value <= limit[kind]:  # NaN fails
                out.append(f"{name}: {value:.3g} exceeds the limit {limit[kind]}")
        else:
            out.append(f"{name}: no threshold for this statistic")
    return out


def enforce(records: list[dict], *, verbose: bool = True) -> None:
    """Exit with status 1 (``SystemExit``) if any benchmark record has
    ``check_failures``, printing each one first (``verbose``: rank 0)."""
    failed = [f"{record['shape']}: {message}" for record in records for message in record.get("check_failures", [])]
    if verbose:
        for line in failed:
            print(f"CHECK FAILED {line}", flush=True)
    if failed:
        raise SystemExit(1)
