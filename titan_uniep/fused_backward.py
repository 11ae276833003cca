"""Host API of UniEP's backward megakernels (see ``kernels/backward.py``).

Backward of one MoE layer's routed-expert path, given the forward's inputs and
the output gradient, on the same deterministic layout as the forward:

    route kernels (the forward's, on the backward workspace: same slots)
    -> megakernel BA: dispatch [x | dOut] + recompute h1, h3 + G = dOut @ w2
       + SwiGLU backward (h, dh1, dh3 per slot; router-score partials
       <G, h> when scores come after the experts); with h1 | h3 saved by
       the forward, the tiles only compute G (fp32, per slot) and
       ``swiglu_backward_kernel`` runs the SwiGLU backward as a streaming pass
    -> megakernel BB: dA = dh1 @ w1 + dh3 @ w3 sent back and combined over k
       (dx, router-score grads)
    -> weight grads (``kernels.wgrad``, no communication): each slot's x and
       dOut rows in dense slot order (with saved h1 | h3 written by BA's dH
       tasks, ``BACKWARD_TILES["dh_copies_rows"]``; else by a gather launch),
       then per expert over all its rows: ``torch._grouped_mm`` on the GPU in
       bf16, the Triton kernel elsewhere (``BACKWARD_TILES["wgrad"]``)

What is kept between forward and backward: the op's inputs (x, scores,
indices, weights) and, when the forward was given ``saved_h13``, each
slot's h1 and h3 (``slot_capacity x 2H`` in the activation dtype, as
TorchTitan's autograd keeps them); without it, h1 and h3 are recomputed
from x (fc1, two GEMMs, again). x is dispatched again next to dOut (one
``2 * D`` row per token and destination rank) for dW1/dW3; h is rebuilt from
h1 and h3. The router-score gradient ``<dOut, y>`` needs no fc2 recompute
(``= <dOut @ w2, h>``). Memory: the backward workspace (with saved h1 | h3
also its fp32 G buffer, ``slot_capacity x H x 4`` bytes), plus ``saved_h13``.

``schedule="sequential"`` launches every task kind separately (dispatch, dH
tiles, SwiGLU backward pass, dA tiles, weight grads, reduce); ``"fused"`` runs
dispatch and dH tiles in one persistent grid (every program dispatches first,
then takes dH tiles, which wait, bounded, on their arrival counters), then the
SwiGLU pass (saved h1 | h3 only), then dA tiles and reduce in another
persistent grid, then the weight grads. Same layout, same compiled tiles, the same
SwiGLU and weight-gradient launches: every gradient is bitwise equal between
the schedules and run to run. Nothing syncs with the host (errors are polled
lazily, as in the forward; ``error_check="sync"`` checks at the end of the call).

Shapes (``T`` tokens of this rank, ``D`` dim, ``H`` expert hidden, ``K``
experts per token, ``El`` local experts), all as the forward
(``titan_uniep.fused``):

- ``grad_out``, ``x``: ``(T, D)`` in the workspace dtype; ``top_scores``
  ``(T, K)`` fp32; ``indices`` ``(T, K)`` int, distinct per token;
- ``w1``, ``w3`` ``(El, H, D)``, ``w2`` ``(El, D, H)`` in the workspace dtype;
- returns ``dx (T, D)`` (x.dtype), ``dscores (T, K)`` fp32, ``dw1``, ``dw2``,
  ``dw3`` (the weights' shapes and dtype; accumulated in fp32, experts with no
  rows get zeros).
"""

from __future__ import annotations

import os
from typing import Literal, Sequence

import torch
import torch.distributed as dist
import triton

from .kernels.backward import dispatch_grad_hidden_kernel, grad_input_combine_kernel, swiglu_backward_kernel
from .kernels.route import ROW_EXPERT_BASE, ROW_ROWS
from .kernels.wgrad import expert_weight_grad_kernel, gather_slot_rows_kernel
from .kernels.sync import BAD_SLOT, WAIT_COUNTS_FLAG, WAIT_TILE_ROWS, WAIT_TOKEN_ROWS
from .fused import (
    SCHEDULES,
    _check_h13,
    _check_schedule,
    _finish,
    _num_programs,
    _pad_ranks,
    _route,
    _route_world,
    _timeout,
    _use_timer,
    ensure_tma_allocator,
    tma_rows,
)
from .kernels.tuning import KernelConfig, default_config
from .symm import Workspace

__all__ = ["BackwardWorkspace", "moe_backward", "simulated_moe_backward", "SCHEDULES"]

Schedule = Literal["sequential", "fused"]

# Launches of each schedule; "+" joins task kinds run by one persistent grid.
_PHASES = {
    "fused": ("dispatch+dh", "swiglu", "da+reduce", "wgrad"),
    "sequential": ("dispatch", "dh", "swiglu", "da", "wgrad", "reduce"),
}

_WHAT = {
    WAIT_COUNTS_FLAG: "the backward counts exchange, waiting for rank {index}'s counts (count_flags[{index}])",
    WAIT_TILE_ROWS: "backward megakernel BA (dH), waiting for the dispatched [x | dOut] rows of tile {index}",
    WAIT_TOKEN_ROWS: "backward megakernel BB (combine), waiting for token {index}'s dA rows (token_arrivals)",
    BAD_SLOT: "backward dispatch: token {index} has a copy whose slot is outside the receive buffer",
}


