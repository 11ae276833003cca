"""Host API of UniEP's forward megakernels (usable without TorchTitan).

One MoE layer's routed-expert path, from router output to combined output:

    route kernels: counts, exchange, layout (kernels.route: layout.compute_layout
    and compute_tiles, bitwise, in three small launches)
    -> megakernel A: dispatch + fc1 (w1, w3) + SwiGLU
    -> megakernel B: fc2 + combine

``schedule="fused"`` overlaps communication and GEMM tiles inside each
megakernel; ``schedule="sequential"`` launches the same kernels phase by
phase (all dispatch, then all fc1; all fc2, then all reduce). Both place every
row by ``titan_uniep.layout`` and run the same compiled tile code, so their
outputs are bitwise equal.

Nothing on the fused path synchronises with the host: buffers are sized for
the worst case (``titan_uniep.symm``), the kernels read every count on the
device, and errors are polled lazily (``Workspace.poll_errors``). The whole
call can be captured in a CUDA graph (after one eager call has compiled the
kernels).

Shapes (``T`` tokens of this rank, ``D`` dim, ``H`` expert hidden dim, ``K``
experts per token, ``E`` experts, ``El = E / W`` local experts):

- ``x``: ``(T, D)`` bf16 / fp16 / fp32 (the workspace's dtype); ``T`` may be 0.
- ``top_scores``: ``(T, K)`` router scores (fp32, as TorchTitan's router gives).
- ``selected_experts_indices``: ``(T, K)`` int, global expert ids in
  ``[0, E)``, distinct within a token.
- ``w1``, ``w3``: ``(El, H, D)``; ``w2``: ``(El, D, H)`` -- this rank's experts
  in TorchTitan's GroupedExperts layout, the workspace's dtype.
- returns ``(T, D)`` in ``x.dtype``: ``sum_k score[t,k] * FFN_e(x[t])``
  (scores after the experts) or ``sum_k FFN_e(bf16(x[t] * score[t,k]))``
  (before), summed over k = 0..K-1 in fp32.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Literal, Sequence

import torch
import triton

from .kernels.dispatch_fc1 import dispatch_fc1_kernel
from .kernels.fc2_combine import fc2_combine_kernel
from .kernels.route import route_block, route_histogram_kernel, route_layout_kernel
from .kernels.sync import exchange_counts_kernel
from .kernels.tuning import KernelConfig, default_config
from .layout import RouteLayout, token_destinations
from .symm import Workspace

__all__ = ["moe_forward", "simulated_moe_forward", "exchange_bytes", "SCHEDULES"]

SCHEDULES = ("sequential", "fused")
Schedule = Literal["sequential", "fused"]


@dataclass
class _Call:
    """One call's arrays, stacked on a leading local-rank dimension L."""

    x: torch.Tensor  # (L, T, D)
    scores: torch.Tensor  # (L, T, K) fp32
    dest_rank: torch.Tensor  # (L, T, K) int32
    dest_slot: torch.Tensor  # (L, T, K) int32
    dest_tile: torch.Tensor  # (L, T, K) int32
    num_tokens: torch.Tensor  # (L,) int32
    tile_expert: torch.Tensor  # (L, C) int32
    tile_start: torch.Tensor  # (L, C) int32
    tile_end: torch.Tensor  # (L, C) int32
    num_tiles: torch.Tensor  # (L,) int32
    w1: torch.Tensor  # (L, El, H, D)
    w2: torch.Tensor  # (L, El, D, H)
    w3: torch.Tensor  # (L, El, H, D)
    out: torch.Tensor  # (L, T, D)
    h13: torch.Tensor | None = None  # (L, S, 2H): h1 | h3 per slot, for the backward


