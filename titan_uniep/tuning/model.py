"""An analytic model of one UniEP layer's time on a GPU, per stage.

Inputs: the layer's ``LayerShape``, its routing (``RoutingStats``: copies per
expert, de-duplicated token rows and copies between every pair of ranks),
the EP size, a ``LayerParams`` point, and ``HardwareConstants`` (GEMM
efficiency per tile shape, HBM and NVLink bandwidth, per-program copy rate,
launch and barrier latency), measured once per GPU model by
``python -m titan_uniep.tuning.calibrate`` or, until then, the uncalibrated
H200 figures of ``default_constants``.

Each stage is a roofline over the slowest rank: the larger of its compute
time (GEMM tiles in waves over the programs, each tile ``K / BK`` MMA steps
at the tile shape's efficiency plus a fixed prologue / epilogue cost that a
second program per SM hides), its NVLink time (bytes out of and into a rank)
and its HBM time, plus the latencies it cannot hide (launches, the counts
exchange's barrier, a release that waits for remote stores). Stages:

- forward: ``exchange`` (route kernels and counts exchange), ``dispatch``,
  ``fc1``, ``fc2`` (with the combine: its tiles store their rows at the
  sources), ``reduce``;
- backward: ``exchange``, ``dispatch`` (``[x | dOut]`` rows), ``dh`` (G),
  ``swiglu`` (from G and the saved h1 | h3), ``gather`` (slot rows, when
  the dH tasks do not copy them), ``da``, ``reduce``, ``wgrad``
  (torch._grouped_mm: each expert at the efficiency of its rows,
  ``HardwareConstants.grouped_mm_efficiency_by_rows``, its output widened
  where the gradients are fp32; or the Triton kernel at its tiles' efficiency,
  writing the gradients' dtype: ``LayerShape.weight_grad_bytes``).

The fused schedule overlaps stages inside a launch: dispatch with fc1 (or
dH) as far as the programs that do not dispatch find tiles whose rows have
arrived (``HardwareConstants.dispatch_overlap``), fc2 / dA with their reduce
tail. ``Prediction.table()`` explains a prediction stage by stage.

Everything is numpy over a batch of points, so ``rank`` orders 10^4 - 10^5
points in well under a second; ``predict`` is ``rank`` of one point.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from dataclasses import dataclass
from collections.abc import Sequence as SequenceABC
from typing import Iterable, Sequence

import numpy as np

from ..params import LayerParams
from .hardware import (  # noqa: F401  (re-exported: the model's constants)
    HardwareConstants,
    _tile_efficiency,
    clock_factor,
    default_constants,
    load_constants,
    save_constants,
    tile_key,
)
from .space import LayerShape

__all__ = [
    "BACKWARD_STAGES",
    "BUSY_CALLS",
    "FORWARD_STAGES",
    "HardwareConstants",
    "Prediction",
    "Ranking",
    "RoutingStats",
    "default_constants",
    "load_constants",
    "predict",
    "rank",
    "save_constants",
]

FORWARD_STAGES = ("exchange", "dispatch", "fc1", "fc2", "reduce")
BACKWARD_STAGES = ("exchange", "dispatch", "dh", "swiglu", "gather", "da", "reduce", "wgrad")


# ---- routing ---------------------------------------------------------------------


@dataclass(frozen=True)
class RoutingStats:
    """A call's routing as the model needs it, for an EP group of ``W`` ranks:

    - ``tokens`` ``(W,)``: tokens of each source rank;
    - ``expert_rows`` ``(E,)``: copies routed to each global expert (all sources);
    - ``send_rows`` ``(W, W)``: de-duplicated token rows source ``s`` sends to
      rank ``d`` (one per token with an expert there; ``s == d`` stays local);
    - ``send_copies`` ``(W, W)``: copies from ``s`` to ``d`` (the combine sends
      one row per copy back).

    Floats, so that ``uniform`` can hold expectations."""

    top_k: int
    tokens: np.ndarray
    expert_rows: np.ndarray
    send_rows: np.ndarray
    send_copies: np.ndarray

    @property
    def ep_size(self) -> int:
        return len(self.tokens)

    @property
    def num_experts(self) -> int:
        return len(self.expert_rows)

    def rows_per_rank(self) -> np.ndarray:
        """Slots each rank receives ``(W,)``."""
        return self.send_copies.sum(axis=0)

    def dedup_bytes(self, dim: int, dtype_bytes: int) -> np.ndarray:
        """Bytes of de-duplicated token rows each source sends to each other rank ``(W, W)``."""
        remote = self.send_rows * (1 - np.eye(self.ep_size))
        return remote * dim * dtype_bytes

    @classmethod
    def from_indices(cls, indices, num_experts: int, ep_size: int) -> "RoutingStats":
        """From expert ids: a sequence of ``W`` ``(T_r, K)`` arrays / tensors
        (one per source rank), a ``(W, T, K)`` array, or one ``(N, K)`` array
        split into ``W`` consecutive equal parts. Ids ``< 0`` are padding."""
        if hasattr(indices, "detach"):
            indices = indices.detach().cpu().numpy()
        if isinstance(indices, np.ndarray) and indices.ndim == 2:
            per_rank = np.array_split(indices, ep_size)
        else:
            per_rank = [np.asarray(i.detach().cpu().numpy() if hasattr(i, "detach") else i) for i in indices]
        if len(per_rank) != ep_size:
            raise ValueError(f"indices: expected {ep_size} ranks' routing, got {len(per_rank)}")
        if num_experts % ep_size:
            raise ValueError(f"num_experts ({num_experts}) must be divisible by ep_size ({ep_size})")
        top_k = per_rank[0].shape[1] if per_rank[0].ndim == 2 else 1
        local = num_experts // ep_size
        tokens = np.zeros(ep_size)
        expert_rows = np.zeros(num_experts)
        send_rows = np.zeros((ep_size, ep_size))
        send_copies = np.zeros((ep_size, ep_size))
        for s, idx in enumerate(per_rank):
            idx = idx.reshape(-1, top_k)
            valid = idx >= 0
            tokens[s] = int(valid.any(axis=1).sum()) if idx.size else 0
            if idx.size and (idx[valid] >= num_experts).any():
                raise ValueError(f"indices of rank {s} hold an expert id >= num_experts ({num_experts})")
            expert_rows += np.bincount(idx[valid].astype(np.int64), minlength=num_experts)
            dest = np.where(valid, idx // local, -1)
            for d in range(ep_size):
                here = dest == d
                send_copies[s, d] = here.sum()
                send_rows[s, d] = here.any(axis=1).sum()
        return cls(top_k, tokens, expert_rows, send_rows, send_copies)

    @classmethod
    def uniform(cls, tokens: int, num_experts: int, top_k: int, ep_size: int) -> "RoutingStats":
        """Expectations under balanced routing: every token picks ``top_k``
        distinct experts uniformly (each expert ``W T K / E`` rows; a token
        reaches rank ``d`` unless all its experts are elsewhere)."""
        if num_experts % ep_size:
            raise ValueError(f"num_experts ({num_experts}) must be divisible by ep_size ({ep_size})")
        local = num_experts // ep_size
        miss = math.comb(num_experts - local, top_k) / math.comb(num_experts, top_k) if top_k <= num_experts else 0.0
        w = ep_size
        return cls(
            top_k,
            np.full(w, float(tokens)),
            np.full(num_experts, w * tokens * top_k / num_experts),
            np.full((w, w), tokens * (1 - miss)),
            np.full((w, w), tokens * top_k / w),
        )


# ---- the batch of points -------------------------------------------------------------


_COLUMNS = tuple(f.name for f in dataclasses.fields(LayerParams))


def _columns(points: Sequence[LayerParams], grid_default: int) -> dict[str, np.ndarray]:
    """One numpy column per field (``num_programs`` None -> ``grid_default``,
    a register cap None -> 0)."""
    row = operator.itemgetter(*_COLUMNS)
    cols = dict(zip(_COLUMNS, zip(*(row(p.__dict__) for p in points))))
    for name, none in (("num_programs", grid_default), ("fc2_max_registers", 0), ("da_max_registers", 0)):
        cols[name] = [none if v is None else v for v in cols[name]]
    return {name: np.asarray(values) for name, values in cols.items()}


class Prediction:
    """Predicted times in ms of one point: ``forward`` / ``backward`` map a
    stage to its time when it runs alone (its sequential launch),
    ``exposed`` (``"forward.fc1"``, ...) the part of it on the critical path
    of ``schedule``, ``forward_total`` / ``backward_total`` the schedule's
    layer time, ``bounds`` what limits each stage. A view of one point of a
    ranked batch (built lazily: ranking 10^5 points builds no dicts)."""

    __slots__ = ("_batch", "_i")

    def __init__(self, batch: "_Batch", index: int):
        self._batch = batch
        self._i = index

    @property
    def schedule(self) -> str:
        return self._batch.schedule

    @property
    def forward(self) -> dict[str, float]:
        return {s: float(v[self._i]) * 1e3 for s, v in self._batch.forward.items()}

    @property
    def backward(self) -> dict[str, float]:
        return {s: float(v[self._i]) * 1e3 for s, v in self._batch.backward.items()}

    @property
    def exposed(self) -> dict[str, float]:
        return {s: float(v[self._i]) * 1e3 for s, v in self._batch.exposed.items()}

    @property
    def bounds(self) -> dict[str, str]:
        return {s: (v if isinstance(v, str) else str(v[self._i])) for s, v in self._batch.bounds.items()}

    @property
    def forward_total(self) -> float:
        return float(self._batch.forward_total[self._i]) * 1e3

    @property
    def backward_total(self) -> float:
        return float(self._batch.backward_total[self._i]) * 1e3

    @property
    def total(self) -> float:
        return self.forward_total + self.backward_total

    def __repr__(self) -> str:
        return (f"Prediction({self.schedule}: forward {self.forward_total:.4f} ms, backward "
                f"{self.backward_total:.4f} ms)")

    def table(self) -> str:
        """The prediction as a Markdown table: per stage the time alone, the
        part exposed in this schedule, and what bounds it."""
        exposed, bounds = self.exposed, self.bounds
        lines = [f"| stage | alone (ms) | exposed, {self.schedule} (ms) | bound |", "|---|---|---|---|"]
        for direction, stages in (("forward", self.forward), ("backward", self.backward)):
            for stage, ms in stages.items():
                key = f"{direction}.{stage}"
                lines.append(f"| {key} | {ms:.4f} | {exposed[key]:.4f} | {bounds.get(key, '')} |")
        lines.append(f"| **forward** | {sum(self.forward.values()):.4f} | **{self.forward_total:.4f}** | |")
        lines.append(f"| **backward** | {sum(self.backward.values()):.4f} | **{self.backward_total:.4f}** | |")
        lines.append(f"| **forward + backward** | | **{self.total:.4f}** | |")
        return "\n".join(lines)


@dataclass
class _Batch:
    """The model's arrays over a batch of points, seconds (``Prediction`` reads one index)."""

    schedule: str
    forward: dict[str, np.ndarray]
    backward: dict[str, np.ndarray]
    exposed: dict[str, np.ndarray]
    bounds: dict[str, object]
    forward_total: np.ndarray
    backward_total: np.ndarray


