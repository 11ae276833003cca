"""Triton kernels of UniEP's forward: counts exchange, megakernel A (dispatch +
fc1 + SwiGLU) and megakernel B (fc2 + combine). Host wrappers live in
``titan_uniep.fused``; no kernel imports torchtitan.

Without CUDA, Triton can only run these kernels through its interpreter, and
``triton.jit`` reads ``TRITON_INTERPRET`` when a kernel is defined, so it is
set here, before any kernel module is imported (CPU-only machines: CI, dev).
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from .tuning import DEFAULT_CONFIGS, KernelConfig, default_config, interpreter_config  # noqa: E402

__all__ = ["KernelConfig", "DEFAULT_CONFIGS", "default_config", "interpreter_config"]
