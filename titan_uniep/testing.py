"""Testing-only hooks into a real training run, set by ``UNIEP_TEST_*`` environment variables.

They are no config keys: a train config cannot switch them on by accident.
This module is the one place that reads them; the parallelize hook hands
the parsed hooks to every UniEP MoE layer and logs a warning when any is
set. Steps are 1-based training steps (``titan_uniep.torchtitan.layer.StepCounter``).

- ``UNIEP_TEST_ONE_EXPERT_STEP=N``: at step N every token of every rank is
  routed to experts ``0, 1, ..., K-1`` (the router's scores are kept, its
  expert ids replaced), so expert 0 receives every token of the EP group
  and, when ``K <= E / W``, EP rank 0 receives every copy: the receive
  buffer at its worst-case fill (``layout.slot_capacity``).
- ``UNIEP_TEST_RECORD_DIR=DIR``: at that step every MoE layer saves its
  inputs (tokens, routing, local expert weights) and output to
  ``DIR/<layer>.rank<R>.pt``, so a test can check every token against a
  float64 oracle.
- ``UNIEP_TEST_GUARD_FLIP=N:R``: at step N, EP rank R flips the lowest bit
  of one element of the guard's recomputation (``[uniep] guard``), a
  planted one-bit difference. Only the recomputation changes, so training
  computes the same bits as without the hook.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

__all__ = ["ENV_GUARD_FLIP", "ENV_ONE_EXPERT_STEP", "ENV_RECORD_DIR", "RecordedLayer", "UniEPTestHooks",
           "check_recorded_layers"]

ENV_ONE_EXPERT_STEP = "UNIEP_TEST_ONE_EXPERT_STEP"
ENV_RECORD_DIR = "UNIEP_TEST_RECORD_DIR"
ENV_GUARD_FLIP = "UNIEP_TEST_GUARD_FLIP"

_INT_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _positive_int(name: str, text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{name}={text!r}: expected a training step (a positive integer)")
    return value


@dataclass(frozen=True)
class UniEPTestHooks:
    """The parsed ``UNIEP_TEST_*`` variables (see the module docstring)."""

    one_expert_step: int | None = None
    record_dir: str | None = None
    guard_flip_step: int | None = None
    guard_flip_rank: int = 0

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> "UniEPTestHooks | None":
        """The hooks the environment sets, or None when it sets none."""
        env = os.environ if environ is None else environ
        one_expert = env.get(ENV_ONE_EXPERT_STEP)
        record_dir = env.get(ENV_RECORD_DIR) or None
        flip = env.get(ENV_GUARD_FLIP)
        if one_expert is None and record_dir is None and flip is None:
            return None
        if record_dir is not None and one_expert is None:
            raise ValueError(f"{ENV_RECORD_DIR} records the step that {ENV_ONE_EXPERT_STEP} names; set both")
        flip_step, flip_rank = None, 0
        if flip is not None:
            step_text, sep, rank_text = flip.partition(":")
            if not sep or not rank_text.isdigit():
                raise ValueError(f"{ENV_GUARD_FLIP}={flip!r}: expected STEP:EP_RANK, e.g. 3:1")
            flip_step, flip_rank = _positive_int(ENV_GUARD_FLIP, step_text), int(rank_text)
        return cls(
            one_expert_step=None if one_expert is None else _positive_int(ENV_ONE_EXPERT_STEP, one_expert),
            record_dir=record_dir,
            guard_flip_step=flip_step,
            guard_flip_rank=flip_rank,
        )

    def override_routing(
        self, step: int, selected_experts_indices: torch.Tensor, num_tokens_per_expert: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(T, K)`` expert ids and ``(E,)`` counts, replaced at ``one_expert_step``."""
        if step != self.one_expert_step:
            return selected_experts_indices, num_tokens_per_expert
        num_tokens, top_k = selected_experts_indices.shape
        forced = torch.arange(top_k, dtype=selected_experts_indices.dtype, device=selected_experts_indices.device)
        forced = forced.expand(num_tokens, top_k).contiguous()
        counts = torch.zeros_like(num_tokens_per_expert)
        counts[:top_k] = num_tokens
        return forced, counts

    def plant_guard_difference(self, again: torch.Tensor, step: int, group: dist.ProcessGroup | None) -> torch.Tensor:
        """The guard's recomputation, with one bit flipped at ``guard_flip_step`` on ``guard_flip_rank``."""
        rank = dist.get_rank(group) if group is not None else 0
        if step != self.guard_flip_step or rank != self.guard_flip_rank or again.numel() == 0:
            return again
        planted = again.clone()
        planted.view(-1).view(_INT_VIEW[planted.element_size()])[0] ^= 1
        return planted

    def record_layer(self, layer: str, step: int, group: dist.ProcessGroup | None, x: torch.Tensor, routing,
                     w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, out: torch.Tensor) -> None:
        """Save one MoE layer's inputs and output at ``one_expert_step`` (with ``record_dir``)."""
        if self.record_dir is None or step != self.one_expert_step:
            return
        rank = dist.get_rank(group) if group is not None else 0
        tensors = {"x": x, "top_scores": routing.top_scores, "selected_experts_indices": routing.selected_experts_indices,
                   "w1": w1, "w2": w2, "w3": w3, "out": out}
        os.makedirs(self.record_dir, exist_ok=True)
        torch.save({k: v.detach().cpu().clone() for k, v in tensors.items()},
                   os.path.join(self.record_dir, f"{layer}.rank{rank}.pt"))


@dataclass(frozen=True)
class RecordedLayer:
    """One rank's recorded MoE layer checked against float64 (``check_recorded_layers``)."""

    layer: str
    rank: int
    dtype: torch.dtype
    forced: bool
    """Every token routed to experts 0..K-1."""
    max_token_rel_err: float
    """Largest ``|out[t] - oracle[t]| / |oracle[t]|`` over the rank's tokens: a
    dropped token, or copy, misses a whole expert row."""


def check_recorded_layers(record_dir: str | Path, *, score_before_experts: bool = False) -> list[RecordedLayer]:
    """Every layer and rank saved under ``record_dir`` by ``UNIEP_TEST_RECORD_DIR``,
    against ``oracle.float64_moe_oracle`` with the global expert weights (rank
    r's shard holds experts ``[r * El, (r + 1) * El)``)."""
    from titan_uniep.oracle import float64_moe_oracle

    record_dir = Path(record_dir)
    layers = sorted({p.name.rsplit(".rank", 1)[0] for p in record_dir.glob("*.rank*.pt")})
    results = []
    for layer in layers:
        paths = sorted(record_dir.glob(f"{layer}.rank*.pt"), key=lambda p: int(p.stem.rsplit(".rank", 1)[1]))
        saved = [torch.load(p) for p in paths]
        w1, w2, w3 = (torch.cat([s[name] for s in saved]) for name in ("w1", "w2", "w3"))
        for rank, s in enumerate(saved):
            indices = s["selected_experts_indices"]
            forced = bool(torch.equal(indices, torch.arange(indices.shape[1]).expand_as(indices)))
            oracle = float64_moe_oracle(s["x"], s["top_scores"], indices, w1, w2, w3,
                                        score_before_experts=score_before_experts)
            err = (s["out"].double() - oracle).norm(dim=1) / oracle.norm(dim=1)
            results.append(RecordedLayer(layer, rank, s["out"].dtype, forced, float(err.max())))
    return results