# Calls of the same direction a timed call follows back to back in the project's
# timing loops (timing.time_ms: 2 warm-up calls, then the median of 5): the
# GPU has been busy for about this many call times when the median one runs.
BUSY_CALLS = 4.5


def predict(shape: LayerShape, stats: RoutingStats, ep_size: int, params: LayerParams, hw: HardwareConstants,
            *, schedule: str = "fused", busy_calls: float = BUSY_CALLS) -> Prediction:
    """The model's prediction of one point (``rank`` of one)."""
    return Prediction(_clocked_model(shape, stats, ep_size, [params], hw, schedule, busy_calls), 0)


def rank(shape: LayerShape, stats: RoutingStats, ep_size: int, points: Iterable[LayerParams],
         hw: HardwareConstants, *, schedule: str = "fused", objective: str = "total",
         busy_calls: float = BUSY_CALLS) -> "Ranking":
    """``points`` with their predictions, fastest first by ``objective``
    (``"total"``: forward + backward, ``"forward"`` or ``"backward"``), as a
    ``Ranking`` (a sequence of ``(params, Prediction)``); ties keep the input
    order. Vectorised: one numpy pass over all points (two with a
    calibrated clock). ``busy_calls``: see ``BUSY_CALLS``."""
    points = list(points)
    if not points:
        return []
    if objective not in ("total", "forward", "backward"):
        raise ValueError(f"objective must be 'total', 'forward' or 'backward', got {objective!r}")
    batch = _clocked_model(shape, stats, ep_size, points, hw, schedule, busy_calls)
    score = {"total": batch.forward_total + batch.backward_total, "forward": batch.forward_total,
             "backward": batch.backward_total}[objective]
    return Ranking(points, batch, np.argsort(score, kind="stable"))