def moe_forward(
    x: torch.Tensor,
    top_scores: torch.Tensor,
    selected_experts_indices: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    *,
    workspace: Workspace,
    schedule: Schedule = "fused",
    score_before_experts: bool,
    config: KernelConfig | None = None,
    out: torch.Tensor | None = None,
    error_check: Literal["sync", "lazy"] | None = None,
    saved_h13: torch.Tensor | None = None,
) -> torch.Tensor:
    """Routed experts of one MoE layer with real EP (one process per GPU).

    Every rank of ``workspace``'s group must call it, in the same order of
    layers, also with ``T = 0``. Shapes: see the module docstring. ``out``:
    optional preallocated ``(T, D)`` output. ``config``: default the
    workspace's; when that is the EP-size default, the per-shape choice of
    ``kernels.tuning.default_config(ep, hidden=H)`` (other timing; fused ==
    sequential bitwise either way). ``error_check``: ``"sync"``
    (check the error record after the launches; a host sync) or ``"lazy"``
    (poll without syncing, see ``Workspace.poll_errors``); default lazy for
    ``"fused"``, sync for ``"sequential"``. ``saved_h13``: optional
    ``(slot_capacity, 2 * H)`` buffer that receives each slot's h1 and h3
    (rounded; rows of slots this call does not use are left alone), which
    ``fused_backward.moe_backward(saved_h13=...)`` then uses instead of
    recomputing fc1.
    """
    if workspace.is_simulated:
        raise ValueError("moe_forward needs a Workspace.for_group workspace; use simulated_moe_forward otherwise")
    if config is None and workspace.config == default_config(workspace.world_size):
        # The per-shape choice of kernels.tuning (dispatch-first and B's tiles for short expert GEMMs).
        config = default_config(workspace.world_size, hidden=workspace.shape.hidden)
    cfg = _config(workspace, config)
    _check_schedule(schedule)
    check = error_check or ("lazy" if schedule == "fused" else "sync")
    if check == "lazy":
        workspace.poll_errors()
    _check_inputs(workspace, x, top_scores, selected_experts_indices, w1, w2, w3)
    indices = selected_experts_indices.contiguous().unsqueeze(0)
    _route(workspace, indices, x.shape[0], cfg)
    call = _prepare_rank_call(workspace, x, top_scores, w1, w2, w3, out)
    if saved_h13 is not None:
        _check_h13(workspace, saved_h13)
        call.h13 = saved_h13.unsqueeze(0)
    _launch(workspace, call, cfg, score_before_experts, _PHASES[schedule])
    _finish(workspace, check)
    return call.out[0]


def simulated_moe_forward(
    xs: Sequence[torch.Tensor],
    scores: Sequence[torch.Tensor],
    indices: Sequence[torch.Tensor],
    w1s: Sequence[torch.Tensor],
    w2s: Sequence[torch.Tensor],
    w3s: Sequence[torch.Tensor],
    *,
    schedule: Schedule = "fused",
    score_before_experts: bool,
    config: KernelConfig | None = None,
    workspace: Workspace | None = None,
    outs: Sequence[torch.Tensor] | None = None,
    saved_h13: torch.Tensor | None = None,
) -> list[torch.Tensor]:
    """The same forward for a simulated world of ``W = len(xs)`` ranks held in
    this process (CPU interpreter or one GPU): one launch runs every rank.

    Per rank ``r``: ``xs[r]`` ``(T_r, D)``, ``scores[r]``/``indices[r]``
    ``(T_r, K)``, ``w1s[r]``/``w3s[r]`` ``(El, H, D)``, ``w2s[r]`` ``(El, D, H)``.
    ``workspace``: a ``Workspace.simulated`` to reuse (built per call if None).
    ``outs``: optional preallocated ``(T_r, D)`` outputs (filled in place).
    ``saved_h13``: optional ``(W, slot_capacity, 2 * H)``, see ``moe_forward``.
    Returns the ``W`` outputs ``(T_r, D)``.
    """
    world = len(xs)
    if not (len(scores) == len(indices) == len(w1s) == len(w2s) == len(w3s) == world):
        raise ValueError("xs, scores, indices, w1s, w2s, w3s must have one entry per simulated rank")
    _check_schedule(schedule)
    num_tokens = [x.shape[0] for x in xs]
    capacity = max(max(num_tokens), 1)
    if workspace is None:
        el, hidden, dim = w1s[0].shape
        workspace = Workspace.simulated(
            world, num_tokens=capacity, dim=dim, hidden=hidden, num_experts=el * world,
            top_k=indices[0].shape[1], dtype=xs[0].dtype, device=xs[0].device, config=config,
        )
    elif not workspace.is_simulated or workspace.world_size != world:
        raise ValueError(f"workspace must be a Workspace.simulated of {world} ranks")
    cfg = _config(workspace, config)
    shape = workspace.shape
    for r in range(world):
        _check_inputs(workspace, xs[r], scores[r], indices[r], w1s[r], w2s[r], w3s[r])
    cap = shape.token_capacity
    _route_world(workspace, indices, cfg)
    out = torch.empty(world, cap, shape.dim, dtype=shape.dtype, device=xs[0].device)
    call = _Call(
        x=_pad_ranks(xs, cap, shape.dtype),
        scores=_pad_ranks(scores, cap, torch.float32),
        dest_rank=workspace.dest_rank,
        dest_slot=workspace.dest_slot,
        dest_tile=workspace.dest_tile,
        num_tokens=workspace.num_tokens,
        tile_expert=workspace.tile_expert,
        tile_start=workspace.tile_start,
        tile_end=workspace.tile_end,
        num_tiles=workspace.num_tiles,
        w1=torch.stack([w.contiguous() for w in w1s]),
        w2=torch.stack([w.contiguous() for w in w2s]),
        w3=torch.stack([w.contiguous() for w in w3s]),
        out=out,
    )
    if saved_h13 is not None:
        _check_h13(workspace, saved_h13)
        call.h13 = saved_h13
    _launch(workspace, call, cfg, score_before_experts, _PHASES[schedule])
    workspace.check_errors()
    results = [out[r, : num_tokens[r]] for r in range(world)]
    if outs is not None:
        for dst, src in zip(outs, results):
            dst.copy_(src)
        return list(outs)
    return results


