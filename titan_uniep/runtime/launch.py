"""Host helpers shared by the forward and the backward launches.

A call of either direction does the same things around its megakernels:
check its inputs against the workspace, pick its ``LayerParams``, route (the
per-block counts, the counts exchange, every copy's slot: ``route``), size
the persistent grid and the wait bound, launch, then check or queue the
error record (``finish``). The call's arrays are one ``CallArrays`` in both
directions: per-rank tensors stacked on a leading local-rank dimension ``L``
(1 for real EP, ``W`` for a simulated world).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Sequence

import torch
import triton
from triton.runtime.interpreter import InterpretedFunction

from ..kernels.route import (count_parts, exchange_counts_kernel, route_block, route_histogram_kernel,
                             route_layout_kernel)
from ..kernels.widen import widen_kernel
from ..params import LayerParams
from .workspace import Workspace

KERNEL_SCHEDULES = ("sequential", "fused")
"""Kernel schedules: ``"sequential"`` launches every task kind on its own
(all communication, then all compute); ``"fused"`` overlaps them inside
persistent grids. Both give the same bits."""

KernelSchedule = Literal["sequential", "fused"]
ErrorCheck = Literal["sync", "lazy"]


@dataclass
class CallArrays:
    """One call's arrays, stacked on a leading local-rank dimension ``L``."""

    x: torch.Tensor  # (L, T, D) the layer's input (T <= the workspace's token capacity)
    scores: torch.Tensor  # (L, T_cap, K) fp32 router scores (T_cap: padded to the capacity when L > 1)
    w1: torch.Tensor  # (L, El, H, D)
    w2: torch.Tensor  # (L, El, D, H)
    w3: torch.Tensor  # (L, El, H, D)
    out: torch.Tensor | None = None  # (L, T, D) forward output
    grad_out: torch.Tensor | None = None  # (L, T, D) backward: the output gradient, laid out as x
    h13: torch.Tensor | None = None  # (L, S, 2H): each slot's h1 | h3 (saved by the forward, read by the backward)


def check_schedule(schedule: str) -> None:
    if schedule not in KERNEL_SCHEDULES:
        raise ValueError(f"schedule must be one of {KERNEL_SCHEDULES}, got {schedule!r}")


def error_check_for(schedule: str, error_check: str | None) -> str:
    """The error check of a call: default lazy for ``"fused"`` (no host
    sync), sync for ``"sequential"``."""
    check = error_check or ("lazy" if schedule == "fused" else "sync")
    if check not in ("sync", "lazy"):
        raise ValueError(f"error_check must be 'sync' or 'lazy', got {check!r}")
    return check


def call_params(ws: Workspace, params: LayerParams | None) -> LayerParams:
    """The call's parameters: ``params`` or the workspace's default."""
    chosen = params or ws.params
    if chosen.block_m != ws.shape.block_m:
        raise ValueError(
            f"params.block_m ({chosen.block_m}) must equal the workspace's ({ws.shape.block_m}): "
            "tiles and their arrival counters are sized with it"
        )
    return chosen


def check_layer_inputs(ws: Workspace, dim: int, x, scores, indices, w1, w2, w3, grad_out=None) -> None:
    """One rank's inputs against the workspace (``dim``: the layer's D)."""
    s = ws.shape
    if x.dim() != 2 or x.shape[1] != dim:
        raise ValueError(f"x must be (T, {dim}), got {tuple(x.shape)}")
    if x.dtype != s.dtype:
        raise ValueError(f"x.dtype ({x.dtype}) must be the workspace's ({s.dtype})")
    if grad_out is not None:
        if tuple(grad_out.shape) != tuple(x.shape) or grad_out.dtype != s.dtype:
            raise ValueError(f"grad_out must be {tuple(x.shape)} {s.dtype}, got {tuple(grad_out.shape)} "
                             f"{grad_out.dtype}")
        if s.elem_size == 2 and dim % 2:
            raise ValueError(f"the backward needs an even dim with 2-byte activations, got {dim}")
    if x.shape[0] > s.token_capacity:
        raise RuntimeError(
            f"{x.shape[0]} tokens exceed the workspace's capacity of {s.token_capacity} per rank; "
            "call ensure_capacity(num_tokens) on the workspace on every rank between steps"
        )
    if tuple(indices.shape) != (x.shape[0], s.top_k) or tuple(scores.shape) != (x.shape[0], s.top_k):
        raise ValueError(
            f"top_scores and selected_experts_indices must be ({x.shape[0]}, {s.top_k}), "
            f"got {tuple(scores.shape)} and {tuple(indices.shape)}"
        )
    el, h = s.num_local_experts, s.hidden
    for name, w, want in (("w1", w1, (el, h, dim)), ("w2", w2, (el, dim, h)), ("w3", w3, (el, h, dim))):
        if tuple(w.shape) != want or w.dtype != s.dtype:
            raise ValueError(f"{name} must be {want} {s.dtype}, got {tuple(w.shape)} {w.dtype}")