class Ranking(SequenceABC):
    """``rank``'s result: a read-only sequence of ``(params, Prediction)``,
    fastest first, built per item on access (10^5 points cost no tuples)."""

    def __init__(self, points: list[LayerParams], batch: _Batch, order: np.ndarray):
        self._points, self._batch, self._order = points, batch, order

    def __len__(self) -> int:
        return len(self._order)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        j = int(self._order[i])
        return self._points[j], Prediction(self._batch, j)

    def __repr__(self) -> str:
        head = ", ".join(f"{p.total:.4f}" for _, p in self[:3])
        return f"Ranking({len(self)} points, fastest totals (ms): {head}{', ...' if len(self) > 3 else ''})"


def _expert_tiles(stats: RoutingStats, el: int, block_m: np.ndarray, group_m: np.ndarray):
    """Per point and rank ``(N, W)``: row tiles ``sum_e ceil(rows_e / BM)``,
    row-tile groups ``sum_e ceil(tiles_e / group_m)`` (each group sweeps
    every column block, re-reading the expert's weights once) and the
    experts with rows."""
    w = stats.ep_size
    rows = stats.expert_rows.reshape(w, el)
    n = len(block_m)
    tiles, groups = np.empty((n, w)), np.empty((n, w))
    keys = np.stack([block_m, group_m], axis=1)
    unique, inverse = np.unique(keys, axis=0, return_inverse=True)
    inverse = inverse.reshape(-1)
    for j, (bm, gm) in enumerate(unique):
        per_expert = np.ceil(rows / bm)
        tiles[inverse == j] = per_expert.sum(axis=1)
        groups[inverse == j] = np.ceil(per_expert / gm).sum(axis=1)
    return tiles, groups, (rows > 0).sum(axis=1)


