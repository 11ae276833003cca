"""UniEP's MoE modules: TorchTitan's MoE with the expert-parallel path swapped.

``UniEPMoE`` keeps TorchTitan's router, shared experts, load-balancing buffers
(``expert_bias``, ``tokens_per_expert``) and every parameter FQN; only the
routed-expert path changes. Instead of TorchTitan's reorder -> all-to-all ->
permute/pad -> grouped GEMM -> unpermute -> all-to-all -> unsort, the experts
module receives the router's decision and runs one UniEP schedule
(``titan_uniep.schedules``) that dispatches, computes and combines.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torchtitan.models.moe.moe import GroupedExperts, MoE

from titan_uniep.compute_dtype import cast_to_compute, layer_compute_dtype
from titan_uniep.schedules import Routing, get_schedule
from titan_uniep.testing import UniEPTestHooks

logger = logging.getLogger(__name__)

__all__ = ["BitwiseGuard", "StepCounter", "UniEPGroupedExperts", "UniEPMoE"]


def _in_backward() -> bool:
    # Activation checkpointing re-runs forwards inside the backward pass; the
    # guard and the step counter must not count those.
    return torch._C._current_graph_task_id() != -1


class StepCounter:
    """The 1-based training step of the current forward, shared by the guard and the test hooks.

    ``titan_uniep.torchtitan.v0_2.train`` sets it from the trainer before every step
    (``start_step``), so a run resumed from a checkpoint at step N names
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
        if module.training and not _in_backward():
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
            not _in_backward()
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


class UniEPGroupedExperts(GroupedExperts):
    """TorchTitan's GroupedExperts (same w1/w2/w3, same FQNs) run by a UniEP schedule.

    ``forward(x, routing)`` takes this rank's ``(T, D)`` tokens and the
    router's decision and returns their combined routed-expert output
    ``(T, D)`` in x's dtype: dispatch, expert FFN and combine all happen
    inside, with the GEMMs in ``compute_dtype`` (``titan_uniep.compute_dtype``:
    None follows x, or autocast where it is on). The EP group, schedule and
    compute dtype are set by the parallelize hook (``parallelize.py``).
    """

    # Set by the parallelize hook after the class swap (see parallelize.py).
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

    def _local_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if isinstance(self.w1, DTensor):
            # Expert weights are Shard(0) on the EP mesh: the local shard is
            # exactly this rank's experts, as in TorchTitan's GroupedExperts.
            return self.w1.to_local(), self.w2.to_local(), self.w3.to_local()
        return self.w1, self.w2, self.w3

    def forward(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:  # type: ignore[override]
        if self.ep_group is None:
            raise RuntimeError(
                f"{self.layer_name}: UniEP experts have no EP group; they must be parallelized by "
                "titan_uniep.parallelize (a *_uniep model with [uniep] enable = true)"
            )
        out_dtype = x.dtype
        x, w1, w2, w3 = cast_to_compute(layer_compute_dtype(self.compute_dtype, x), x, *self._local_weights())
        run = get_schedule(self.schedule)
        out = run(x, routing, w1, w2, w3, group=self.ep_group, score_before_experts=self.score_before_experts,
                  out_dtype=out_dtype)
        if self.guard is not None and self.guard.due():
            with torch.no_grad():
                again = get_schedule(_NON_OVERLAPPED.get(self.schedule, self.schedule))(
                    x, routing, w1, w2, w3, group=self.ep_group, score_before_experts=self.score_before_experts,
                    out_dtype=out_dtype,
                )
            if self.test_hooks is not None:
                again = self.test_hooks.plant_guard_difference(again, self.guard.step, self.ep_group)
            self.guard.compare(out.detach(), again, self.layer_name, self.ep_group)
        if self.test_hooks is not None and self.steps is not None and not _in_backward():
            self.test_hooks.record_layer(self.layer_name, self.steps.step, self.ep_group, x, routing, w1, w2, w3, out)
        return out


class UniEPMoE(MoE):
    """TorchTitan's MoE whose routed experts run through UniEP.

    Same submodules, parameters and buffers as ``MoE`` (the parallelize hook
    swaps the class of an existing instance); the forward differs only in
    handing the router's decision to the experts instead of reordering tokens
    itself (and, only where ``titan_uniep.testing`` hooks are set, in letting
    them override that decision).
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bs, slen, dim = x.shape
        x = x.view(-1, dim)
        top_scores, selected_experts_indices, num_tokens_per_expert = self.router(x, self.expert_bias)
        hooks, steps = self.experts.test_hooks, self.experts.steps
        if hooks is not None and steps is not None:
            selected_experts_indices, num_tokens_per_expert = hooks.override_routing(
                steps.step, selected_experts_indices, num_tokens_per_expert
            )
        # As TorchTitan's MoE: feeds the expert-bias update of the
        # load-balancing optimizer hook (and expert-usage metrics).
        with torch.no_grad():
            self.tokens_per_expert.add_(num_tokens_per_expert)

        routed = self.experts(x, Routing(top_scores, selected_experts_indices))
        if self.shared_experts is None:
            return routed.reshape(bs, slen, dim)
        return (self.shared_experts(x) + routed).reshape(bs, slen, dim)
