"""UniEP's kernel schedules as ``torch.library`` ops with registered autograd.

``torch.ops.uniep.moe_experts`` runs one MoE layer's routed-expert path
(dispatch, expert FFN, combine) with the ``"sequential"`` or ``"fused"``
kernels of ``titan_uniep.runtime``: real EP on CUDA (one process per GPU;
a one-rank group at EP = 1, no peer traffic), and on a machine without CUDA a
one-rank group only, whose workspace is a ``Workspace.simulated(1)`` run by
Triton's interpreter (CI tests of the op and of EP = 1 training). Being a
custom op makes it opaque to ``torch.compile`` (the rest of the model still
compiles) and lets selective activation checkpointing save its output
(``titan_uniep.parallelize`` adds it to TorchTitan's SAC save list).

Backward: ``torch.ops.uniep.moe_experts_backward``, its own custom op (the
backward kernels of ``titan_uniep.runtime.backward``, same schedule as the
forward), which the registered autograd formula calls. Both ops have fake
implementations that compute shapes only, so ``torch.compile`` (AOT
autograd) traces forward and backward without touching a workspace or a
real tensor; the kernels run only when the compiled graph runs. The forward's
second output is each receive slot's h1 | h3 (``slot_capacity x 2H`` in the
activation dtype, written by the forward megakernel), which autograd keeps
for the backward, as TorchTitan's keeps h1 and h3 of its grouped GEMMs;
besides it the op saves only its inputs. The backward re-dispatches x next
to the output gradient (for dW1/dW3) and reads h1 and h3 (no second fc1;
the score gradient needs no fc2: ``<dOut, y> = <dOut @ w2, h>``). Every
gradient is bitwise equal across ``sequential`` and ``fused``;
the fused backward does not synchronise with the host (errors are polled
lazily).

Workspaces: one forward and one backward workspace per (EP group, layer
shape, dtype, device), built on first use (a collective: every EP rank
reaches its first MoE layer together) and reused by every layer and step,
sized for the largest token count known then (``reserve_tokens``, set by the
parallelize hook from the job's batch and sequence length), with the
``LayerParams`` point ``[uniep] tuning`` selects (``tuning.selection``).

Errors: the fused path checks its workspace's error words without a host
sync (``Workspace.poll_errors``), so a failure may surface only some calls
later. ``raise_pending_errors()`` checks every workspace now (a host sync).
``end_step()`` is the trainer's per-step check (``titan_uniep.torchtitan.trainer``,
every rank, after every step): it makes the next call of the op wait for
the error copies that this step's calls queued and raise what they show,
before that call launches anything. So a failure in step N stops the run
before step N + 1's first MoE layer, without a sync of its own: by then
TorchTitan's copy of step N + 1's batch to the device has waited for step
N's kernels. Where no call of the op ran on the host during the step
(CUDA-graph replay), ``end_step`` checks at once, with a sync.

Master weights: where the layer casts fp32 expert weights to bf16 for the
GEMMs, it passes the casts as w1, w2, w3 (detached) and the fp32 weights as
``master_w1``, ``master_w2``, ``master_w3``. The backward then gives the
masters their gradients in fp32 straight from the weight-gradient GEMM's
fp32 sums (``runtime.backward``'s ``weight_grad_dtype``), and the casts
none: no bf16 gradient is written and widened per weight and step, and none
is rounded to bf16.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
import triton.language as tl
from torch.distributed.distributed_c10d import _resolve_process_group
from triton.runtime.interpreter import InterpretedFunction

from titan_uniep.layout import slot_capacity
from titan_uniep.params import interpreter_params
from titan_uniep.runtime import (
    BackwardWorkspace,
    Workspace,
    moe_backward,
    moe_forward,
    simulated_moe_backward,
    simulated_moe_forward,
)
from titan_uniep.tuning.selection import select_params

__all__ = ["end_step", "moe_experts", "moe_experts_backward", "raise_pending_errors", "reserve_tokens",
           "symmetric_memory_bytes", "workspace_for"]

logger = logging.getLogger(__name__)

_workspaces: dict[tuple, Workspace | BackwardWorkspace] = {}
_reserved_tokens: dict[str, int] = {}


def reserve_tokens(group: dist.ProcessGroup, num_tokens: int) -> None:
    """Size the group's workspaces for ``num_tokens`` tokens per rank per call
    (call it on every rank before the first MoE forward)."""
    name = group.group_name
    _reserved_tokens[name] = max(_reserved_tokens.get(name, 0), num_tokens)


def symmetric_memory_bytes() -> int:
    """Bytes of symmetric memory this process holds for the op's workspaces
    (``Workspace.symmetric_bytes``): outside PyTorch's caching allocator, so
    not in TorchTitan's memory figure; ``loss.jsonl`` records it beside
    that figure (``titan_uniep.torchtitan.loss_file``)."""
    return sum(ws.symmetric_bytes for ws in _workspaces.values())


def raise_pending_errors() -> None:
    """Raise RuntimeError if a UniEP kernel of this rank failed, or stopped
    because a peer failed, in any workspace of the op; the message names the
    EP rank, task and counter that failed first. Synchronises with the device
    (a small copy): the trainer calls it before a checkpoint is saved and
    after the last step."""
    global _check_at_next_call, _host_calls
    _check_at_next_call, _host_calls = False, 0
    for ws in _workspaces.values():
        ws.check_errors()


_host_calls = 0  # calls of the op whose Python ran since the last end_step
_check_at_next_call = False


def end_step() -> None:
    """The per-step error check, without a host sync of its own.

    Every call of the op queued a copy of its workspace's error words after
    its kernels (the fused path) or checked them itself (the sequential
    path); the next call waits for those copies and raises what they show
    before it launches anything (``_check_step_copies``). Where no call ran
    its Python since the last check (a CUDA-graph replay queues no copy),
    this checks every workspace now (``raise_pending_errors``, a sync).
    """
    global _check_at_next_call, _host_calls
    if _host_calls == 0:
        raise_pending_errors()
        return
    _host_calls = 0
    _check_at_next_call = True


def _check_step_copies() -> None:
    """At every call's entry: count it, and after ``end_step`` wait for every
    workspace's queued error copies and raise a failure they show. Inside
    CUDA-graph capture nothing is waited for (a capture cannot sync)."""
    global _check_at_next_call, _host_calls
    _host_calls += 1
    if not _check_at_next_call:
        return
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return
    _check_at_next_call = False
    for ws in _workspaces.values():
        ws.wait_errors()


def _workspace_key(group_name: str, x: torch.Tensor, w1: torch.Tensor, top_k: int, score_before_experts: bool,
                   backward: bool) -> tuple:
    """One workspace per (EP group, direction, layer shape, score mode, dtype,
    device): its tuned point (``select_params``) is chosen per score mode."""
    num_experts = w1.shape[0] * dist.get_world_size(_resolve_process_group(group_name))
    return (group_name, backward, x.shape[1], w1.shape[1], num_experts, top_k, score_before_experts, x.dtype, x.device)


def workspace_for(
    group_name: str, x: torch.Tensor, w1: torch.Tensor, top_k: int, *, score_before_experts: bool,
    backward: bool = False,
) -> Workspace | BackwardWorkspace:
    """The forward (or backward) workspace of this group and layer shape, built on first use."""
    group = _resolve_process_group(group_name)
    num_experts = w1.shape[0] * dist.get_world_size(group)
    ws = _workspaces.get(key := _workspace_key(group_name, x, w1, top_k, score_before_experts, backward))
    num_tokens = x.shape[0]
    if ws is None:
        capacity = max(num_tokens, _reserved_tokens.get(group_name, 0), 1)
        kind = BackwardWorkspace if backward else Workspace
        sizes = dict(num_tokens=capacity, dim=x.shape[1], hidden=w1.shape[1], num_experts=num_experts, top_k=top_k,
                     dtype=x.dtype)
        if x.device.type == "cuda":
            # [uniep] tuning's point for this layer (None: the default); a collective when tuning is on.
            params = select_params(group, **sizes, score_before_experts=score_before_experts, device=x.device,
                                   backward=backward)
            ws = kind.for_group(group, device=x.device, params=params, **sizes)
            shared = _share_scratch(key, ws)
            logger.info("UniEP %s workspace (%d tokens per rank, D %d, H %d, E %d, K %d): %.1f MiB%s, of which %.1f "
                        "MiB symmetric memory (outside PyTorch's caching allocator and TorchTitan's memory figure)",
                        "backward" if backward else "forward", capacity, x.shape[1], w1.shape[1], num_experts,
                        top_k, (ws.memory_bytes()["total"] - shared) / 2**20,
                        " besides the h it shares with the other direction's" if shared else "",
                        ws.symmetric_bytes / 2**20)
        else:
            ws = _interpreted_workspace(kind, group, x.device, sizes)
            _share_scratch(key, ws)
        _workspaces[key] = ws
    elif num_tokens > (capacity := getattr(ws, "inner", ws).shape.token_capacity):
        # Growing is a collective; a single rank discovering it mid-step
        # cannot make its peers join, so fail clearly instead of hanging.
        raise RuntimeError(
            f"UniEP workspace holds {capacity} tokens per rank, this MoE call has {num_tokens}. "
            "Call titan_uniep.op.reserve_tokens(ep_group, N) on every rank before the first step, "
            "or Workspace.ensure_capacity(N) on every rank between steps."
        )
    return ws


def _share_scratch(key: tuple, ws: Workspace | BackwardWorkspace) -> int:
    """Give ``ws`` scratch memory of the other direction's workspace of the
    same layer shape, where that one exists. Both use ``h`` as scratch within
    one call only (the forward's fc1 output for its fc2, the backward's SwiGLU
    recompute for its weight gradients), and the op's calls run one after
    another on the stream: one tensor serves both, where the shapes agree. The
    backward's call-local buffers that fit go into the forward's ``returned``
    rows, which hold nothing between forward calls
    (``BackwardWorkspace.borrow_scratch``). The tensors replaced go back to
    the caching allocator. Returns the bytes shared (0: none)."""
    other = _workspaces.get((*key[:1], not key[1], *key[2:]))
    if other is None:
        return 0
    mine, theirs = getattr(ws, "inner", ws), getattr(other, "inner", other)
    shared = 0
    if (mine.h.shape, mine.h.dtype, mine.h.device) == (theirs.h.shape, theirs.h.dtype, theirs.h.device):
        mine.h = theirs.h
        shared += mine.h.nbytes
    if isinstance(ws, BackwardWorkspace) and isinstance(other, Workspace):
        shared += ws.borrow_scratch(other.returned_region())
    return shared


def _interpreted_workspace(kind, group: dist.ProcessGroup, device: torch.device, sizes: dict):
    """The workspace of a one-rank group without CUDA: every buffer of the one
    rank in this process (``simulated(1)``; no peer, no symmetric memory), with
    the interpreter tests' small tiles (the interpreter runs every program in
    Python; the default tiles and grid are sized for a GPU's SMs)."""
    world = dist.get_world_size(group)
    if world != 1:
        raise ValueError(
            f"UniEP's kernel schedules (sequential, fused) need CUDA GPUs for an EP group of {world} ranks; "
            "without CUDA they run (in Triton's interpreter) only at parallelism.expert_parallel_degree = 1. "
            "Set [uniep] schedule = \"reference\" on CPU, or expert_parallel_degree = 1."
        )
    if not isinstance(tl.standard.cdiv, InterpretedFunction):
        raise RuntimeError(
            "UniEP's kernel schedules without CUDA need Triton's interpreter, chosen before Triton is first "
            "imported: set TRITON_INTERPRET=1 in the environment (./run_train.sh does on a machine without CUDA)."
        )
    if sizes["dtype"] == torch.bfloat16:
        raise ValueError(
            "UniEP's kernel schedules without CUDA run in Triton's interpreter, whose bf16 dot products are "
            "wrong: compute in float32 (training.mixed_precision_param = \"float32\") or use [uniep] schedule = "
            "\"reference\"."
        )
    return kind.simulated(1, device=device, params=interpreter_params(), **sizes)