def _clocked_model(shape: LayerShape, stats: RoutingStats, ep_size: int, points: Sequence[LayerParams],
                   hw: HardwareConstants, schedule: str, busy_calls: float) -> _Batch:
    """``_model`` at the SM clock of a GPU busy for ``busy_calls`` times each
    direction's time (``clock_factor``): a first pass at the rested clock
    gives the busy time, a second the prediction (one pass uncalibrated)."""
    rested = _model(shape, stats, ep_size, points, hw, schedule=schedule)
    if hw.clock_settle_ms <= 0 or hw.sustained_clock >= 1:
        return rested
    return _model(shape, stats, ep_size, points, hw, schedule=schedule,
                  clock_f=clock_factor(hw, busy_calls * rested.forward_total),
                  clock_b=clock_factor(hw, busy_calls * rested.backward_total))


def _model(shape: LayerShape, stats: RoutingStats, ep_size: int, points: Sequence[LayerParams],
           hw: HardwareConstants, *, schedule: str, clock_f=None, clock_b=None) -> _Batch:
    """Every stage's time in seconds for every point (arrays ``(N,)``);
    ``clock_f`` / ``clock_b`` ``(N,)``: the SM clock's share of its rested
    rate in the forward / backward GEMMs (default 1)."""
    if schedule not in ("fused", "sequential"):
        raise ValueError(f"schedule must be 'fused' or 'sequential', got {schedule!r}")
    if stats.ep_size != ep_size or shape.ep_size != ep_size:
        raise ValueError(f"ep_size ({ep_size}) must match the routing's ({stats.ep_size}) and the shape's "
                         f"({shape.ep_size})")
    if stats.num_experts != shape.num_experts or stats.top_k != shape.top_k:
        raise ValueError(f"the routing has {stats.num_experts} experts and top-{stats.top_k}, the shape "
                         f"{shape.num_experts} and top-{shape.top_k}")
    c = _columns(points, hw.sm_count)
    n = len(points)
    clock_f = np.ones(n) if clock_f is None else np.asarray(clock_f, dtype=float)
    clock_b = np.ones(n) if clock_b is None else np.asarray(clock_b, dtype=float)
    w, d, h, k, b = ep_size, shape.dim, shape.hidden, shape.top_k, shape.dtype_bytes
    el = shape.local_experts
    sms = hw.sm_count
    us = 1e-6
    peak_sm = hw.peak_tflops * 1e12 / sms  # FLOP/s of one SM
    hbm = hw.hbm_gbps * 1e9
    link = hw.nvlink_gbps * 1e9 if hw.nvlink_gbps > 0 else 1e12  # unknown: no NVLink bound
    per_prog = hw.copy_gbps_per_program * 1e9
    launch = hw.launch_us * us
    grid = np.minimum(c["num_programs"], sms).astype(float)

    # ---- routing per rank (each launch ends with its slowest rank) ----
    remote = 1 - np.eye(w)
    rows_rank = stats.rows_per_rank()  # (W,) slots received
    tokens = stats.tokens
    rows_out = (stats.send_rows * remote).sum(axis=1)  # dedup rows a source sends to peers
    rows_in = (stats.send_rows * remote).sum(axis=0)  # dedup rows a rank receives from peers
    rows_own = np.diag(stats.send_rows)  # rows that stay on their rank
    back_out = (stats.send_copies * remote).sum(axis=0)  # combine rows an expert rank sends back
    back_in = (stats.send_copies * remote).sum(axis=1)  # combine rows a source gets back
    remote_share = np.divide(back_out, rows_rank, out=np.zeros(w), where=rows_rank > 0)  # (W,)
    tiles_m, groups_m, experts_used = _expert_tiles(stats, el, c["block_m"], c["group_m"])
    bm = c["block_m"][:, None].astype(float)

    def slowest(per_rank) -> np.ndarray:
        return np.broadcast_to(np.asarray(per_rank, dtype=float), (n, w)).max(axis=1)

    def roofline(compute, memory):
        return _roofline(hw, compute, memory)

    def copy_rows(row_bytes: float, programs: np.ndarray, own: bool = True) -> np.ndarray:
        """``(N, W)``: a dispatch's row copies by ``programs`` programs: de-duplicated
        rows over NVLink (out of and into each rank), own rows (``own``) through
        HBM (none with one rank: the tiles read x in place), each copy's slot
        entries, at most the programs' copy rate; plus the per-task claim and
        release."""
        moved = (rows_out + (rows_own if own and w > 1 else 0)) * row_bytes + tokens * k * 8
        link_t = np.maximum(rows_out, rows_in) * row_bytes / link if w > 1 else np.zeros(w)
        rate = np.minimum(programs * per_prog, hbm / 2)[:, None]
        tasks = np.ceil(tokens[None, :] / c["dispatch_block_tokens"][:, None])
        return np.maximum(link_t[None, :], moved[None, :] / rate) + tasks / programs[:, None] * 2 * hw.release_us * us

    def gemm(kernel, n_total, k_total, mats, bn, bk, warps, stages, per_sm, a_row_bytes, out_elem_bytes, clock,
             extra_tile_s=0.0, extra_bytes=0.0, tma=False, variant=None) -> np.ndarray:
        """``(N, W)``: the GEMM tiles of one launch, ``mats`` weight matrices of
        ``k_total x n_total`` per expert (one accumulator each). Compute: tiles in
        waves over ``grid * per_sm`` programs, ``ceil(k_total / bk)`` MMA steps each
        at the tile's efficiency plus a fixed cost (and ``extra_tile_s``) that a
        second program per SM hides; memory: the experts' weights once per
        row-tile group, the rows, the outputs (and ``extra_bytes``). ``variant``:
        (suffix, mask) of another code path of the kernel (``_efficiency``); ``clock``
        ``(N,)``: the SM clock's share of its rested rate (``clock_factor``)."""
        eff = _efficiency(hw, kernel, c["block_m"], bn * mats, bk, warps, stages, per_sm, tma, variant)
        col_blocks = np.ceil(n_total / bn)[:, None]
        flops = 2 * bm * bn[:, None] * k_total * mats
        t_mma = flops / (peak_sm * eff[:, None])
        out_bytes = bm * bn[:, None] * out_elem_bytes * mats
        t_fixed = hw.tile_fixed_us * us + out_bytes / (hbm / sms) + extra_tile_s
        pps = per_sm[:, None].astype(float)
        t_sm = np.maximum(t_mma, (t_mma + t_fixed) / pps)
        tiles = tiles_m * col_blocks
        compute = np.ceil(tiles / (grid[:, None] * pps)) * pps * t_sm / clock[:, None]
        weights = groups_m * n_total * k_total * mats * b
        rows = rows_rank[None, :]
        memory = (weights + rows * a_row_bytes + rows * n_total * out_elem_bytes * mats + extra_bytes) / hbm
        return roofline(compute, memory)

    fwd: dict[str, np.ndarray] = {}
    bwd: dict[str, np.ndarray] = {}
    bounds: dict[str, object] = {}

    # ---- forward, each stage alone (its sequential launch) ----
    exchange = 3 * launch + (hw.exchange_us * us if w > 1 else 0.0)
    fwd["exchange"] = np.full(n, exchange)
    bounds["forward.exchange"] = "3 route launches" + (" + counts exchange with peers" if w > 1 else "")
    disp_all = copy_rows(d * b, grid)
    fwd["dispatch"] = slowest(disp_all) + launch
    bounds["forward.dispatch"] = (f"NVLink: {rows_out.max() * d * b / 1e6:.1f} MB out of the busiest rank"
                                  if w > 1 else "slot entries only (x read in place)")
    fc1 = gemm("fc1", h, d, 2, c["fc1_block_n"], c["fc1_block_k"], c["fc1_num_warps"], c["fc1_num_stages"],
               np.ones(n), d * b, b * 1.5, clock_f,  # h and the saved h1 | h3: 3 outputs over 2 accumulators
               variant=("_one", c["fc1_one_dot"] & (not shape.score_before_experts)))  # as runtime.forward runs it
    fwd["fc1"] = slowest(fc1) + launch
    bounds["forward.fc1"] = f"GEMM: {rows_rank.max():.0f} rows x {d} x 2 x {h}, weights once per row-tile group"
    tile_remote = bm * c["fc2_block_n"][:, None] * b * remote_share[None, :]
    fc2_wait = np.where(~c["fc2_defer_release"][:, None], hw.release_us * us + tile_remote / per_prog, 0.0)
    fc2_local = gemm("fc2", d, h, 1, c["fc2_block_n"], c["fc2_block_k"], c["fc2_num_warps"], c["fc2_num_stages"],
                     c["fc2_programs_per_sm"], h * b, b, clock_f, extra_tile_s=fc2_wait,
                     tma=c["fc2_tma"] & (b == 2) & (h % 8 == 0), variant=("_flat", c["fc2_flat_loop"]))
    combine_link = np.maximum(back_out, back_in) * d * b / link if w > 1 else np.zeros(w)
    fc2 = np.maximum(fc2_local, combine_link[None, :])
    fwd["fc2"] = slowest(fc2) + launch
    bounds["forward.fc2"] = "GEMM and " + (
        f"{back_out.max() * d * b / 1e6:.1f} MB back over NVLink" if w > 1 else "its stores")
    reduce_rate = np.minimum(grid * per_prog, hbm)
    t_max = tokens.max()
    reduce_read = t_max * k * d * b
    reduce_tasks = np.ceil(t_max / c["reduce_block_tokens"]) * np.ceil(d / np.minimum(c["reduce_block_dim"], d))
    fwd["reduce"] = ((reduce_read + t_max * d * b) / reduce_rate + reduce_tasks / grid * hw.release_us * us
                     + launch)
    bounds["forward.reduce"] = "program copy rate / HBM"

    # ---- backward, each stage alone ----
    bwd["exchange"] = fwd["exchange"]
    bounds["backward.exchange"] = bounds["forward.exchange"]
    bdisp_all = copy_rows(2 * d * b, grid)
    bwd["dispatch"] = slowest(bdisp_all) + launch
    bounds["backward.dispatch"] = ("[x | dOut] rows: " + bounds["forward.dispatch"] if w > 1
                                   else "slot entries only (x, dOut read in place)")
    copies = c["dh_copies_rows"]
    h_blocks = np.ceil(h / c["dh_block_n"])[:, None]
    copy_tile_s = np.where(copies[:, None], bm * 2 * d * b / h_blocks / per_prog, 0.0)
    dh = gemm("dh", h, d, 1, c["dh_block_n"], c["dh_block_k"], c["dh_num_warps"], c["dh_num_stages"],
              c["dh_programs_per_sm"], d * b, 4, clock_b, extra_tile_s=copy_tile_s,
              extra_bytes=np.where(copies[:, None], rows_rank[None, :] * 2 * d * b, 0.0))
    bounds["backward.dh"] = "GEMM G = dOut w2 (fp32 out)"
    bwd["dh"] = slowest(dh) + launch
    swiglu_bytes = rows_rank.max() * h * (4 + 2 * b + 3 * b)
    bwd["swiglu"] = np.full(n, swiglu_bytes / hbm + launch)
    bounds["backward.swiglu"] = "HBM: G, h1 | h3 in; h, dh1, dh3 out"
    bwd["gather"] = np.where(copies, 0.0, rows_rank.max() * 2 * d * b * 2 / hbm + launch)
    bounds["backward.gather"] = "HBM (none when the dH tasks copy the slot rows)"
    da_remote = bm * c["da_block_n"][:, None] * b * remote_share[None, :]
    da_wait = hw.release_us * us + da_remote / per_prog
    da_tma = c["da_tma"] & (h % c["da_block_k"] == 0) & (b == 2)
    da = gemm("da", d, 2 * h, 1, c["da_block_n"], c["da_block_k"], c["da_num_warps"], c["da_num_stages"],
              c["da_programs_per_sm"], 2 * h * b, b, clock_b, extra_tile_s=da_wait,
              tma=da_tma)
    bwd["da"] = slowest(np.maximum(da, combine_link[None, :])) + launch
    bounds["backward.da"] = "GEMM dA = dh1 w1 + dh3 w3; and its rows back over NVLink"
    breduce_read = t_max * k * d * b
    bwd["reduce"] = ((breduce_read + t_max * d * b) / reduce_rate + reduce_tasks / grid * hw.release_us * us
                     + launch)
    bounds["backward.reduce"] = "program copy rate / HBM"
    gb = shape.grad_bytes
    wgrad_flops = 3 * 2 * rows_rank.max() * d * h
    wgrad_bytes = 3 * el * d * h * gb + rows_rank.max() * (2 * d + 3 * h) * b
    backend = c["wgrad_backend"]
    grouped = (backend == "grouped_mm") | ((backend == "auto") & shape.grouped_mm_weight_grads("auto"))
    expert_rows = stats.expert_rows.reshape(w, el)
    grouped_eff = _grouped_mm_rank_efficiency(hw, expert_rows)
    t_grouped = slowest(grouped_mm_wgrad_time(hw, expert_rows, d, h, b, rows_rank, clock=clock_b[:, None]))
    if gb != b:  # torch._grouped_mm writes the data's dtype: its gradients are widened after it
        t_grouped = t_grouped + 3 * el * d * h * (b + gb) / hbm + 3 * launch
    w13 = _efficiency(hw, "wgrad_w13", c["wgrad_w13_block_m"], c["wgrad_w13_block_n"] * 2, c["wgrad_w13_block_k"],
                      c["wgrad_w13_num_warps"], c["wgrad_w13_num_stages"], 1)
    w2 = _efficiency(hw, "wgrad_w2", c["wgrad_w2_block_m"], c["wgrad_w2_block_n"], c["wgrad_w2_block_k"],
                     c["wgrad_w2_num_warps"], c["wgrad_w2_num_stages"], 1)
    t_triton = roofline(wgrad_flops / (hw.peak_tflops * 1e12 * clock_b) * (2 / 3 / w13 + 1 / 3 / w2),
                        wgrad_bytes / hbm)
    bwd["wgrad"] = np.where(grouped, t_grouped + 3 * launch, t_triton + 2 * launch)
    busiest = int(np.argmax(rows_rank))
    bounds["backward.wgrad"] = (f"GEMM (torch._grouped_mm where it runs: {grouped_eff[busiest]:.2f} of peak at "
                                f"{rows_rank[busiest] / el:.0f} rows per expert on the busiest rank; "
                                "else the Triton kernel)")

    for direction, stages in (("forward", fwd), ("backward", bwd)):
        for stage in stages:
            scale = hw.stage_scale.get(f"{direction}.{stage}", hw.stage_scale.get(direction, 1.0))
            stages[stage] = stages[stage] * scale

    # ---- the schedule ----
    if schedule == "sequential":
        exposed_f, exposed_b = dict(fwd), dict(bwd)
    else:
        # dispatch_fc1 in one launch. Dispatch-first: every program copies,
        # then takes tiles. Otherwise dispatch_programs copy while the rest
        # take tiles, which find their rows only part of the time
        # (dispatch_overlap); local_first: every program copies its own rows
        # first, the dispatchers the rest.
        dispatchers = np.minimum(c["dispatch_programs"], grid).astype(float)
        first = c["dispatch_programs"] >= grid
        fc1_t = fwd["fc1"] - launch
        hybrid = slowest(copy_rows(d * b, dispatchers, own=False))
        own = slowest(rows_own[None, :] * d * b / np.minimum(grid * per_prog, hbm / 2)[:, None])
        hybrid = np.where(c["local_first"], own + hybrid, slowest(copy_rows(d * b, dispatchers)))
        hidden = hw.dispatch_overlap * (grid - dispatchers) / grid
        disp_exposed = np.where(first, fwd["dispatch"] - launch, hybrid * (1 - hidden))
        exposed_f = {"exchange": fwd["exchange"], "dispatch": disp_exposed, "fc1": fc1_t + launch}
        # fc2_combine in one launch: the reduce tail waits for each token's last row
        exposed_f["fc2"] = fwd["fc2"]
        exposed_f["reduce"] = (fwd["reduce"] - launch) * hw.reduce_tail
        # dispatch_dh: every program dispatches first (with local_first: own rows first)
        exposed_b = dict(bwd)
        exposed_b["dispatch"] = bwd["dispatch"] - launch
        exposed_b["reduce"] = (bwd["reduce"] - launch) * hw.reduce_tail
    f_total = sum(exposed_f.values())
    b_total = sum(exposed_b.values())

    exposed = {f"forward.{k}": v for k, v in exposed_f.items()}
    exposed.update({f"backward.{k}": v for k, v in exposed_b.items()})
    full = lambda v: np.broadcast_to(np.asarray(v, dtype=float), (n,))  # noqa: E731
    return _Batch(schedule, {k: full(v) for k, v in fwd.items()}, {k: full(v) for k, v in bwd.items()},
                  {k: full(v) for k, v in exposed.items()}, bounds, full(f_total), full(b_total))


