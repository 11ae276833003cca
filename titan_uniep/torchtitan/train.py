"""The training entry of ``run_train.sh``: the installed TorchTitan's edge trainer.

    torchrun ... -m titan_uniep.torchtitan.train --job.config_file FILE [overrides]

runs ``main`` of the edge for the installed TorchTitan
(``titan_uniep.torchtitan.v0_2.train`` for 0.2.2: TorchTitan's trainer with the
start-up checks, the CPU shims and ``<dump_folder>/loss.jsonl``). Where
TorchTitan is missing or its release has no edge, the worker ends with an error
that names the installed version and the supported ones.
"""

from __future__ import annotations

import importlib

from titan_uniep.torchtitan import edge_module
from titan_uniep.torchtitan.torchrun import exit_with_error, record_errors_whole


def main() -> None:
    record_errors_whole()
    try:
        edge = edge_module()
    except RuntimeError as err:
        exit_with_error(str(err))
    importlib.import_module(f"{edge}.train").main()


if __name__ == "__main__":
    main()
