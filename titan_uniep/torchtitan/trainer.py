"""What UniEP adds to a TorchTitan trainer's steps, the same on every release.

``UniEPSteps`` goes before TorchTitan's ``Trainer`` in an edge's trainer class
(``class LossRecordingTrainer(UniEPSteps, Trainer)``); it uses only what the
trainers of 0.2.2 and 0.3.0 share: ``model_parts``, ``step``, ``train_step``,
``train`` and ``close``.
"""

from __future__ import annotations

import sys

import torch

__all__ = ["UniEPSteps"]


class UniEPSteps:
    """Per-step work of a UniEP run: the step counter, the kernels' error check, the guard's last verdicts."""

    def train_step(self, data_iterator) -> None:
        # The trainer's step (restored from a checkpoint on resume) names the
        # step in guard messages and the test hooks.
        for model in self.model_parts:
            if getattr(model, "uniep_steps", None) is not None:
                model.uniep_steps.start_step(self.step)
        super().train_step(data_iterator)
        # UniEP's fused kernels record a failure on the device without a host
        # sync. Every rank checks every step: before this step's checkpoint and
        # after the last step at once (a sync), otherwise at the next step's
        # first MoE call (``op.end_step``), which then waits only for work that
        # TorchTitan's copy of the next batch has waited for already. A sync
        # here on every step would stall the host before it loads the next
        # batch, where TorchTitan syncs only on its logging steps.
        op = sys.modules.get("titan_uniep.op")  # loaded by the kernel schedules only
        if op is None:
            return
        if self._checkpoint_or_last_step():
            op.raise_pending_errors()
        else:
            op.end_step()

    def _checkpoint_or_last_step(self) -> bool:
        """Whether TorchTitan saves a checkpoint after this step, or it is the last one."""
        config = getattr(self, "job_config", None) or getattr(self, "config", None)  # 0.2.2 / 0.3.0
        steps = getattr(getattr(config, "training", None), "steps", None)
        last = steps is None or self.step >= steps
        should_save = getattr(getattr(self, "checkpointer", None), "_should_save", None)
        if should_save is None:  # a checkpointer without the query: check at every step
            return True
        return last or bool(should_save(self.step, last_step=last))

    def train(self) -> None:
        super().train()
        op = sys.modules.get("titan_uniep.op")
        if op is not None:  # a run that stopped before its last step (its data ran out)
            op.raise_pending_errors()
        self._finished = True
        for model in self.model_parts:
            if getattr(model, "uniep_guard", None) is not None:
                model.uniep_guard.flush()  # the last check-mode verdicts

    def close(self) -> None:
        super().close()
        if getattr(self, "_finished", False) and not torch.cuda.is_available() and torch.distributed.is_initialized():
            # gloo, after a finished run only: ranks tear down together
            # (TorchTitan destroys the process group next); a rank whose peer
            # already closed its connections can abort (SIGABRT) in gloo. The
            # wait is bounded by the process group's timeout.
            torch.distributed.barrier()