class BackwardWorkspace:
    """Buffers of the backward of one EP group, by composition: a ``symm.Workspace``
    built for rows of ``2 * D`` (its ``tokens`` hold ``[x | dOut]`` rows, its
    ``returned`` rows hold dA and the fp32 router-score gradient; its route
    arrays hold the call's layout), plus local ``dh1``/``dh3`` ``(L, S, H)``
    next to its ``h``, the router-score partials ``ds_parts``
    ``(L, S, cdiv(H, dh))`` fp32 (``dh`` the dH tile width, ``BACKWARD_TILES``)
    and ``slot_rows`` ``(L, 2, S, D)``: each slot's x and dOut rows in slot
    order, the weight gradients' dense operands.

    Memory per rank (``S = W * T * min(K, El)`` slots, ``b`` bytes per
    element): symmetric ``2 * W * T * D * b`` (token rows) + ``2 * T * K * D * b``
    (returned) + small index/flag buffers; local ``3 * S * H * b`` +
    ``4 * S * cdiv(H, dh)`` + ``2 * S * D * b`` (slot rows) + the route
    arrays, and ``4 * S * H`` (``g32``, once a call had saved h1 | h3). Build
    it before CUDA-graph capture; reuse it for every layer and step.
    """

    def __init__(self, inner: Workspace, dim: int):
        self.inner = inner
        self.dim = dim
        inner.error_context = ("backward", _WHAT)
        self._allocate_local()

    def _allocate_local(self) -> None:
        inner = self.inner
        self.dh1 = torch.empty_like(inner.h)
        self.dh3 = torch.empty_like(inner.h)
        parts = triton.cdiv(inner.shape.hidden, backward_block_sizes(inner.config)["dh"])
        self.ds_parts = torch.empty(inner.num_local_ranks, inner.shape.slot_capacity, parts, dtype=torch.float32,
                                    device=inner.device)
        self.slot_rows = torch.empty(inner.num_local_ranks, 2, inner.shape.slot_capacity, self.dim,
                                     dtype=inner.shape.dtype, device=inner.device)
        self.g32 = None  # (L, S, H) fp32, allocated by the first call with saved h1 | h3

    def g32_buffer(self) -> torch.Tensor:
        """G = dOut @ w2 per slot in fp32 (the dH tiles' output when h1 | h3 are
        saved; ``swiglu_backward_kernel`` reads it). Allocated on first use."""
        if self.g32 is None:
            inner = self.inner
            if inner.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("BackwardWorkspace: call once with saved h1 | h3 outside CUDA-graph capture first")
            self.g32 = torch.empty(inner.h.shape, dtype=torch.float32, device=inner.device)
        return self.g32

    def ds_parts_for(self, col_blocks: int) -> torch.Tensor:
        """The score-partial buffer for dH tiles of ``col_blocks`` column blocks
        (reallocated when a call's tiles differ from the workspace config's)."""
        if self.ds_parts.shape[2] != col_blocks:
            if self.inner.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("BackwardWorkspace: call once outside CUDA-graph capture with these tiles first")
            self.ds_parts = self.ds_parts.new_empty(self.ds_parts.shape[0], self.ds_parts.shape[1], col_blocks)
        return self.ds_parts

    @classmethod
    def for_group(cls, group, *, num_tokens: int, dim: int, hidden: int, num_experts: int, top_k: int,
                  dtype: torch.dtype, device=None, config: KernelConfig | None = None) -> "BackwardWorkspace":
        """Real EP: collective over ``group`` (same arguments on every rank)."""
        config = _direct(config, dist.get_world_size(group))
        inner = Workspace.for_group(group, num_tokens=num_tokens, dim=2 * dim, hidden=hidden,
                                    num_experts=num_experts, top_k=top_k, dtype=dtype, device=device, config=config)
        return cls(inner, dim)

    @classmethod
    def simulated(cls, world_size: int, *, num_tokens: int, dim: int, hidden: int, num_experts: int, top_k: int,
                  dtype: torch.dtype, device="cpu", config: KernelConfig | None = None) -> "BackwardWorkspace":
        """Every rank's buffers in this process (one launch runs the world)."""
        inner = Workspace.simulated(world_size, num_tokens=num_tokens, dim=2 * dim, hidden=hidden,
                                    num_experts=num_experts, top_k=top_k, dtype=dtype, device=device,
                                    config=_direct(config, world_size))
        return cls(inner, dim)

    @property
    def world_size(self) -> int:
        return self.inner.world_size

    @property
    def is_simulated(self) -> bool:
        return self.inner.is_simulated

    def memory_bytes(self) -> dict[str, int]:
        sizes = self.inner.memory_bytes()
        sizes["dh1"] = sizes["dh3"] = sizes["h"]
        sizes["ds_parts"] = self.ds_parts[0].numel() * 4
        sizes["slot_rows"] = self.slot_rows[0].numel() * self.slot_rows.element_size()
        sizes["g32"] = 0 if self.g32 is None else self.g32[0].numel() * 4
        sizes["total"] += 2 * sizes["h"] + sizes["ds_parts"] + sizes["slot_rows"] + sizes["g32"]
        return sizes

    def ensure_capacity(self, num_tokens: int) -> bool:
        """Grow for ``num_tokens`` tokens per rank (collective in real EP; a
        host sync: call it between steps, see ``Workspace.ensure_capacity``)."""
        grew = self.inner.ensure_capacity(num_tokens)
        if grew:
            self._allocate_local()
        return grew

    def poison(self) -> None:
        """NaN into every data buffer (tests)."""
        self.inner.poison()
        s = self.inner.shape
        for local in range(self.inner.num_local_ranks):
            self.inner.arena_view(local, "slot_copy", torch.int32, (s.slot_capacity,)).fill_(-1)
        self.dh1.fill_(float("nan"))
        self.dh3.fill_(float("nan"))
        self.ds_parts.fill_(float("nan"))
        self.slot_rows.fill_(float("nan"))
        if self.g32 is not None:
            self.g32.fill_(float("nan"))

    def check_errors(self) -> None:
        """Raise RuntimeError if a backward kernel of this rank timed out (syncs)."""
        self.inner.check_errors()

    def poll_errors(self) -> None:
        """Raise if a queued copy of the error record shows a failure (no sync;
        see ``Workspace.poll_errors``)."""
        self.inner.poll_errors()