def exchange_bytes(layout: RouteLayout, dim: int, elem_size: int) -> dict[str, torch.Tensor]:
    """Bytes this rank sends to other ranks in one forward (device scalars).

    ``dispatch_copies``: one row per (token, k) copy (TorchTitan's all-to-all);
    ``dispatch_dedup``: one row per (token, destination rank) (UniEP);
    ``combine``: one row per copy back to its source.
    """
    remote = torch.ones(layout.ep_size, dtype=torch.bool, device=layout.dest_rank.device)
    remote[layout.rank] = False
    copies = layout.send_counts[remote].sum()
    dedup = token_destinations(layout)[:, remote].sum()
    row = dim * elem_size
    return {"dispatch_copies": copies * row, "dispatch_dedup": dedup * row, "combine": copies * row}


# ---- internals ------------------------------------------------------------

# Launches of each schedule; a phase joined by "+" is one launch doing both.
_PHASES = {"fused": ("dispatch+fc1", "fc2+send+reduce"), "sequential": ("dispatch", "fc1", "fc2", "send", "reduce")}


def _prepare_rank_call(ws, x, top_scores, w1, w2, w3, out: torch.Tensor | None) -> _Call:
    """Arrays of one real rank (L = 1); the layout ones are the workspace's,
    filled by ``_route`` for this call."""
    if out is None:
        out = torch.empty_like(x)
    return _Call(
        x=x.contiguous().unsqueeze(0),
        scores=top_scores.to(torch.float32).contiguous().unsqueeze(0),
        dest_rank=ws.dest_rank,
        dest_slot=ws.dest_slot,
        dest_tile=ws.dest_tile,
        num_tokens=ws.num_tokens,
        tile_expert=ws.tile_expert,
        tile_start=ws.tile_start,
        tile_end=ws.tile_end,
        num_tiles=ws.num_tiles,
        w1=w1.contiguous().unsqueeze(0),
        w2=w2.contiguous().unsqueeze(0),
        w3=w3.contiguous().unsqueeze(0),
        out=out.unsqueeze(0),
    )


def _route(ws: Workspace, indices: torch.Tensor, num_tokens: int | None, cfg: KernelConfig, *,
           steps: Sequence[str] = ("count", "publish", "collect", "place")) -> None:
    """This call's layout on the device: per-block counts, the counts exchange
    (which also derives the per-expert tables and receive tiles), then every
    copy's destination rank, slot and tile, into the workspace's arrays
    (``kernels.route``; bitwise what ``layout.compute_layout`` and
    ``compute_tiles`` give). ``indices``: ``(L, T, K)``, padded with -1 in a
    simulated world. ``num_tokens``: this rank's ``T`` (real EP) or ``None``
    (read from ``ws.num_tokens``). ``steps``: a subset, in order (tests drive
    the ranks of a world one step at a time)."""
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
        _exchange_counts(ws, cfg, publish=publish, collect=collect)
    if "place" in steps:
        route_layout_kernel[grid](
            indices, indices.stride(0), ws.num_tokens, ws.block_counts, ws.block_counts.stride(0), ws.route_tables,
            ws.dest_rank, ws.dest_slot, ws.dest_tile, ws.dest_rank.stride(0), WORLD=s.world_size, BM=s.block_m,
            **meta,
        )


