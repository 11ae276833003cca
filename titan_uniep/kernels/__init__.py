"""UniEP's Triton kernels (no kernel imports torchtitan; the host launches
live in ``titan_uniep.runtime``):

- ``scoreboard``: release / acquire counters, bounded waits, the error record,
  the packed kernel arguments (``Arena``, ``Route``) and the task helpers
  every megakernel is built from;
- ``route``: per-block counts, the counts exchange, the layout on the device;
- ``dispatch_fc1`` and ``fc2_combine``: the forward megakernels;
- ``dispatch_dh`` (with the SwiGLU backward pass) and ``da_combine``: the
  backward megakernels;
- ``wgrad``: the weight gradients;
- ``widen``: 16-bit -> fp32 (``torch._grouped_mm``'s bf16 weight gradients of
  fp32 master weights, where that backend is asked for).

Without CUDA, Triton can run these kernels only through its interpreter, and
``triton.jit`` reads ``TRITON_INTERPRET`` when a kernel is defined, so it is
set here, before any kernel module is imported (CPU-only machines: CI, dev).
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