def _direct(config: KernelConfig | None, world_size: int) -> KernelConfig:
    # The backward combines directly (no y, partials... buffers in its workspace).
    return (config or default_config(world_size)).replace(combine="direct")


def moe_backward(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    top_scores: torch.Tensor,
    indices: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    *,
    workspace: BackwardWorkspace,
    schedule: Schedule = "fused",
    score_before_experts: bool,
    config: KernelConfig | None = None,
    error_check: Literal["sync", "lazy"] | None = None,
    saved_h13: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of ``fused.moe_forward`` with real EP (one process per GPU).

    Every rank of the group calls it in the same layer order (also with
    T = 0). Returns ``(dx, dscores, dw1, dw2, dw3)``, see the module docstring.
    ``error_check``: as ``fused.moe_forward`` (default lazy for ``"fused"``:
    no host sync; sync for ``"sequential"``). ``saved_h13``: the buffer the
    forward filled (``fused.moe_forward(saved_h13=...)``, same routing): h1
    and h3 are read from it instead of recomputed (two GEMMs fewer; the
    gradients agree within rounding with the recomputing backward, and
    are bitwise equal across schedules either way).
    """
    if workspace.is_simulated:
        raise ValueError("moe_backward needs a BackwardWorkspace.for_group; use simulated_moe_backward otherwise")
    ws = workspace.inner
    cfg = _config(ws, config)
    _check_schedule(schedule)
    check = error_check or ("lazy" if schedule == "fused" else "sync")
    if check == "lazy":
        ws.poll_errors()
    _check_inputs(workspace, grad_out, x, top_scores, indices, w1, w2, w3)
    _route(ws, indices.contiguous().unsqueeze(0), x.shape[0], cfg)
    arrays = _rank_arrays(ws, grad_out, x, top_scores, w1, w2, w3)
    if saved_h13 is not None:
        _check_h13(ws, saved_h13)
        arrays["h13"] = saved_h13.unsqueeze(0)
    grads = _launch(workspace, arrays, cfg, score_before_experts, _PHASES[schedule])
    _finish(ws, check)
    return tuple(g[0] for g in grads)


def simulated_moe_backward(
    grad_outs: Sequence[torch.Tensor],
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
    workspace: BackwardWorkspace | None = None,
    poison_outputs: bool = False,
    saved_h13: torch.Tensor | None = None,
) -> list[tuple[torch.Tensor, ...]]:
    """The backward for a simulated world of ``W = len(xs)`` ranks in this
    process (CPU interpreter or one GPU); arguments per rank as
    ``fused.simulated_moe_forward`` plus ``grad_outs[r]`` ``(T_r, D)``.
    Returns one ``(dx, dscores, dw1, dw2, dw3)`` per rank. ``poison_outputs``
    (tests): fill the outputs with NaN before the launches, so an element no
    task writes shows up. ``saved_h13``: ``(W, slot_capacity, 2 * H)`` from
    ``fused.simulated_moe_forward(saved_h13=...)``, see ``moe_backward``."""
    world = len(xs)
    if not (len(grad_outs) == len(scores) == len(indices) == len(w1s) == len(w2s) == len(w3s) == world):
        raise ValueError("grad_outs, xs, scores, indices, w1s, w2s, w3s must have one entry per simulated rank")
    _check_schedule(schedule)
    num_tokens = [x.shape[0] for x in xs]
    if workspace is None:
        el, hidden, dim = w1s[0].shape
        workspace = BackwardWorkspace.simulated(
            world, num_tokens=max(max(num_tokens), 1), dim=dim, hidden=hidden, num_experts=el * world,
            top_k=indices[0].shape[1], dtype=xs[0].dtype, device=xs[0].device, config=config,
        )
    elif not workspace.is_simulated or workspace.world_size != world:
        raise ValueError(f"workspace must be a BackwardWorkspace.simulated of {world} ranks")
    ws = workspace.inner
    cfg = _config(ws, config)
    shape = ws.shape
    for r in range(world):
        _check_inputs(workspace, grad_outs[r], xs[r], scores[r], indices[r], w1s[r], w2s[r], w3s[r])
    cap = shape.token_capacity
    _route_world(ws, indices, cfg)
    arrays = dict(
        _layout_arrays(ws),
        x=_pad_ranks(xs, cap, shape.dtype), g=_pad_ranks(grad_outs, cap, shape.dtype),
        scores=_pad_ranks(scores, cap, torch.float32),
        w1=torch.stack([w.contiguous() for w in w1s]),
        w2=torch.stack([w.contiguous() for w in w2s]),
        w3=torch.stack([w.contiguous() for w in w3s]),
    )
    if saved_h13 is not None:
        _check_h13(ws, saved_h13)
        arrays["h13"] = saved_h13
    dx, ds, dw1, dw2, dw3 = _launch(workspace, arrays, cfg, score_before_experts, _PHASES[schedule],
                                    poison=poison_outputs)
    workspace.check_errors()
    return [(dx[r, :num_tokens[r]], ds[r, :num_tokens[r]], dw1[r], dw2[r], dw3[r]) for r in range(world)]


# ---- internals ------------------------------------------------------------


def _layout_arrays(ws: Workspace) -> dict:
    """The call's layout, as ``fused._route`` left it in the workspace."""
    return dict(dest_rank=ws.dest_rank, dest_slot=ws.dest_slot, dest_tile=ws.dest_tile, num_tokens=ws.num_tokens,
                tile_expert=ws.tile_expert, tile_start=ws.tile_start, tile_end=ws.tile_end,
                num_tiles=ws.num_tiles, route_tables=ws.route_tables)


def _rank_arrays(ws: Workspace, grad_out, x, top_scores, w1, w2, w3) -> dict:
    """Arrays of one real rank (L = 1), after ``fused._route``."""
    u = lambda t: t.contiguous().unsqueeze(0)  # noqa: E731
    return dict(_layout_arrays(ws), x=u(x), g=u(grad_out), scores=u(top_scores.to(torch.float32)),
                w1=u(w1), w2=u(w2), w3=u(w3))


# Tiles of the backward GEMMs on the GPU, independent of the forward's
# KernelConfig (only its layout tile ``block_m`` is shared):
# - ``dh``: columns of H of the dH tile; ``dh_two_pass``: 1: one K-loop for
#   h1 and h3, then one for G (two, then one, 128 x ``dh`` accumulators;
#   the gathered rows are read twice), 0: one loop with all three (then
#   ``dh`` <= 64 fits the registers); ``bk``: the K step of dH and dA;
# - ``da``: columns of D of the dA tile (one accumulator);
# - ``stages``: software-pipelining depth of the dH and dA loops; ``warps``;
# - ``dh_programs_per_sm``: programs of megakernel BA per SM when h1 | h3 are
#   saved (its dH tile is then a plain GEMM tile, 128 registers: two fit);
# - ``da_bk``, ``da_stages``, ``da_warps``: the dA loop's K step, pipelining
#   depth and warps (megakernel BB); ``da_programs_per_sm``: programs of BB
#   per SM (two need ``da_bk = 32`` or 2 stages to fit the shared memory);
#   ``da_defer_release``: release a dA tile's row arrivals after the
#   program's next tile (as the forward's ``KernelConfig.defer_release``);
#   ``da_max_registers``: BB's register cap per thread (``maxnreg``) or None;
#   ``da_tma``: BB reads dh1 | dh3 and w1 | w3 through tensor descriptors
#   made on the device (16-bit data on a GPU, H a multiple of ``da_bk``;
#   the same values, so the same bits). Measured on 2 x H200
#   (docs/performance.md, backward run 13): qwen3-like backward 3.09 / 3.10
#   -> 3.05 / 3.06 ms in alternating order, deepseek-like 15.54 -> 15.12,
#   mixtral-like unchanged (21.04 / 21.09);
# - ``dh_copies_rows``: with saved h1 | h3, megakernel BA's dH tasks also write
#   the weight gradients' dense slot rows (each task one column chunk of its
#   tile's x and dOut rows), instead of the separate gather launch after BB:
#   the copy then overlaps the other programs' GEMM work. The same values,
#   so the same bits. (BA with saved h1 | h3 runs under a register cap,
#   ``ba_max_registers``, so that ``dh_programs_per_sm`` programs fit.)
#   Measured on one H200 (simulated EP = 2 world, both ranks' work in one
#   launch; docs/performance.md, backward run 14): sequential kernels
#   qwen3-like BA 1.13 -> 1.38-1.40 ms and the 0.50 ms gather gone; fused
#   backward 7.74 / 7.78 / 8.01 / 7.93 -> 7.57 / 7.51 / 8.07 / 7.65 ms in
#   alternating pairs; deepseek- (T = 2048) and mixtral-like also lose the
#   gather (0.42, 0.27 ms) for +0.06-0.09 ms of BA (mixtral-like: within noise);
#   ``da_short``: ``(max H, changes)``: for expert hidden dims up to max H the
#   dA keys take ``changes``: two 4-warp programs per SM with a 32-deep K
#   step, so that one's epilogue (remote row stores, then a system-scope
#   release that waits for them) overlaps the other's K-loop, which is short
#   there (K = 2H). Measured on 2 x H200 (docs/performance.md, backward
#   run 12): BB 1.242 -> 0.996 ms on qwen3-like (H = 768), 5.10 -> 4.53 on
#   deepseek-like (2048); 7.04 -> 7.38 on mixtral-like (14336);
# - ``wgrad``: who computes the weight gradients from the dense slot rows:
#   ``"grouped_mm"`` (``torch._grouped_mm``, bf16 on sm_90+), ``"triton"``
#   (``kernels.wgrad.expert_weight_grad_kernel``) or ``"auto"`` (the first
#   where it runs, else the second); ``wgrad_w13`` / ``wgrad_w2``: the Triton
#   kernel's (BM, BN, BK, warps, stages) for dW1+dW3 (two accumulators) and
#   dW2, read through tensor descriptors for 16-bit data on the GPU.
# Chosen on H200s (docs/performance.md): dH/dA tiles by the sweeps of
# "Backward, runs 3-7" (two-pass dH at 128 columns); the weight-gradient
# kernel by the one-GPU probe of "Backward, run 9" (scripts/probe_wgrad.py:
# dense TMA operands 1.6-1.9x the gathered ones on mixtral/qwen3-like shapes;
# torch._grouped_mm faster still on all three shapes, hence "auto").
BACKWARD_TILES = dict(dh=128, dh_two_pass=1, da=128, bk=64, stages=3, warps=8, dh_programs_per_sm=2,
                      da_bk=64, da_stages=3, da_warps=8, da_programs_per_sm=1, da_defer_release=False,
                      da_max_registers=None, da_tma=True, dh_copies_rows=True,
                      da_short=(2048, dict(da_bk=32, da_warps=4, da_programs_per_sm=2)),
                      wgrad="auto", wgrad_w13=(128, 128, 64, 8, 4), wgrad_w2=(128, 256, 64, 8, 3))
WGRAD_BACKENDS = ("auto", "grouped_mm", "triton")


def backward_block_sizes(cfg: KernelConfig, hidden: int | None = None) -> dict:
    """``BACKWARD_TILES`` for GPU-sized layout tiles (``block_m >= 64``), with
    its ``da_short`` changes where the expert hidden dim ``hidden`` is at most
    their bound; for the interpreter's small configs, tiles derived from its
    knobs."""
    if cfg.block_m >= 64:
        blocks = dict(BACKWARD_TILES)
        max_hidden, changes = blocks["da_short"]
        if hidden is not None and hidden <= max_hidden:
            blocks.update(changes)
        return blocks
    small = (cfg.block_n_fc1, cfg.block_n_fc1, cfg.block_k, cfg.num_warps, max(1, cfg.num_stages))
    return dict(dh=cfg.block_n_fc1, dh_two_pass=BACKWARD_TILES["dh_two_pass"], da=cfg.block_n_fc2, bk=cfg.block_k,
                stages=max(1, cfg.num_stages), warps=cfg.num_warps, dh_programs_per_sm=1, da_bk=cfg.block_k,
                da_stages=max(1, cfg.num_stages), da_warps=cfg.num_warps, da_programs_per_sm=1,
                da_defer_release=BACKWARD_TILES["da_defer_release"], da_max_registers=None, da_tma=False,
                da_short=(0, {}), dh_copies_rows=BACKWARD_TILES["dh_copies_rows"],
                wgrad=BACKWARD_TILES["wgrad"],
                wgrad_w13=small, wgrad_w2=small)


# torch's sm_90 bf16 grouped GEMM (CUTLASS, grouped mode: each output tile
# reduces over its group's whole K, no split-K) takes fewer than 1024 groups.
GROUPED_MM_MAX_GROUPS = 1023


def bb_reduce_dim(cfg: KernelConfig, score_before: bool) -> int:
    """Columns per step of BB's reduce: ``cfg.reduce_block_dim``, at most 256
    with scores before the experts (that reduce also reads x rows, for the
    score gradient; at 512 ptxas spills in the 4-warp BB of ``da_short``)."""
    return min(cfg.reduce_block_dim, 256) if score_before else cfg.reduce_block_dim


def ba_max_registers(blocks: dict, saved_h13: bool) -> int | None:
    """Register cap of megakernel BA: with saved h1 | h3 its dH tile is a plain
    GEMM tile that fits ``dh_programs_per_sm`` programs of ``warps`` warps per
    SM in 128 registers, which ptxas does not aim for by itself (the dispatch
    loops and the slot-row copy, ``dh_copies_rows``, took it to 148-172)."""
    if not saved_h13 or blocks["dh_programs_per_sm"] <= 1:
        return None
    return 65536 // (32 * blocks["warps"] * blocks["dh_programs_per_sm"]) // 8 * 8


def wgrad_backend(requested: str, dtype: torch.dtype, device: torch.device, num_local_experts: int = 1) -> str:
    """The weight-gradient backend that runs for ``requested`` (see ``BACKWARD_TILES``)."""
    if requested not in WGRAD_BACKENDS:
        raise ValueError(f"wgrad backend must be one of {WGRAD_BACKENDS}, got {requested!r}")
    grouped = (device.type == "cuda" and dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")
               and num_local_experts <= GROUPED_MM_MAX_GROUPS and torch.cuda.get_device_capability(device)[0] >= 9)
    if requested == "grouped_mm" and not grouped:
        raise ValueError("wgrad backend 'grouped_mm' needs bf16 data on a CUDA GPU of compute capability 9.0+, "
                         f"torch._grouped_mm and at most {GROUPED_MM_MAX_GROUPS} local experts "
                         f"(got {dtype}, {device}, {num_local_experts} local experts)")
    if requested == "auto":
        return "grouped_mm" if grouped else "triton"
    return requested


def _gather_slot_rows(bws: "BackwardWorkspace", a: dict, score_before: bool) -> None:
    """Each used slot's x (times the score, scores before the experts) and
    dOut rows, dense in slot order (``bws.slot_rows``)."""
    ws = bws.inner
    s, off = ws.shape, ws.element_offsets
    act, i32, f32 = ws.anchors[s.dtype], ws.anchors[torch.int32], ws.anchors[torch.float32]
    block_s = 16
    gather_slot_rows_kernel[(triton.cdiv(s.slot_capacity, block_s), ws.num_local_ranks)](
        bws.slot_rows, a["route_tables"], ws.arena_ptrs, act, i32, f32, ws.anchor_rank, off["tokens"],
        off["slot_copy"], off["slot_score"], ws.rank_base, s.slot_capacity, DIM=bws.dim, TOP_K=s.top_k,
        NUM_EXPERTS_LOCAL=s.num_local_experts, NUM_EXPERTS=s.num_experts, SCORE_BEFORE=score_before, BS=block_s,
        BD=min(512, triton.next_power_of_2(bws.dim)), num_warps=4,
    )


def _weight_grads(bws: "BackwardWorkspace", a: dict, blocks: dict, score_before: bool, interpret: bool,
                  poison: bool, rows_copied: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dW1, dW2, dW3 ``(L, El, ...)`` of every local rank: the dense slot rows
    (unless megakernel BA wrote them: ``rows_copied``), then the per-expert
    GEMMs (``kernels.wgrad``)."""
    ws = bws.inner
    s = ws.shape
    dim, hidden, num_local, el = bws.dim, s.hidden, ws.num_local_ranks, s.num_local_experts
    rows = bws.slot_rows
    if not rows_copied:
        _gather_slot_rows(bws, a, score_before)
    xs, dys = rows[:, 0], rows[:, 1]
    h, dh1, dh3 = ws.h, bws.dh1, bws.dh3
    if wgrad_backend(blocks["wgrad"], s.dtype, ws.device, el) == "grouped_mm":
        # Each expert's slots are [base, base + rows), back to back in expert
        # order: the groups' end offsets; rows past the last are not read.
        tables = a["route_tables"]
        grads = ([], [], [])
        for local in range(num_local):
            first = (ws.rank_base + local) * el
            ends = (tables[local, ROW_EXPERT_BASE, first:first + el] + tables[local, ROW_ROWS, first:first + el])
            ends = ends.to(torch.int32)
            grads[0].append(torch._grouped_mm(dh1[local].t(), xs[local], offs=ends))
            grads[1].append(torch._grouped_mm(dys[local].t(), h[local], offs=ends))
            grads[2].append(torch._grouped_mm(dh3[local].t(), xs[local], offs=ends))
        if num_local == 1:
            return tuple(g[0].unsqueeze(0) for g in grads)
        return tuple(torch.stack(g) for g in grads)

    dw1, dw2, dw3 = torch.empty_like(a["w1"]), torch.empty_like(a["w2"]), torch.empty_like(a["w3"])
    if poison:
        for out in (dw1, dw2, dw3):
            out.fill_(float("nan"))
    precision = "ieee" if s.dtype == torch.float32 else "tf32"
    # Tensor descriptors for 16-bit data on the GPU (wgmma reads the
    # transposed A operand from shared memory only for 16-bit types).
    tma = ws.device.type == "cuda" and s.elem_size == 2 and dim % 8 == 0 and hidden % 8 == 0
    if tma:
        ensure_tma_allocator()

    def gemm(a1, a2, b, out1, out2, m, n, tiles, two):
        bm, bn, bk, warps, stages = tiles
        grid = (el * triton.cdiv(m, bm) * triton.cdiv(n, bn), num_local)
        expert_weight_grad_kernel[grid](
            a1, a2, a1.stride(1), a1.stride(0), b, b.stride(1), b.stride(0), a["route_tables"], out1, out2,
            ws.rank_base, M=m, N=n, NUM_EXPERTS_LOCAL=el, NUM_EXPERTS=s.num_experts, BM=bm, BN=bn, BK=bk,
            GROUP=8, TWO_A=two, TMA=tma, STAGES=stages, PRECISION=precision, INTERPRET=interpret,
            num_warps=warps, num_stages=stages,
        )

    gemm(dh1, dh3, xs, dw1, dw3, hidden, dim, blocks["wgrad_w13"], True)
    gemm(dys, dys, h, dw2, dw2, dim, hidden, blocks["wgrad_w2"], False)
    return dw1, dw2, dw3


def _launch(bws: BackwardWorkspace, a: dict, cfg: KernelConfig, score_before: bool, phases: Sequence[str],
            poison: bool = False):
    ws = bws.inner
    s, off = ws.shape, ws.element_offsets
    dim, hidden, top_k = bws.dim, s.hidden, s.top_k
    act, i32, f32 = ws.anchors[s.dtype], ws.anchors[torch.int32], ws.anchors[torch.float32]
    grid = (_num_programs(ws, cfg),)
    precision = "ieee" if s.dtype == torch.float32 else "tf32"
    use_timer, timeout = _use_timer(ws), _timeout(ws, cfg)
    blocks = backward_block_sizes(cfg, hidden)
    elem = s.elem_size
    col_blocks_dh = triton.cdiv(hidden, blocks["dh"])
    ds_parts = bws.ds_parts_for(col_blocks_dh)
    dx = torch.empty_like(a["x"])
    ds = torch.empty(a["scores"].shape, dtype=torch.float32, device=dx.device)
    dws = None
    if poison:
        for out in (dx, ds):
            out.fill_(float("nan"))
    opts = dict(num_warps=blocks["warps"], num_stages=blocks["stages"])
    interpret = os.environ.get("TRITON_INTERPRET", "0") == "1"
    h = ws.h
    h13 = a.get("h13")
    g32 = bws.g32_buffer() if h13 is not None else h

    # With saved h1 | h3 the dH tile is a plain GEMM tile (128 registers): two
    # programs per SM let one's fp32 G stores overlap the other's K-loop.
    # (Every program dispatches before it takes a tile, so programs that are
    # not resident yet cannot hold up a waiting tile.)
    grid_ba = (grid[0] * (blocks["dh_programs_per_sm"] if h13 is not None and ws.device.type == "cuda" else 1),)
    copy_rows = h13 is not None and bool(blocks["dh_copies_rows"])
    ba_opts = dict(opts)
    if ws.device.type == "cuda" and ba_max_registers(blocks, h13 is not None) is not None:
        ba_opts["maxnreg"] = ba_max_registers(blocks, h13 is not None)

    def kernel_ba(do_dispatch: int, do_tiles: int, dispatch_programs: int) -> None:
        dispatch_grad_hidden_kernel[grid_ba](
            a["x"], a["g"], a["x"].stride(0), a["scores"], a["dest_rank"], a["dest_slot"], a["dest_tile"],
            a["dest_rank"].stride(0), a["num_tokens"], a["tile_expert"], a["tile_start"], a["tile_end"],
            a["tile_expert"].stride(0), a["num_tiles"], ws.tile_order, a["w1"], a["w2"], a["w3"], a["w1"].stride(0),
            h, bws.dh1, bws.dh3, h.stride(0), ds_parts, ds_parts.stride(0), h if h13 is None else h13,
            h.stride(0) if h13 is None else h13.stride(0), g32, bws.slot_rows, bws.slot_rows.stride(0),
            ws.control, ws.arena_ptrs, act, i32,
            f32, ws.anchor_rank, off["tokens"], off["slot_copy"], off["slot_score"], off["tile_arrivals"],
            ws.rank_base, s.token_capacity, s.slot_capacity, s.tile_capacity,
            do_dispatch, do_tiles, dispatch_programs, cfg.debug_silent_rank, timeout, int(cfg.local_first),
            NUM_LOCAL=ws.num_local_ranks, WORLD=s.world_size, DIM=dim, HIDDEN=hidden, TOP_K=top_k,
            SCORE_BEFORE=score_before, BM=cfg.block_m, BN=blocks["dh"], BK=blocks["bk"], GROUP_M=cfg.group_m,
            BT=cfg.comm_block_tokens, BD=cfg.comm_block_dim, KP=triton.next_power_of_2(top_k),
            TWO_PASS=bool(blocks["dh_two_pass"]), SAVED_H13=h13 is not None, PRECISION=precision, USE_TIMER=use_timer,
            COPY_ROWS=copy_rows, BDC=min(64, triton.next_power_of_2(dim)), **ba_opts,
        )

    grid_bb = (grid[0] * (blocks["da_programs_per_sm"] if ws.device.type == "cuda" else 1),)
    bb_opts = dict(num_warps=blocks["da_warps"], num_stages=blocks["da_stages"])
    bb_rows = tma_rows(ws, bws.dh1, a["w1"]) if blocks["da_tma"] and hidden % blocks["da_bk"] == 0 else None
    if bb_rows is not None:
        ensure_tma_allocator()
    if blocks["da_max_registers"] is not None:
        bb_opts["maxnreg"] = blocks["da_max_registers"]

    def kernel_bb(do_tiles: int, do_reduce: int) -> None:
        grad_input_combine_kernel[grid_bb](
            bws.dh1, bws.dh3, h.stride(0), a["w1"], a["w3"], a["w1"].stride(0),
            a["tile_expert"], a["tile_start"], a["tile_end"], a["tile_expert"].stride(0), a["num_tiles"],
            ds_parts, ds_parts.stride(0), a["scores"], a["dest_rank"].stride(0),
            a["num_tokens"], a["x"], a["x"].stride(0), dx, ds, ws.control, ws.arena_ptrs, act, i32, f32,
            ws.anchor_rank, off["slot_copy"], off["returned"],
            ws.offsets["returned"] // 4, off["token_arrivals"], ws.rank_base, s.token_capacity, s.slot_capacity,
            do_tiles, do_reduce, timeout, *(bb_rows or (0, 0)),
            NUM_LOCAL=ws.num_local_ranks, DIM=dim, HIDDEN=hidden, TOP_K=top_k, SCORE_BEFORE=score_before,
            BM=cfg.block_m, BN=blocks["da"], BK=blocks["da_bk"], NHB=col_blocks_dh,
            NHBP=triton.next_power_of_2(col_blocks_dh), GROUP_M=cfg.group_m, BT=cfg.reduce_block_tokens,
            BD=bb_reduce_dim(cfg, score_before), KP=triton.next_power_of_2(top_k), RET_ROW_F32=2 * dim * elem // 4,
            PARTS_AT_F32=dim * elem // 4, PRECISION=precision, USE_TIMER=use_timer,
            DEFER_RELEASE=bool(blocks["da_defer_release"]), TMA=bb_rows is not None, **bb_opts,
        )

    for phase in phases:
        if phase == "dispatch+dh":
            # Every program dispatches first: a dH tile waits for rows from every
            # source, so tiles started early only spin (measured: 3.7 ms for BA with
            # 16 dispatching programs against 1.8 ms for the two sequential
            # launches, qwen3-like on 2 x H200). With local_first every program
            # dispatches the rows that stay on its rank, then the first
            # num_comm_sms send the others while the rest start on the tiles
            # holding only own rows.
            kernel_ba(1, 1, min(cfg.num_comm_sms, grid_ba[0]) if cfg.local_first else grid_ba[0])
        elif phase == "dispatch":
            kernel_ba(1, 0, grid_ba[0])
        elif phase == "dh":
            kernel_ba(0, 1, 0)
        elif phase == "swiglu":
            if h13 is not None:  # else the dH tiles did it
                block_s = 32
                swiglu_backward_kernel[(triton.cdiv(s.slot_capacity, block_s), col_blocks_dh, ws.num_local_ranks)](
                    g32, h13, h13.stride(0), h, bws.dh1, bws.dh3, h.stride(0), ds_parts, ds_parts.stride(0),
                    a["route_tables"], ws.arena_ptrs, f32, ws.anchor_rank, off["slot_score"], ws.rank_base,
                    HIDDEN=hidden, NUM_EXPERTS_LOCAL=s.num_local_experts, NUM_EXPERTS=s.num_experts,
                    SCORE_BEFORE=score_before, BS=block_s, BN=blocks["dh"], num_warps=4,
                )
        elif phase == "da+reduce":
            kernel_bb(1, 1)
        elif phase == "da":
            kernel_bb(1, 0)
        elif phase == "wgrad":
            dws = _weight_grads(bws, a, blocks, score_before, interpret, poison, copy_rows)
        elif phase == "reduce":
            kernel_bb(0, 1)
        else:
            raise ValueError(f"unknown phase {phase!r}")
    if dws is None:  # phases without the weight gradients (tests of single phases)
        dws = tuple(torch.full_like(a[w], float("nan")) for w in ("w1", "w2", "w3"))
    dw1, dw2, dw3 = dws
    return dx, ds, dw1, dw2, dw3




def _config(ws: Workspace, config: KernelConfig | None) -> KernelConfig:
    cfg = (config or ws.config).replace(combine="direct")
    if cfg.block_m != ws.shape.block_m:
        raise ValueError(f"config.block_m ({cfg.block_m}) must equal the workspace's ({ws.shape.block_m})")
    return cfg


def _check_inputs(bws: BackwardWorkspace, grad_out, x, scores, indices, w1, w2, w3) -> None:
    s, dim = bws.inner.shape, bws.dim
    if x.dim() != 2 or x.shape[1] != dim or tuple(grad_out.shape) != tuple(x.shape):
        raise ValueError(f"x and grad_out must be (T, {dim}), got {tuple(x.shape)} and {tuple(grad_out.shape)}")
    if x.dtype != s.dtype or grad_out.dtype != s.dtype:
        raise ValueError(f"x and grad_out must be {s.dtype}, got {x.dtype} and {grad_out.dtype}")
    if s.elem_size == 2 and dim % 2:
        raise ValueError(f"the backward needs an even dim with 2-byte activations, got {dim}")
    if x.shape[0] > s.token_capacity:
        raise RuntimeError(
            f"{x.shape[0]} tokens exceed the backward workspace's capacity of {s.token_capacity} per rank; "
            "call BackwardWorkspace.ensure_capacity(num_tokens) on every rank between steps"
        )
    if tuple(indices.shape) != (x.shape[0], s.top_k) or tuple(scores.shape) != (x.shape[0], s.top_k):
        raise ValueError(f"top_scores and indices must be ({x.shape[0]}, {s.top_k}), got "
                         f"{tuple(scores.shape)} and {tuple(indices.shape)}")
    el, h = s.num_local_experts, s.hidden
    for name, w, want in (("w1", w1, (el, h, dim)), ("w2", w2, (el, dim, h)), ("w3", w3, (el, h, dim))):
        if tuple(w.shape) != want or w.dtype != s.dtype:
            raise ValueError(f"{name} must be {want} {s.dtype}, got {tuple(w.shape)} {w.dtype}")