def check_saved_h13(ws: Workspace, h13: torch.Tensor) -> None:
    """``(slot_capacity, 2H)`` for a real rank, ``(W, slot_capacity, 2H)`` for a simulated world."""
    s = ws.shape
    want = (s.slot_capacity, 2 * s.hidden) if not ws.is_simulated else (s.world_size, s.slot_capacity, 2 * s.hidden)
    if tuple(h13.shape) != want or h13.dtype != s.dtype or not h13.is_contiguous():
        raise ValueError(f"saved_h13 must be a contiguous {want} {s.dtype} tensor, got {tuple(h13.shape)} {h13.dtype}")


def stack_ranks(tensors: Sequence[torch.Tensor] | torch.Tensor, capacity: int | None, dtype: torch.dtype,
                fill=0) -> torch.Tensor:
    """A simulated world's per-rank tensors as one ``(W, rows, ...)`` tensor:
    a tensor already stacked is used as it is (no copy; ``capacity`` None) or
    must have ``capacity`` rows; a sequence of ``(T_r, ...)`` tensors is
    padded with ``fill`` to ``capacity`` rows (or the longest's)."""
    if isinstance(tensors, torch.Tensor):
        if tensors.dtype != dtype or (capacity is not None and tensors.shape[1] != capacity):
            raise ValueError(f"a stacked per-rank tensor must be {dtype} with {capacity} rows per rank, got "
                             f"{tensors.dtype} {tuple(tensors.shape)}")
        return tensors.contiguous()
    rows = capacity if capacity is not None else max(t.shape[0] for t in tensors)
    out = torch.full((len(tensors), rows, *tensors[0].shape[1:]), fill, dtype=dtype, device=tensors[0].device)
    for r, t in enumerate(tensors):
        out[r, : t.shape[0]] = t
    return out


def rank_tensors(stacked: Sequence[torch.Tensor] | torch.Tensor, world: int) -> list[torch.Tensor]:
    """Per-rank views of a stacked ``(W, ...)`` tensor, or the sequence itself."""
    if isinstance(stacked, torch.Tensor):
        if stacked.shape[0] != world:
            raise ValueError(f"a stacked per-rank tensor must have {world} ranks, got {tuple(stacked.shape)}")
        return list(stacked.unbind(0))
    if len(stacked) != world:
        raise ValueError(f"expected one tensor per simulated rank ({world}), got {len(stacked)}")
    return list(stacked)


def use_timer(ws: Workspace) -> bool:
    """Whether waits are bounded in time (GPU) or in polls (the interpreter)."""
    return ws.device.type == "cuda" and not interpreting()


def interpreting() -> bool:
    """Whether UniEP's kernels run in Triton's interpreter. ``triton.jit`` reads
    ``TRITON_INTERPRET`` when it defines a kernel, so that is when this was
    decided: a variable set or unset later (a test module of the same process)
    changes neither the kernels nor this."""
    return _KERNELS_INTERPRETED


_KERNELS_INTERPRETED = isinstance(widen_kernel, InterpretedFunction)


def check_kernel_mode(device: torch.device) -> None:
    """Refuse GPU tensors for kernels defined for Triton's interpreter: it runs
    a grid's programs one after another on host copies, so the waits on other
    programs and ranks are not what a GPU runs (a layer's output would not be
    one to train on)."""
    if device.type == "cuda" and interpreting():
        raise RuntimeError(
            "UniEP's kernels were defined for Triton's interpreter (TRITON_INTERPRET=1 when they were "
            "imported), but the layer's tensors are on a GPU: unset TRITON_INTERPRET for GPU runs."
        )