def _roofline(hw: HardwareConstants, compute, memory):
    """Compute and memory time of one launch, overlapping imperfectly (a p-norm)."""
    p = hw.roofline_p
    return (compute**p + memory**p) ** (1 / p)


def _grouped_mm_rank_efficiency(hw: HardwareConstants, expert_rows: np.ndarray) -> np.ndarray:
    """``(W,)``: torch._grouped_mm's fraction of peak over each rank's weight
    gradients, ``expert_rows`` ``(W, El)`` rows of every local expert. An
    expert's FLOPs grow with its rows and its efficiency with them too
    (``hw.grouped_mm_efficiency_at``), so a rank's figure is the
    rows-weighted harmonic mean over its experts (its time is the sum of
    theirs); the one ``hw.grouped_mm_efficiency`` without a rows table (and
    on a rank without rows)."""
    w = expert_rows.shape[0]
    if not hw.grouped_mm_efficiency_by_rows:
        return np.full(w, hw.grouped_mm_efficiency)
    rows = expert_rows.sum(axis=1)
    rows_over_efficiency = (expert_rows / hw.grouped_mm_efficiency_at(expert_rows)).sum(axis=1)
    return np.divide(rows, rows_over_efficiency, out=np.full(w, hw.grouped_mm_efficiency),
                     where=rows_over_efficiency > 0)


