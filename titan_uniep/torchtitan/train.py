"""The training entry of ``run_train.sh``: the installed TorchTitan's edge trainer.

    torchrun ... -m titan_uniep.torchtitan.train --job.config_file FILE [overrides]

runs ``main`` of the edge for the installed TorchTitan
(``titan_uniep.torchtitan.v0_2.train`` for 0.2.2: TorchTitan's trainer with the
start-up checks, the CPU shims and ``<dump_folder>/loss.jsonl``). Where
TorchTitan is missing or its release has no edge, the worker ends with an error
that names the installed version and the supported ones; where TorchTitan's
checkpoint load or save fails, with the failure and, for the model-only
checkpoint of a run's last step, how to resume instead.
"""

from __future__ import annotations

import importlib
import re

from titan_uniep.torchtitan import edge_module
from titan_uniep.torchtitan.torchrun import exit_with_error, record_errors_whole

TRAINING_STATES = ("dataloader", "optimizer", "lr_scheduler", "train_state")
"""What a TorchTitan checkpoint holds besides the model (its ``states`` keys, the same in
0.2.2 and 0.3.0): a checkpoint without them is model-only and cannot be resumed from."""


def checkpoint_error(err: BaseException) -> str:
    """The message for a ``torch.distributed.checkpoint`` ``CheckpointException``
    (``failures``: rank -> (exception, its stack)): the first rank's failure, and
    for a resume from a model-only checkpoint, why and how to resume instead."""
    failures = getattr(err, "failures", {}) or {}
    reasons = [str(exception) for exception, _ in failures.values()]
    first = reasons[0].splitlines()[0] if reasons else str(err).splitlines()[0]
    missing = [key for reason in reasons
               for key in re.findall(r"Missing key in checkpoint state_dict: (\S+?)\.?$", reason, re.MULTILINE)]
    if not any(key.split(".")[0] in TRAINING_STATES for key in missing):
        return f"TorchTitan's checkpoint load or save failed on ranks {sorted(failures)}: {first}"
    return (f"the checkpoint TorchTitan loaded holds the model only ({missing[0]} is not in it), and resuming "
            "needs the optimizer, data loader and step too. TorchTitan saves a run's last step model-only unless "
            "checkpoint.last_save_model_only is false (--checkpoint.no_last_save_model_only on TorchTitan 0.2.2); "
            "its saves every checkpoint.interval steps are whole. Resume from one of those with "
            "--checkpoint.load_step N (a step-N of the checkpoint folder before the last), or continue a finished "
            "run only when it saved its last step whole.")


def main() -> None:
    record_errors_whole()
    try:
        edge = edge_module()
    except RuntimeError as err:
        exit_with_error(str(err))
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        importlib.import_module(f"{edge}.train").main()
    except CheckpointException as err:
        # A BaseException: TorchTitan's @record and its main's `except Exception` let it
        # through, so without this the launcher's report would have no error to show.
        exit_with_error(checkpoint_error(err))


if __name__ == "__main__":
    main()