def _pad_ranks(tensors: Sequence[torch.Tensor], capacity: int, dtype: torch.dtype, fill=0) -> torch.Tensor:
    """Per-rank ``(T_r, ...)`` tensors stacked as ``(W, capacity, ...)``, padded with ``fill``."""
    out = torch.full((len(tensors), capacity, *tensors[0].shape[1:]), fill, dtype=dtype, device=tensors[0].device)
    for r, t in enumerate(tensors):
        out[r, : t.shape[0]] = t
    return out


def _route_world(ws: Workspace, indices: Sequence[torch.Tensor], cfg: KernelConfig) -> None:
    """``_route`` for a simulated world: every rank's token count and routing."""
    ws.num_tokens.copy_(torch.tensor([idx.shape[0] for idx in indices], dtype=torch.int32))
    _route(ws, _pad_ranks(indices, ws.shape.token_capacity, torch.int64, -1), None, cfg)


def _check_h13(ws: Workspace, h13: torch.Tensor) -> None:
    """``(slot_capacity, 2H)`` for a real rank, ``(W, slot_capacity, 2H)`` for a simulated world."""
    s = ws.shape
    want = (s.slot_capacity, 2 * s.hidden) if not ws.is_simulated else (s.world_size, s.slot_capacity, 2 * s.hidden)
    if tuple(h13.shape) != want or h13.dtype != s.dtype or not h13.is_contiguous():
        raise ValueError(f"saved_h13 must be a contiguous {want} {s.dtype} tensor, got {tuple(h13.shape)} {h13.dtype}")


def _check_schedule(schedule: str) -> None:
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")


def _config(workspace: Workspace, config: KernelConfig | None) -> KernelConfig:
    cfg = config or workspace.config
    if cfg.block_m != workspace.shape.block_m:
        raise ValueError(
            f"config.block_m ({cfg.block_m}) must equal the workspace's ({workspace.shape.block_m}): "
            "tiles and their arrival counters are sized with it"
        )
    return cfg