def grouped_mm_wgrad_time(hw: HardwareConstants, expert_rows: np.ndarray, dim: int, hidden: int, dtype_bytes: int,
                          rows_rank: np.ndarray | None = None, clock=1.0) -> np.ndarray:
    """Seconds ``(W,)`` of each rank's three torch._grouped_mm weight-gradient
    calls (dW1 | dW3 = dh1 | dh3^T xs, dW2 = dOut^T h; launches not included):
    ``expert_rows`` ``(W, El)`` rows of each local expert, ``rows_rank``
    ``(W,)`` the rank's slots (default: its experts' rows). A roofline of the
    FLOPs at ``_grouped_mm_rank_efficiency`` (and ``clock``: the SM clock's
    share of its rested rate; an ``(N, 1)`` array gives ``(N, W)``) against
    HBM bytes (every expert's three weight gradients written, the rank's rows
    read). The model's ``backward.wgrad`` and the calibration of
    ``grouped_mm_efficiency_by_rows`` both use it."""
    expert_rows = np.asarray(expert_rows, dtype=float)
    rows_rank = expert_rows.sum(axis=1) if rows_rank is None else np.asarray(rows_rank, dtype=float)
    d, h, b, el = dim, hidden, dtype_bytes, expert_rows.shape[1]
    flops = 3 * 2 * rows_rank * d * h
    moved = 3 * el * d * h * b + rows_rank * (2 * d + 3 * h) * b
    eff = _grouped_mm_rank_efficiency(hw, expert_rows)
    return _roofline(hw, flops / (hw.peak_tflops * 1e12 * eff * clock), moved / (hw.hbm_gbps * 1e9))


