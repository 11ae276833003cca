"""One UniEP MoE layer inside a TorchTitan model, the same on every TorchTitan release.

Each edge's experts module (``v0_2.moe.UniEPGroupedExperts``,
``v0_3.experts.UniEPRoutedExperts``) mixes in ``UniEPExperts`` and calls
``run_uniep`` with this rank's tokens, the router's decision and its local
expert weights; ``run_uniep`` casts to the compute dtype, runs the schedule,
and drives the bitwise guard and the testing hooks. ``StepCounter`` and
``BitwiseGuard`` are the training step and the guard every edge's trainer
and hook install.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from titan_uniep.compute_dtype import cast_to_compute, layer_compute_dtype, master_weights
from titan_uniep.schedules import Routing, get_schedule
from titan_uniep.testing import UniEPTestHooks

logger = logging.getLogger(__name__)

__all__ = ["BitwiseGuard", "StepCounter", "UniEPExperts", "in_backward"]


def in_backward() -> bool:
    # Activation checkpointing re-runs forwards inside the backward pass; the
    # guard and the step counter must not count those.
    return torch._C._current_graph_task_id() != -1


class StepCounter:
    """The 1-based training step of the current forward, shared by the guard and the test hooks.

    Each edge's trainer sets it before every step (``start_step``), so a run resumed from a checkpoint at step N names
    step N + 1 next. Under another trainer it counts root-model forwards (a
    forward pre-hook installed by the parallelize hook): ``grad_accum_steps``
    of them make one step, counted from 1 at the process's first step.
    """

    def __init__(self, grad_accum_steps: int = 1):
        self.grad_accum_steps = max(1, grad_accum_steps)
        self.model_forwards = 0
        self._first_step = 1

    @property
    def step(self) -> int:
        return self._first_step + (max(self.model_forwards, 1) - 1) // self.grad_accum_steps

    def start_step(self, step: int) -> None:
        self._first_step = step
        self.model_forwards = 0

    def count_model_forward(self, module: torch.nn.Module, args) -> None:
        if module.training and not in_backward():
            self.model_forwards += 1


class BitwiseGuard:
    """Runtime check of the bitwise contract on one MoE layer.

    Every ``interval`` steps (first at step 1), the guarded layer recomputes
    its output with the non-overlapped schedule of the same kernels and
    compares bits.

    - ``mode="check"`` logs a difference with layer and step and trains on.
      It never waits for the device: the verdict (differing elements, max
      abs difference) is computed on the device and copied to pinned host
      memory without blocking; ``poll`` (every step's first forward) logs it
      once the copy has landed, and ``flush`` (after the last step) waits for
      the last ones.
    - ``mode="strict"`` raises on every rank of the EP group: the mismatch
      flag is all-reduced first, so no rank is left waiting in a collective.
      This costs one all-reduce and one host sync per checked step.

    Either mode costs one extra forward of the layer per checked step.
    """

    def __init__(self, mode: str, interval: int, steps: StepCounter | None = None):
        if mode not in ("check", "strict"):
            raise ValueError(f"[uniep] guard = {mode!r}: BitwiseGuard needs 'check' or 'strict'")
        self.mode = mode
        self.interval = interval
        self.steps = steps if steps is not None else StepCounter()
        self.checks = 0
        self.mismatches = 0
        self._last_checked_step = 0
        self._pending: list[tuple[str, int, int, torch.Tensor, torch.cuda.Event | None]] = []

    @property
    def step(self) -> int:
        """1-based training step of the current forward."""
        return self.steps.step

    def due(self) -> bool:
        step = self.step
        return (
            not in_backward()
            and (step - 1) % self.interval == 0
            and step != self._last_checked_step
        )

    def compare(self, out: torch.Tensor, again: torch.Tensor, layer: str, group: dist.ProcessGroup | None) -> None:
        step = self.step
        self._last_checked_step = step
        self.checks += 1
        # [differing elements, max abs difference] on out's device; no host sync.
        differs = (out != again).sum().to(torch.float64)
        max_diff = (out.float() - again.float()).abs().max().to(torch.float64) if out.numel() else differs * 0
        verdict = torch.stack([differs, max_diff])
        if self.mode == "check":
            event = None
            if verdict.is_cuda:
                host = torch.empty(2, dtype=torch.float64, pin_memory=True)
                host.copy_(verdict, non_blocking=True)
                event = torch.cuda.Event()
                event.record()
                verdict = host
            self._pending.append((layer, step, out.numel(), verdict, event))
            return
        flag = (verdict[:1] > 0).to(torch.int32)
        if group is not None:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        self._log(layer, step, out.numel(), verdict.tolist())  # the host sync of strict mode
        if int(flag.item()):
            message = (
                f"UniEP guard (strict): layer {layer} at step {step} is not bitwise equal to the "
                "non-overlapped schedule on at least one EP rank. Set [uniep] guard = \"check\" to log "
                "and continue, or schedule = \"sequential\" to train without overlap."
            )
            # Logged first on every rank: torchrun stops the other workers as soon
            # as one exits, possibly before their own raise reaches its handler.
            logger.error(message)
            raise RuntimeError(message)

    def poll(self) -> None:
        """Log every check-mode verdict whose host copy has landed; never waits for the device."""
        while self._pending and (self._pending[0][4] is None or self._pending[0][4].query()):
            layer, step, numel, verdict, _ = self._pending.pop(0)
            self._log(layer, step, numel, verdict.tolist())

    def flush(self) -> None:
        """Wait for and log every pending check-mode verdict (call it after the last step)."""
        for *_, event in self._pending:
            if event is not None:
                event.synchronize()
        self.poll()

    def _log(self, layer: str, step: int, numel: int, verdict: list[float]) -> None:
        differs, max_diff = verdict
        if not differs:
            logger.info("UniEP guard: layer %s step %d: bitwise equal to the non-overlapped schedule", layer, step)
            return
        self.mismatches += 1
        logger.warning(
            "UniEP guard: layer %s step %d: output differs bitwise from the non-overlapped "
            "schedule in %d of %d elements (max abs diff %.3e)",
            layer, step, int(differs), numel, max_diff,
        )


# The schedule the guard recomputes with: same kernels, no overlap. The
# reference schedule has no overlapped variant, so the guard then checks
# run-to-run determinism.
_NON_OVERLAPPED = {"fused": "sequential", "sequential": "sequential", "reference": "reference"}

# The schedules that take fp32 master weights next to their 16-bit casts and
# write the masters' gradients in fp32 themselves (``titan_uniep.op``); the
# reference schedule's casts are differentiable ``Tensor.to`` calls.
_MASTER_WEIGHT_SCHEDULES = ("fused", "sequential")


class UniEPExperts:
    """What an edge's experts module adds to run a UniEP schedule: its settings and ``run_uniep``.

    ``configure`` sets the schedule, the score placement, the compute dtype
    and the layer's name; the edge's parallelize step sets ``ep_group`` and,
    where the run asks for them, ``steps``, ``guard`` and ``test_hooks``.
    """

    combine_follows_autocast: bool = False
    """Whether the framework's combine (scores after the experts) runs in
    autocast's dtype: TorchTitan 0.2.2's MoE sums the K scored rows with
    ``torch.bmm``, which autocast runs in bf16 (scores rounded to bf16, the
    sum rounded to bf16, then cast back to the tokens' dtype); 0.3.0's scales
    each row in fp32 and sums in the tokens' dtype."""
    ep_group: dist.ProcessGroup | None
    schedule: str
    score_before_experts: bool
    compute_dtype: torch.dtype | None
    guard: BitwiseGuard | None
    layer_name: str
    steps: StepCounter | None
    test_hooks: UniEPTestHooks | None

    def configure(self, *, schedule: str, score_before_experts: bool, compute_dtype: torch.dtype | None,
                  layer_name: str) -> None:
        self.ep_group = None
        self.schedule = schedule
        self.score_before_experts = score_before_experts
        self.compute_dtype = compute_dtype
        self.guard = None
        self.layer_name = layer_name
        self.steps = None
        self.test_hooks = None

    def run_uniep(self, x: torch.Tensor, routing: Routing, w1: torch.Tensor, w2: torch.Tensor,
                  w3: torch.Tensor) -> torch.Tensor:
        """This rank's combined routed-expert output ``(T, D)`` in x's dtype.

        Args:
            x: ``(T, D)`` this rank's tokens.
            routing: the router's ``(T, K)`` scores (float32) and global expert ids (int64).
            w1, w3: ``(E_local, H, D)``; w2: ``(E_local, D, H)``: this rank's experts.
        """
        if self.ep_group is None:
            raise RuntimeError(
                f"{self.layer_name}: UniEP experts have no EP group; they must be parallelized by "
                "UniEP's TorchTitan edge (a UniEP train config with [uniep] enable = true)"
            )
        tokens_dtype = out_dtype = x.dtype
        combine_dtype = self._combine_dtype(x)
        if combine_dtype is not None:
            # The framework's combine precision: scores and the sum over k rounded to it.
            routing = Routing(routing.top_scores.to(combine_dtype), routing.selected_experts_indices)
            out_dtype = combine_dtype
        dtype = layer_compute_dtype(self.compute_dtype, x)
        (x,) = cast_to_compute(dtype, x)
        masters = {}
        if self.schedule in _MASTER_WEIGHT_SCHEDULES:
            (w1, w2, w3), fp32 = master_weights(dtype, w1, w2, w3)
            if fp32 is not None:
                masters = dict(master_weights=fp32)
        else:
            w1, w2, w3 = cast_to_compute(dtype, w1, w2, w3)
        run = get_schedule(self.schedule)
        out = run(x, routing, w1, w2, w3, group=self.ep_group, score_before_experts=self.score_before_experts,
                  out_dtype=out_dtype, **masters)
        if self.guard is not None and self.guard.due():
            with torch.no_grad():
                again = get_schedule(_NON_OVERLAPPED.get(self.schedule, self.schedule))(
                    x, routing, w1, w2, w3, group=self.ep_group, score_before_experts=self.score_before_experts,
                    out_dtype=out_dtype,
                )
            if self.test_hooks is not None:
                again = self.test_hooks.plant_guard_difference(again, self.guard.step, self.ep_group)
            self.guard.compare(out.detach(), again, self.layer_name, self.ep_group)
        if self.test_hooks is not None and self.steps is not None and not in_backward():
            self.test_hooks.record_layer(self.layer_name, self.steps.step, self.ep_group, x, routing, w1, w2, w3, out)
        return out.to(tokens_dtype)

    def _combine_dtype(self, x: torch.Tensor) -> torch.dtype | None:
        """The dtype the framework's combine rounds scores and the sum over k to,
        where it is not the tokens' own (None)."""
        if not self.combine_follows_autocast or self.score_before_experts:
            return None
        if not torch.is_autocast_enabled(x.device.type):
            return None
        dtype = torch.get_autocast_dtype(x.device.type)
        return dtype if dtype != x.dtype and dtype.itemsize < x.dtype.itemsize else None