def wait_bound(ws: Workspace, params: LayerParams) -> int:
    """Microseconds (GPU) or polls (interpreter): an int32 either way, so no
    recompile. Zero in race mode (``LayerParams.debug_race``): every wait
    polls once, and a tile or token not ready is skipped."""
    if params.debug_race:
        return 0
    return min(int(params.timeout_s * 1e6), 2**31 - 1) if use_timer(ws) else params.interpreter_max_spins


def num_programs(ws: Workspace, params: LayerParams) -> int:
    """The persistent grid: ``params.num_programs`` or one program per SM."""
    if params.num_programs is not None:
        return params.num_programs
    if ws.device.type == "cuda":
        return torch.cuda.get_device_properties(ws.device).multi_processor_count
    return params.dispatch_programs + 1


def programs_per_sm(ws: Workspace, wanted: int) -> int:
    """Programs per SM a launch asks for: ``wanted`` on a GPU, 1 in the interpreter."""
    return wanted if ws.device.type == "cuda" else 1


def precision(ws: Workspace) -> str:
    return "ieee" if ws.shape.dtype == torch.float32 else "tf32"


def _tma_allocator(size: int, alignment: int, stream) -> torch.Tensor:
    return torch.empty(size, dtype=torch.int8, device="cuda")


def ensure_tma_allocator() -> None:
    """Tensor descriptors made on the device need Triton's scratch allocator:
    set ours unless one is set already (in this thread's context)."""
    try:
        from triton.runtime._allocation import NullAllocator, _allocator
    except ImportError:  # another Triton layout: set ours
        triton.set_allocator(_tma_allocator)
        return
    if isinstance(_allocator.get(), NullAllocator):
        triton.set_allocator(_tma_allocator)