@torch.library.custom_op("uniep::moe_experts", mutates_args=())
def moe_experts(
    x: torch.Tensor,
    top_scores: torch.Tensor,
    selected_experts_indices: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    group_name: str,
    schedule: str,
    score_before_experts: bool,
    out_dtype: torch.dtype | None = None,
    master_w1: torch.Tensor | None = None,
    master_w2: torch.Tensor | None = None,
    master_w3: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Routed-expert output ``(T, D)`` of this rank's tokens (see titan_uniep.runtime.forward)
    in ``out_dtype`` (default x's: the GEMMs run in x's dtype, the sum over k in fp32 is
    rounded once to the output's) and the receive slots' h1 | h3 ``(slot_capacity, 2H)``
    (for the backward only). ``master_w*``: the fp32 weights w1, w2, w3 are casts
    of, which receive the weight gradients (see the module docstring); all three or none."""
    _check_master_weights(w1, w2, w3, master_w1, master_w2, master_w3)
    _check_step_copies()
    ws = workspace_for(group_name, x, w1, selected_experts_indices.shape[1], score_before_experts=score_before_experts)
    h13 = x.new_empty(ws.shape.slot_capacity, 2 * w1.shape[1])
    w1, w2, w3 = w1.contiguous(), w2.contiguous(), w3.contiguous()
    out_dtype = out_dtype or x.dtype
    if ws.is_simulated:  # a one-rank group without CUDA: the world of one rank, in place
        out = x.new_empty(1, *x.shape, dtype=out_dtype)
        simulated_moe_forward(
            x.contiguous().unsqueeze(0), top_scores.unsqueeze(0), selected_experts_indices.unsqueeze(0),
            w1.unsqueeze(0), w2.unsqueeze(0), w3.unsqueeze(0), schedule=schedule,
            score_before_experts=score_before_experts, workspace=ws, out=out, saved_h13=h13.unsqueeze(0),
        )
        return out[0], h13
    out = moe_forward(
        x, top_scores, selected_experts_indices, w1, w2, w3, workspace=ws, schedule=schedule,
        score_before_experts=score_before_experts, saved_h13=h13, out=x.new_empty(x.shape, dtype=out_dtype),
    )
    return out, h13


def _check_master_weights(w1, w2, w3, *masters) -> None:
    given = [m is not None for m in masters]
    if not any(given):
        return
    if not all(given):
        raise ValueError("uniep::moe_experts takes master weights for all of w1, w2, w3 or for none")
    for name, w, m in zip(("w1", "w2", "w3"), (w1, w2, w3), masters):
        if m.dtype != torch.float32 or m.shape != w.shape:
            raise ValueError(f"uniep::moe_experts: master_{name} must be the fp32 weight {name} is a cast of "
                             f"(shape {tuple(w.shape)}), got {m.dtype} {tuple(m.shape)}")


def _saved_rows(group_name: str, x: torch.Tensor, w1: torch.Tensor, top_k: int, score_before_experts: bool) -> int:
    """Rows of the op's h1 | h3 output: the forward workspace's slot capacity
    (the same formula before the workspace exists, from what it will be built with)."""
    world = dist.get_world_size(_resolve_process_group(group_name))
    ws = _workspaces.get(_workspace_key(group_name, x, w1, top_k, score_before_experts, backward=False))
    tokens = ws.shape.token_capacity if ws is not None else max(x.shape[0], _reserved_tokens.get(group_name, 0), 1)
    return slot_capacity(world, tokens, top_k, w1.shape[0])


@moe_experts.register_fake
def _moe_experts_fake(x, top_scores, selected_experts_indices, w1, w2, w3, group_name, schedule, score_before_experts,
                      out_dtype=None, master_w1=None, master_w2=None, master_w3=None):
    rows = _saved_rows(group_name, x, w1, selected_experts_indices.shape[1], score_before_experts)
    return x.new_empty(x.shape, dtype=out_dtype or x.dtype), x.new_empty(rows, 2 * w1.shape[1])


@torch.library.custom_op("uniep::moe_experts_backward", mutates_args=())
def moe_experts_backward(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    top_scores: torch.Tensor,
    selected_experts_indices: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    saved_h13: torch.Tensor,
    group_name: str,
    schedule: str,
    score_before_experts: bool,
    weight_grad_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients ``(dx, dscores fp32, dw1, dw2, dw3)`` of ``moe_experts`` given the
    output gradient and the forward's h1 | h3 (see titan_uniep.runtime.backward);
    every one contiguous, in the shape of its input; the weights' in
    ``weight_grad_dtype`` (default theirs; fp32: the GEMM's sums as they are)."""
    _check_step_copies()
    ws = workspace_for(group_name, x, w1, selected_experts_indices.shape[1], score_before_experts=score_before_experts,
                       backward=True)
    weights = (w1.contiguous(), w2.contiguous(), w3.contiguous())
    if ws.is_simulated:  # a one-rank group without CUDA
        (grads,) = simulated_moe_backward(
            grad_out.contiguous().unsqueeze(0), x.contiguous().unsqueeze(0), top_scores.unsqueeze(0),
            selected_experts_indices.unsqueeze(0), *(w.unsqueeze(0) for w in weights), schedule=schedule,
            score_before_experts=score_before_experts, workspace=ws, saved_h13=saved_h13.unsqueeze(0),
            weight_grad_dtype=weight_grad_dtype,
        )
    else:
        grads = moe_backward(
            grad_out.contiguous(), x, top_scores, selected_experts_indices, *weights, workspace=ws,
            schedule=schedule, score_before_experts=score_before_experts, saved_h13=saved_h13,
            weight_grad_dtype=weight_grad_dtype,
        )
    return tuple(grads)


@moe_experts_backward.register_fake
def _moe_experts_backward_fake(grad_out, x, top_scores, selected_experts_indices, w1, w2, w3, saved_h13, group_name,
                               schedule, score_before_experts, weight_grad_dtype=None):
    dtype = weight_grad_dtype or w1.dtype
    return (x.new_empty(x.shape), top_scores.new_empty(top_scores.shape, dtype=torch.float32),
            *(w.new_empty(w.shape, dtype=dtype) for w in (w1, w2, w3)))


def _setup_context(ctx, inputs, output) -> None:
    x, top_scores, indices, w1, w2, w3, group_name, schedule, score_before, _out_dtype, master_w1, _, _ = inputs
    ctx.save_for_backward(x, top_scores, indices, w1, w2, w3, output[1])
    ctx.masters = master_w1 is not None
    ctx.mark_non_differentiable(output[1])
    # No zero-filled gradient of the (large) h1 | h3 output in the backward.
    ctx.set_materialize_grads(False)
    ctx.group_name = group_name
    ctx.schedule = schedule
    ctx.score_before = score_before


def _backward(ctx, grad_out: torch.Tensor | None, _grad_h13: torch.Tensor | None):
    x, top_scores, indices, w1, w2, w3, h13 = ctx.saved_tensors
    if grad_out is None:  # the output did not reach the loss
        grad_out = torch.zeros_like(x)
    # The output's gradient in the GEMMs' dtype (x's), as TorchTitan's experts
    # get theirs through the cast of their output back to the tokens' dtype.
    grad_out = grad_out.to(x.dtype)
    dx, dscores, dw1, dw2, dw3 = torch.ops.uniep.moe_experts_backward(
        grad_out, x, top_scores, indices, w1, w2, w3, h13, ctx.group_name, ctx.schedule, ctx.score_before,
        torch.float32 if ctx.masters else None,
    )
    weight_grads = (None, None, None, dw1, dw2, dw3) if ctx.masters else (dw1, dw2, dw3, None, None, None)
    return dx, dscores.to(top_scores.dtype), None, *weight_grads[:3], None, None, None, None, *weight_grads[3:]


moe_experts.register_autograd(_backward, setup_context=_setup_context)