def _check_inputs(ws: Workspace, x, scores, indices, w1, w2, w3) -> None:
    s = ws.shape
    if x.dim() != 2 or x.shape[1] != s.dim:
        raise ValueError(f"x must be (T, {s.dim}), got {tuple(x.shape)}")
    if x.dtype != s.dtype:
        raise ValueError(f"x.dtype ({x.dtype}) must be the workspace's ({s.dtype})")
    if x.shape[0] > s.token_capacity:
        raise RuntimeError(
            f"{x.shape[0]} tokens exceed the workspace's capacity of {s.token_capacity} per rank; "
            "call workspace.ensure_capacity(num_tokens) on every rank before the step"
        )
    if tuple(indices.shape) != (x.shape[0], s.top_k) or tuple(scores.shape) != (x.shape[0], s.top_k):
        raise ValueError(
            f"top_scores and selected_experts_indices must be ({x.shape[0]}, {s.top_k}), "
            f"got {tuple(scores.shape)} and {tuple(indices.shape)}"
        )
    el, h, d = s.num_local_experts, s.hidden, s.dim
    for name, w, want in (("w1", w1, (el, h, d)), ("w2", w2, (el, d, h)), ("w3", w3, (el, h, d))):
        if tuple(w.shape) != want or w.dtype != s.dtype:
            raise ValueError(f"{name} must be {want} {s.dtype}, got {tuple(w.shape)} {w.dtype}")


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
    device-made tensor descriptors, or None where descriptors cannot serve:
    not on a GPU, not 16-bit data, a row not a multiple of 16 bytes, or a
    tensor that is not contiguous."""
    if ws.device.type != "cuda" or os.environ.get("TRITON_INTERPRET", "0") == "1":
        return None
    if any(t.element_size() != 2 or t.shape[-1] % 8 or not t.is_contiguous() for t in tensors):
        return None
    return [t.numel() // t.shape[-1] for t in tensors]


def _use_timer(ws: Workspace) -> bool:
    return ws.device.type == "cuda" and os.environ.get("TRITON_INTERPRET", "0") != "1"


def _timeout(ws: Workspace, cfg: KernelConfig) -> int:
    # Microseconds (GPU) or polls (interpreter): an int32 either way, so no recompile.
    return min(int(cfg.timeout_s * 1e6), 2**31 - 1) if _use_timer(ws) else cfg.interpreter_max_spins


def _num_programs(ws: Workspace, cfg: KernelConfig) -> int:
    if cfg.num_programs is not None:
        return cfg.num_programs
    if ws.device.type == "cuda":
        return torch.cuda.get_device_properties(ws.device).multi_processor_count
    return cfg.num_comm_sms + 1


def _exchange_counts(ws: Workspace, cfg: KernelConfig, *, publish: bool = True, collect: bool = True) -> None:
    s, off = ws.shape, ws.element_offsets
    experts = triton.next_power_of_2(s.num_experts)
    common = (
        ws.block_counts, ws.block_counts.stride(0), ws.num_tokens, ws.counts_all, ws.route_tables, ws.tile_expert,
        ws.tile_start, ws.tile_end, ws.num_tiles, ws.tile_order, ws.control, ws.arena_ptrs, ws.anchors[torch.int64], ws.anchors[torch.int32],
        ws.anchor_rank, ws.rank_base, off["counts"], off["count_flags"], off["tile_arrivals"], off["token_arrivals"],
        off["tile_done"], _timeout(ws, cfg), math.ceil(s.num_local_experts * cfg.local_first_experts),
    )
    meta = dict(
        WORLD=s.world_size, NUM_EXPERTS=s.num_experts, TILE_CAPACITY=s.tile_capacity,
        TOKEN_CAPACITY=s.token_capacity, BLOCK=1024, USE_TIMER=_use_timer(ws), num_warps=4,
        TOP_K=s.top_k, EP=experts, ELP=triton.next_power_of_2(s.num_local_experts), BM=s.block_m,
        ROUTE_BLOCK=route_block(s.num_experts), SB=max(1, 8192 // experts), CB=256, TILE_ORDER=cfg.local_first,
    )
    grid = (ws.num_local_ranks,)
    if ws.num_local_ranks > 1:
        # Every simulated rank publishes before any waits (programs may run one by one).
        if publish:
            exchange_counts_kernel[grid](*common, PUBLISH=True, COLLECT=False, **meta)
        if collect:
            exchange_counts_kernel[grid](*common, PUBLISH=False, COLLECT=True, **meta)
    else:
        exchange_counts_kernel[grid](*common, PUBLISH=publish, COLLECT=collect, **meta)


def _launch(ws: Workspace, call: _Call, cfg: KernelConfig, score_before: bool, phases: Sequence[str]) -> None:
    """Launch the megakernels for ``phases`` (see ``_PHASES``), in order."""
    s, off = ws.shape, ws.element_offsets
    act, i32, f32 = ws.anchors[s.dtype], ws.anchors[torch.int32], ws.anchors[torch.float32]
    grid = (_num_programs(ws, cfg),)
    precision = "ieee" if s.dtype == torch.float32 else "tf32"
    use_timer, timeout = _use_timer(ws), _timeout(ws, cfg)
    launch_opts = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    h13 = call.h13 if call.h13 is not None else ws.h  # never written unless saving

    def megakernel_a(do_dispatch: int, do_fc1: int, dispatch_programs: int) -> None:
        dispatch_fc1_kernel[grid](
            call.x, call.x.stride(0), call.scores, call.dest_rank, call.dest_slot, call.dest_tile,
            call.dest_rank.stride(0), call.num_tokens, call.tile_expert, call.tile_start, call.tile_end,
            call.tile_expert.stride(0), call.num_tiles, ws.tile_order, call.w1, call.w3, call.w1.stride(0),
            ws.h, ws.h.stride(0), h13, h13.stride(0), ws.control, ws.arena_ptrs, act, i32, f32, ws.anchor_rank,
            off["tokens"], off["slot_copy"], off["slot_score"], off["tile_arrivals"], off["token_slots"],
            off["token_tiles"], ws.rank_base, s.token_capacity, s.slot_capacity, s.tile_capacity,
            do_dispatch, do_fc1, dispatch_programs, cfg.debug_silent_rank, timeout, int(cfg.local_first),
            NUM_LOCAL=ws.num_local_ranks, WORLD=s.world_size, DIM=s.dim, HIDDEN=s.hidden, TOP_K=s.top_k,
            SCORE_BEFORE=score_before, BM=cfg.block_m, BN=cfg.block_n_fc1, BK=cfg.block_k, GROUP_M=cfg.group_m,
            BT=cfg.comm_block_tokens, BD=cfg.comm_block_dim, KP=triton.next_power_of_2(s.top_k),
            EVEN_K=s.dim % cfg.block_k == 0, EVEN_N=s.hidden % cfg.block_n_fc1 == 0, PRECISION=precision,
            USE_TIMER=use_timer, PRESUM=presum, SAVE_H13=call.h13 is not None, **launch_opts,
        )

    staged = cfg.combine == "staged"
    presum = cfg.combine == "presum"
    if (staged and ws.y is None) or (presum and not s.presum_combine):
        raise ValueError(
            f"KernelConfig.combine={cfg.combine!r} needs a workspace built with it (it allocates the fc2 output "
            "buffer y, and for 'presum' the partials / token_slots / token_tiles arena buffers); a workspace built "
            "with combine='presum' serves every combine mode"
        )
    y = ws.y if (staged or presum) else ws.h  # never read unless staged / presum

    grid_b = (grid[0] * (cfg.fc2_programs_per_sm if ws.device.type == "cuda" else 1),)
    b_rows = tma_rows(ws, ws.h, call.w2) if cfg.fc2_tma else None
    if b_rows is not None:
        ensure_tma_allocator()
    b_opts = dict(num_warps=cfg.fc2_num_warps or cfg.num_warps,
                  num_stages=cfg.num_stages if cfg.fc2_num_stages is None else cfg.fc2_num_stages)
    if cfg.fc2_max_registers is not None:
        b_opts["maxnreg"] = cfg.fc2_max_registers

    def megakernel_b(do_fc2: int, do_send: int, do_reduce: int, send_programs: int) -> None:
        fc2_combine_kernel[grid_b](
            ws.h, ws.h.stride(0), call.w2, call.w2.stride(0), call.tile_expert, call.tile_start, call.tile_end,
            call.tile_expert.stride(0), call.num_tiles, call.scores, call.scores.stride(0), call.num_tokens,
            call.out, call.out.stride(0), ws.control, ws.arena_ptrs, act, i32, ws.anchor_rank,
            off["slot_copy"], off["returned"], off["token_arrivals"], off["tile_done"], y, y.stride(0),
            call.dest_rank, f32, off["slot_score"], off["token_slots"], off["token_tiles"], off["partials"],
            ws.rank_base, s.token_capacity, s.slot_capacity, do_fc2, do_send, do_reduce, send_programs, timeout,
            *(b_rows or (0, 0)),
            NUM_LOCAL=ws.num_local_ranks, DIM=s.dim, HIDDEN=s.hidden, TOP_K=s.top_k,
            SCORE_BEFORE=score_before, BM=cfg.block_m, BN=cfg.block_n_fc2, BK=cfg.block_k, GROUP_M=cfg.group_m,
            BT=cfg.reduce_block_tokens, BD=cfg.reduce_block_dim,
            EVEN_K=s.hidden % cfg.block_k == 0, EVEN_N=s.dim % cfg.block_n_fc2 == 0, PRECISION=precision,
            USE_TIMER=use_timer, STAGED=staged, DEFER_RELEASE=cfg.defer_release and cfg.combine == "direct",
            PRESUM=presum, WORLD=s.world_size, KP=triton.next_power_of_2(s.top_k), TMA=b_rows is not None,
            **b_opts,
        )

    for phase in phases:
        if phase == "dispatch+fc1":
            megakernel_a(1, 1, cfg.num_comm_sms)
        elif phase == "dispatch":
            megakernel_a(1, 0, grid[0])
        elif phase == "fc1":
            megakernel_a(0, 1, 0)
        elif phase == "fc2+send+reduce":
            megakernel_b(1, 1, 1, cfg.num_combine_sms if staged else 0)
        elif phase == "fc2":
            megakernel_b(1, 0, 0, 0)
        elif phase == "send":
            if staged or presum:
                megakernel_b(0, 1, 0, 0)
        elif phase == "reduce":
            megakernel_b(0, 0, 1, 0)
        else:
            raise ValueError(f"unknown phase {phase!r}")


def _finish(ws: Workspace, check: str) -> None:
    if check == "sync":
        if not (ws.device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            ws.check_errors()
    elif check == "lazy":
        ws.schedule_error_poll()
    else:
        raise ValueError(f"error_check must be 'sync' or 'lazy', got {check!r}")