def _efficiency(hw: HardwareConstants, kernel: str, bm, bn, bk, warps, stages, per_sm, tma=False,
                variant=None) -> np.ndarray:
    """``hw.tile_efficiency`` over columns of points: calibrated keys looked up
    per distinct configuration (kernel ``"<kernel>_tma"`` where ``tma``: its
    operands through tensor descriptors; ``"<kernel><suffix>"`` where
    ``variant = (suffix, mask)`` marks another code path, e.g. fc1's
    ``"_one"`` for ``fc1_one_dot``, fc2's ``"_flat"`` for ``fc2_flat_loop``),
    the formula elsewhere (times ``hw.tma_speedup`` with descriptors; a
    variant's uncalibrated figure is its kernel's)."""
    bm, bn, bk, warps, stages = (np.broadcast_to(np.asarray(x), np.shape(bm)).astype(int)
                                 for x in (bm, bn, bk, warps, stages))
    per_sm = np.broadcast_to(np.asarray(per_sm), bm.shape).astype(int)
    tma = np.broadcast_to(np.asarray(tma, dtype=bool), bm.shape)
    suffix, other = variant if variant is not None else ("", False)
    other = np.broadcast_to(np.asarray(other, dtype=bool), bm.shape)
    eff = _tile_efficiency(bm, bn, bk, warps, stages) * np.where(tma, hw.tma_speedup, 1.0)
    if hw.gemm_efficiency:
        configs = np.stack([bm, bn, bk, warps, stages, per_sm, tma.astype(int), other.astype(int)], axis=1)
        unique, inverse = np.unique(configs, axis=0, return_inverse=True)
        inverse = inverse.reshape(-1)
        for j, cfg in enumerate(unique):
            *tile, with_tma, with_variant = (int(x) for x in cfg)
            key = tile_key(kernel + (suffix if with_variant else "") + ("_tma" if with_tma else ""), *tile)
            if key in hw.gemm_efficiency:
                eff[inverse == j] = hw.gemm_efficiency[key]
    return np.maximum(eff, 1e-3)