def tma_rows(ws: Workspace, *tensors: torch.Tensor) -> list[int] | None:
    """Row counts of ``tensors`` viewed as 2-D ``(rows, last dim)`` matrices for
    device-made tensor descriptors (setting the allocator they need), or None
    where descriptors cannot serve: not on a GPU, not 16-bit data, a row not
    a multiple of 16 bytes, or a tensor that is not contiguous."""
    if ws.device.type != "cuda" or interpreting():
        return None
    if any(t.element_size() != 2 or t.shape[-1] % 8 or not t.is_contiguous() for t in tensors):
        return None
    ensure_tma_allocator()
    return [t.numel() // t.shape[-1] for t in tensors]


# Receive tiles per step (program) of the tile table.
TILE_CB = 256


def route(ws: Workspace, indices: torch.Tensor, num_tokens: int | None, params: LayerParams, *,
          steps: Sequence[str] = ("count", "publish", "collect", "place")) -> None:
    """This call's layout on the device, into the workspace's route arrays
    (``kernels.route``; bitwise what ``layout.compute_layout`` and
    ``compute_tiles`` give): per-block counts, the counts exchange (which also
    derives the per-expert tables and receive tiles), then every copy's
    destination rank, slot and tile. ``indices``: ``(L, T, K)``, padded with
    -1 in a simulated world. ``num_tokens``: this rank's ``T`` (real EP) or
    None (read from ``ws.num_tokens``). ``steps``: a subset, in order (tests
    drive the ranks of a world one step at a time)."""
    check_kernel_mode(ws.device)
    s = ws.shape
    block = route_block(s.num_experts)
    blocks = max(1, -(-indices.shape[1] * s.top_k // block))
    grid = (blocks, ws.num_local_ranks)
    from_host = num_tokens is not None
    meta = dict(NUM_EXPERTS=s.num_experts, TOP_K=s.top_k, BLOCK=block, num_warps=4)
    if "count" in steps:
        route_histogram_kernel[grid](
            indices, indices.stride(0), ws.num_tokens, num_tokens or 0, ws.block_counts, ws.block_counts.stride(0),
            EP=triton.next_power_of_2(s.num_experts), TOKENS_FROM_HOST=from_host, **meta,
        )
    publish, collect = "publish" in steps, "collect" in steps
    if publish or collect:
        exchange_counts(ws, params, publish=publish, collect=collect)
    if "place" in steps:
        # The receive tiles come from here (one chunk of TILE_CB per program) unless
        # local_first's tile_order needs them in the exchange.
        chunks = 0 if params.local_first else -(-s.tile_capacity // TILE_CB)
        route_layout_kernel[(max(blocks, chunks), ws.num_local_ranks)](
            indices, indices.stride(0), ws.num_tokens, ws.block_counts, ws.block_counts.stride(0), ws.route_tables,
            ws.dest_rank, ws.dest_slot, ws.dest_tile, ws.dest_rank.stride(0), ws.tile_expert, ws.tile_start,
            ws.tile_end, ws.rank_base, WORLD=s.world_size, BM=s.block_m,
            ELP=triton.next_power_of_2(s.num_local_experts), TILE_CAPACITY=s.tile_capacity, CB=TILE_CB,
            WRITE_TILES=not params.local_first, **meta,
        )


def route_world(ws: Workspace, indices: Sequence[torch.Tensor], params: LayerParams) -> None:
    """``route`` for a simulated world: every rank's token count and routing."""
    counts = torch.tensor([idx.shape[0] for idx in indices], dtype=torch.int32)
    if ws.device.type == "cuda":
        # Pinned and asynchronous: a pageable copy would make the host wait for
        # the GPU every call (the caching host allocator keeps the block until
        # the copy has run).
        counts = counts.pin_memory()
    ws.num_tokens.copy_(counts, non_blocking=True)
    route(ws, stack_ranks(list(indices), ws.shape.token_capacity, torch.int64, -1), None, params)


def exchange_counts(ws: Workspace, params: LayerParams, *, publish: bool = True, collect: bool = True) -> None:
    """The counts exchange (``kernels.route.exchange_counts_kernel``): a
    publishing launch runs ``count_parts(E)`` programs per local rank."""
    s = ws.shape
    experts = triton.next_power_of_2(s.num_experts)
    parts = count_parts(s.num_experts)
    args = (
        ws.block_counts, ws.block_counts.stride(0), ws.counts_all, ws.route_args, ws.control, ws.arena_args,
        ws.anchor_rank, ws.rank_base, wait_bound(ws, params), math.ceil(s.num_local_experts * params.local_first_experts),
    )
    meta = dict(
        WORLD=s.world_size, NUM_EXPERTS=s.num_experts, TILE_CAPACITY=s.tile_capacity,
        TOKEN_CAPACITY=s.token_capacity, BLOCK=1024, USE_TIMER=use_timer(ws), num_warps=4,
        TOP_K=s.top_k, EP=experts, ELP=triton.next_power_of_2(s.num_local_experts), BM=s.block_m,
        ROUTE_BLOCK=route_block(s.num_experts), PARTS=parts, SB=max(1, 8192 * parts // experts), CB=TILE_CB,
        TILE_ORDER=params.local_first, EPOCH_STORE_DELAY_US=params.debug_epoch_store_delay_us,
    )
    ranks = ws.num_local_ranks
    if ranks > 1:
        # Every simulated rank publishes before any waits (programs may run one by one).
        if publish:
            exchange_counts_kernel[(ranks, parts)](*args, PUBLISH=True, COLLECT=False, **meta)
        if collect:
            exchange_counts_kernel[(ranks, 1)](*args, PUBLISH=False, COLLECT=True, **meta)
    else:
        exchange_counts_kernel[(ranks, parts if publish else 1)](*args, PUBLISH=publish, COLLECT=collect, **meta)


def finish(ws: Workspace, check: str) -> None:
    """After a real-EP call's launches: check the error record now (a host
    sync; skipped inside CUDA-graph capture) or queue a copy of it for the
    next call's ``poll_errors``."""
    if check == "sync":
        if not (ws.device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            ws.check_errors()
    else:
        ws.schedule_error_poll()


_WIDEN_BLOCK = 8192


def widen_to_float32(t: torch.Tensor) -> torch.Tensor:
    """``t`` in fp32, exact: a 16-bit CUDA tensor through ``kernels.widen``
    (vectorized), anything else through ``Tensor.to``."""
    if t.device.type != "cuda" or t.dtype.itemsize != 2:
        return t.to(torch.float32)
    t = t.contiguous()
    out = torch.empty(t.shape, dtype=torch.float32, device=t.device)
    if t.numel():
        widen_kernel[(triton.cdiv(t.numel(), _WIDEN_BLOCK),)](t, out, t.numel(), BLOCK=_WIDEN_BLOCK, num_warps=8)
    return out
