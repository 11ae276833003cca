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
        # UniEP's fused kernels record a failure on the device without a host sync:
        # every rank checks once a step, after the step's last kernel (on a logging
        # step TorchTitan has just synchronised for its loss; otherwise the next
        # step's first host-to-device copy would wait for the device anyway).
        op = sys.modules.get("titan_uniep.op")  # loaded by the kernel schedules only
        if op is not None:
            op.raise_pending_errors()

    def train(self) -> None:
        super().train()
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
