"""Which test processes turn Triton's interpreter on (``TRITON_INTERPRET=1``).

The interpreter test modules need the variable before Triton is imported
(its own jit helpers, ``tl.cdiv`` and the like, are defined at import), so
they ask for it at the top. Every pytest-xdist worker imports every test
module while collecting, GPU ones included, and the variable stays in the
worker's environment for every test it then runs. On one H100 that made the
GPU tests wait in polls instead of microseconds (spurious timeouts), take the
interpreter's branch of the router-score sums (other bits at other tile
shapes) and no tensor descriptors, while their kernels were compiled: the
runtime read the variable at each call. It now follows how the kernels were
defined (``runtime.launch.interpreting``), but the processes a GPU test starts
(torchrun workers) would still inherit the variable and run interpreted. So
the variable is set only where the interpreter tests run in this process: no
CUDA, and Triton not imported yet. Elsewhere those modules skip, and
``test_interpreter_subprocess.py`` runs them in a process of their own.
"""

from __future__ import annotations

import os
import sys


def request_interpreter() -> bool:
    """Set ``TRITON_INTERPRET=1`` for this process where the interpreter tests
    can run in it (no CUDA, Triton not imported yet); return whether it is set."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return True
    if "triton" in sys.modules:
        return False
    import torch  # (does not import Triton)

    if torch.cuda.is_available():
        return False
    os.environ["TRITON_INTERPRET"] = "1"
    return True
