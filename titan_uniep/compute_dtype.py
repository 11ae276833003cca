"""Which dtype the expert GEMMs run in, and the casts that put a layer's inputs there.

TorchTitan-free: every TorchTitan edge resolves ``[uniep] compute_dtype`` with
``resolve`` when it swaps a layer, and runs the layer's schedule through
``cast_to_compute`` (the kernel schedules' weights through ``master_weights``).

The rule is TorchTitan's own: UniEP's experts compute in the dtype TorchTitan's
experts would compute in for the same job, so that swapping the MoE path keeps
the training's numerics.

- TorchTitan's grouped-GEMM experts (``use_grouped_mm``, the default of every
  MoE flavor) cast the tokens and the expert weights to bf16 for their GEMMs
  whatever the parameters' dtype (fp32 master weights under AMP without FSDP,
  bf16 under FSDP mixed precision) and cast the result back to the tokens'
  dtype: UniEP computes in bf16 there.
- TorchTitan's for-loop experts (``use_grouped_mm = False``) run ``torch.matmul``
  in the tokens' dtype, or autocast's where autocast is on: UniEP does the same.
- ``compute_dtype = "float32"`` asks for fp32 GEMMs explicitly (IEEE fp32
  dot products, no tensor-core rounding).

In every case the kernels take bf16 (or fp32) operands and accumulate in fp32;
the layer returns its output in the tokens' dtype, and every gradient comes
in the dtype of the tensor it belongs to: x's cast is an ordinary
differentiable ``Tensor.to``; fp32 expert weights cast to 16 bits for UniEP's
kernels are their ``master_weights``, whose gradients the kernels write in
fp32 straight from the GEMM's sums (TorchTitan's experts round theirs to
bf16 and widen them back).
"""

from __future__ import annotations

import torch

from titan_uniep.config import COMPUTE_DTYPE_NAMES as COMPUTE_DTYPES

__all__ = ["COMPUTE_DTYPES", "cast_to_compute", "job_compute_dtype", "job_weight_grad_dtype", "layer_compute_dtype",
           "master_weights", "resolve", "weight_grad_dtype"]

_DTYPE_NAMES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def resolve(requested: str, *, framework_casts_to_bf16: bool) -> torch.dtype | None:
    """The expert GEMMs' dtype for ``[uniep] compute_dtype = requested``.

    ``framework_casts_to_bf16``: whether the framework's own experts cast their
    GEMM operands to bf16 (TorchTitan's grouped-GEMM experts do). Returns a
    dtype, or None for "the tokens' dtype, or autocast's where it is on"
    (``layer_compute_dtype`` decides per call).
    """
    if requested not in COMPUTE_DTYPES:
        raise ValueError(f"[uniep] compute_dtype = {requested!r} is not a compute dtype; use one of "
                         f"{', '.join(repr(c) for c in COMPUTE_DTYPES)}")
    if requested == "float32":
        return torch.float32
    return torch.bfloat16 if framework_casts_to_bf16 else None


def job_compute_dtype(requested: str, *, framework_casts_to_bf16: bool, activation_dtype: str) -> torch.dtype:
    """The dtype a job's expert GEMMs run in, known before the first call:
    ``resolve``'s, else the activations' (``activation_dtype``: the training
    mixed-precision dtype, a name as TorchTitan's ``mixed_precision_param``,
    which both FSDP (its param dtype) and TorchTitan's AMP (its autocast
    dtype) take; CPU autocast ignores float32, which leaves fp32 alike)."""
    if activation_dtype not in _DTYPE_NAMES:
        raise ValueError(f"unknown activation dtype {activation_dtype!r}; one of {', '.join(_DTYPE_NAMES)}")
    return resolve(requested, framework_casts_to_bf16=framework_casts_to_bf16) or _DTYPE_NAMES[activation_dtype]


def layer_compute_dtype(resolved: torch.dtype | None, x: torch.Tensor) -> torch.dtype:
    """The dtype of this call's GEMMs: ``resolved``, else autocast's (if on for
    ``x``'s device), else ``x.dtype``."""
    if resolved is not None:
        return resolved
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return x.dtype


def cast_to_compute(dtype: torch.dtype, x: torch.Tensor, *weights: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``x`` and the expert weights in ``dtype`` (no copy where they already are).

    A weight cast is a copy of every expert weight per call, as TorchTitan's
    grouped-GEMM experts make one; under FSDP mixed precision the weights
    arrive in bf16 and nothing is copied.
    """
    return tuple(t if t.dtype == dtype else t.to(dtype) for t in (x, *weights))


def master_weights(dtype: torch.dtype, *weights: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], tuple | None]:
    """The expert weights in ``dtype`` for UniEP's kernels, and the master
    weights their gradients go to.

    Where every weight is fp32 and ``dtype`` a 16-bit one: detached casts
    (autograd does not differentiate the cast) and the fp32 weights as masters,
    whose fp32 gradients the kernels' backward writes itself. Otherwise
    (``dtype`` the weights' own, or bf16 weights under FSDP mixed precision):
    ``cast_to_compute``'s weights and no masters.
    """
    if all(weight_grad_dtype(dtype, w.dtype) is not None for w in weights):
        return tuple(w.detach().to(dtype) for w in weights), weights
    return cast_to_compute(dtype, *weights), None


def weight_grad_dtype(dtype: torch.dtype, weights_dtype: torch.dtype) -> torch.dtype | None:
    """The dtype the kernels write the expert weights' gradients in when they
    compute in ``dtype`` on weights that arrive in ``weights_dtype``: fp32
    where the weights are fp32 masters of 16-bit casts (``master_weights``),
    else None (the data's: the casts' autograd, or no cast, delivers them)."""
    return torch.float32 if dtype.itemsize == 2 and weights_dtype == torch.float32 else None


def job_weight_grad_dtype(dtype: torch.dtype, *, fsdp: bool, mixed_precision_param: str) -> torch.dtype | None:
    """``weight_grad_dtype`` of a job whose kernels compute in ``dtype``,
    known before the first call: TorchTitan keeps its parameters in fp32 and,
    where it applies FSDP (``fsdp``), hands the layers their
    ``mixed_precision_param`` casts (FSDP's param dtype), else the fp32
    parameters themselves (AMP, or no mixed precision)."""
    if mixed_precision_param not in _DTYPE_NAMES:
        raise ValueError(f"unknown mixed-precision dtype {mixed_precision_param!r}; one of {', '.join(_DTYPE_NAMES)}")
    return weight_grad_dtype(dtype, _DTYPE_NAMES[mixed_precision_param] if fsdp else torch.float32)
