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
  ``fc1``, ``fc2``, ``combine`` (the staged combine's sends, the presum
  tasks; the direct combine is fc2's stores), ``reduce``;
- backward: ``exchange``, ``dispatch`` (``[x | dOut]`` rows), ``dh`` (G,
  with h1 | h3 recomputed when not saved), ``swiglu`` (saved h1 | h3 only),
  ``gather`` (slot rows, when the dH tasks do not copy them), ``da``,
  ``reduce``, ``wgrad``.

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
from typing import Iterable, Sequence

import numpy as np

from ..params import LayerParams
from .hardware import (  # noqa: F401  (re-exported: the model's constants)
    HardwareConstants,
    _tile_efficiency,
    default_constants,
    load_constants,
    save_constants,
    tile_key,
)
from .space import LayerShape

__all__ = [
    "BACKWARD_STAGES",
    "FORWARD_STAGES",
    "HardwareConstants",
    "Prediction",
    "RoutingStats",
    "default_constants",
    "load_constants",
    "predict",
    "rank",
    "save_constants",
]

FORWARD_STAGES = ("exchange", "dispatch", "fc1", "fc2", "combine", "reduce")
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


def _tiles(rows: np.ndarray, block_m: np.ndarray) -> np.ndarray:
    """Row tiles ``sum_e ceil(rows_e / BM)`` per point ``(N,)`` for one rank's experts ``rows``."""
    out = np.empty(len(block_m))
    for bm in np.unique(block_m):
        out[block_m == bm] = np.ceil(rows / bm).sum()
    return out


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


def predict(shape: LayerShape, stats: RoutingStats, ep_size: int, params: LayerParams, hw: HardwareConstants,
            *, schedule: str = "fused", saved_h13: bool = True) -> Prediction:
    """The model's prediction of one point (``rank`` of one)."""
    return Prediction(_model(shape, stats, ep_size, [params], hw, schedule=schedule, saved_h13=saved_h13), 0)


def rank(shape: LayerShape, stats: RoutingStats, ep_size: int, points: Iterable[LayerParams],
         hw: HardwareConstants, *, schedule: str = "fused", saved_h13: bool = True,
         objective: str = "total") -> list[tuple[LayerParams, Prediction]]:
    """``points`` with their predictions, fastest first by ``objective``
    (``"total"``: forward + backward, ``"forward"`` or ``"backward"``); ties
    keep the input order. Vectorised: one numpy pass over all points."""
    points = list(points)
    if not points:
        return []
    if objective not in ("total", "forward", "backward"):
        raise ValueError(f"objective must be 'total', 'forward' or 'backward', got {objective!r}")
    batch = _model(shape, stats, ep_size, points, hw, schedule=schedule, saved_h13=saved_h13)
    score = {"total": batch.forward_total + batch.backward_total, "forward": batch.forward_total,
             "backward": batch.backward_total}[objective]
    return [(points[i], Prediction(batch, i)) for i in np.argsort(score, kind="stable").tolist()]


def _model(shape: LayerShape, stats: RoutingStats, ep_size: int, points: Sequence[LayerParams],
           hw: HardwareConstants, *, schedule: str, saved_h13: bool) -> _Batch:
    if schedule not in ("fused", "sequential"):
        raise ValueError(f"schedule must be 'fused' or 'sequential', got {schedule!r}")
    if stats.ep_size != ep_size or shape.ep_size != ep_size:
        raise ValueError(f"ep_size ({ep_size}) must match the routing's ({stats.ep_size}) and the shape's "
                         f"({shape.ep_size})")
    if stats.num_experts != shape.num_experts:
        raise ValueError(f"the routing has {stats.num_experts} experts, the shape {shape.num_experts}")
    c = _columns(points, hw.sm_count)
    n = len(points)
    w, d, h, k, b = ep_size, shape.dim, shape.hidden, shape.top_k, shape.dtype_bytes
    el = shape.local_experts
    sms = hw.sm_count
    peak_sm = hw.peak_tflops * 1e12 / sms  # FLOP/s of one SM
    hbm = hw.hbm_gbps * 1e9
    link = max(hw.nvlink_gbps, 1e-3) * 1e9
    per_prog = hw.copy_gbps_per_program * 1e9
    us = 1e-6
    grid = np.minimum(c["num_programs"], sms).astype(float)

    # ---- per-rank traffic and rows (the slowest rank bounds every launch) ----
    rows_rank = stats.rows_per_rank()  # (W,) slots received
    tokens = stats.tokens
    remote = 1 - np.eye(w)
    rows_out = (stats.send_rows * remote).sum(axis=1)  # dedup rows a source sends to peers
    rows_in = (stats.send_rows * remote).sum(axis=0)  # dedup rows a rank receives from peers
    rows_local = np.diag(stats.send_rows)
    copies_back_out = (stats.send_copies * remote).sum(axis=0)  # combine rows an expert rank sends back
    copies_back_in = (stats.send_copies * remote).sum(axis=1)  # combine rows a source receives

    def slowest(per_rank: np.ndarray) -> np.ndarray:
        """``(N, W)`` -> ``(N,)``: the slowest rank."""
        return per_rank.max(axis=1)

    def dispatch_time(row_bytes: float, programs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(time, bound) of one dispatch: dedup rows over NVLink (out of and
        into each rank), own rows through HBM, at most ``programs`` programs'
        copy rate, plus the per-task claim and release."""
        link_t = np.maximum(rows_out, rows_in) * row_bytes / link if w > 1 else np.zeros(w)
        local_t = rows_local * row_bytes * 2 / hbm
        moved = (rows_out + rows_local)[None, :] * row_bytes
        rate = np.minimum(programs[:, None] * per_prog, hbm / 2)
        copy_t = moved / rate
        tasks = np.ceil(tokens[None, :] / c["dispatch_block_tokens"][:, None])
        task_t = tasks / programs[:, None] * (2 * hw.release_us * us)
        t = np.maximum(np.maximum(link_t + local_t, 0)[None, :], copy_t) + task_t
        bound = np.where(copy_t.max(axis=1) >= (link_t + local_t).max(), "program copy rate", "NVLink")
        return slowest(t), bound

    def gemm_time(kernel: str, tiles_m: np.ndarray, bn, bk, kdim, ntot, flops_per_tile, warps, stages, per_sm,
                  epilogue_bytes, programs) -> np.ndarray:
        """GEMM tiles in waves: ``tiles_m`` row tiles (N, W) x ``ceil(ntot / bn)``
        column blocks, each ``ceil(kdim / bk)`` MMA steps plus a fixed cost and
        its epilogue stores, ``per_sm`` programs per SM hiding each other's
        fixed part."""
        eff = _efficiency(hw, kernel, c["block_m"], bn, bk, warps, stages, per_sm)
        steps = np.ceil(kdim / bk)
        mma = flops_per_tile / steps  # per K step
        t_mma = steps * mma / (peak_sm * eff)
        t_fixed = hw.tile_fixed_us * us + epilogue_bytes / (hbm / sms)
        t_sm = np.maximum(t_mma, (t_mma + t_fixed) / per_sm)  # one SM's time per tile
        tiles = tiles_m * np.ceil(ntot / bn)[:, None]
        progs = (programs * per_sm)[:, None]
        waves = np.ceil(tiles / progs)
        return slowest(waves * (t_sm * per_sm)[:, None])

    local_rows = [stats.expert_rows[r * el:(r + 1) * el] for r in range(w)]
    tiles_m = np.stack([_tiles(rows, c["block_m"]) for rows in local_rows], axis=1)  # (N, W)

    fwd: dict[str, np.ndarray] = {}
    bwd: dict[str, np.ndarray] = {}
    bounds: dict[str, object] = {}
    launch = hw.launch_us * us
    exchange = 3 * launch + (hw.exchange_us * us if w > 1 else 0.0)
    fwd["exchange"] = np.full(n, exchange)
    bounds["forward.exchange"] = "3 launches + counts exchange"

    # ---- forward ----
    dispatch_first = c["dispatch_programs"] >= grid
    dispatchers = np.minimum(c["dispatch_programs"], grid).astype(float)
    disp_alone, disp_bound = dispatch_time(d * b, grid)  # sequential: every program dispatches
    fwd["dispatch"] = disp_alone + launch
    bounds["forward.dispatch"] = disp_bound

    save = 2 if True else 0  # the op saves h1 | h3 in the forward
    fc1 = gemm_time("fc1", tiles_m, c["fc1_block_n"], c["fc1_block_k"], d, h, 2 * c["block_m"] * c["fc1_block_n"] * 2 * d,
                    c["fc1_num_warps"], c["fc1_num_stages"], 1,
                    c["block_m"] * c["fc1_block_n"] * b * (1 + save), grid)
    fwd["fc1"] = fc1 + launch
    bounds["forward.fc1"] = "GEMM tiles"

    staged, presum = c["combine"] == "staged", c["combine"] == "presum"
    direct = ~(staged | presum)
    # fc2 epilogue: direct stores the rows to their sources; the release after
    # remote stores waits for them unless deferred or hidden by a 2nd program
    remote_frac = float(copies_back_out.sum() / max(rows_rank.sum(), 1)) if w > 1 else 0.0
    tile_bytes = c["block_m"] * c["fc2_block_n"] * b
    release_wait = np.where(direct & ~c["fc2_defer_release"],
                            tile_bytes * remote_frac / (link / sms) * 0.5 + hw.release_us * us, 0.0)
    fc2_grid = grid
    fc2 = gemm_time("fc2", tiles_m, c["fc2_block_n"], c["fc2_block_k"], h, d,
                    2 * c["block_m"] * c["fc2_block_n"] * h, c["fc2_num_warps"], c["fc2_num_stages"],
                    c["fc2_programs_per_sm"], tile_bytes * (1 + 0.0) + release_wait * (hbm / sms), fc2_grid)
    fc2 = fc2 * np.where(c["fc2_tma"], 0.98, 1.0)
    combine_link = np.where(w > 1, slowest(np.broadcast_to(np.maximum(copies_back_out, copies_back_in) * d * b / link,
                                                          (n, w))), 0.0)
    fwd["fc2"] = np.where(direct, np.maximum(fc2, combine_link), fc2) + launch
    bounds["forward.fc2"] = "GEMM tiles (direct: and the combine's NVLink bytes)"
    # staged: y written locally then sent by tasks; presum: one fp32 partial per (token, rank)
    y_bytes = rows_rank.max() * d * b
    send_staged = np.maximum(combine_link, y_bytes * 2 / hbm)
    partial_rows_out = (stats.send_rows * remote).sum(axis=0).max()
    presum_link = partial_rows_out * d * 4 / link if w > 1 else 0.0
    presum_t = np.maximum(presum_link, (y_bytes + rows_rank.max() * d * 4 / k) / hbm)
    fwd["combine"] = np.where(staged, send_staged + launch, np.where(presum, presum_t + launch, 0.0))
    bounds["forward.combine"] = "staged: NVLink / y through HBM; presum: fp32 partials"
    reduce_read = np.where(presum, tokens.max() * w * d * 4, tokens.max() * k * d * b)
    reduce_bytes = reduce_read + tokens.max() * d * b
    reduce_tasks = np.ceil(tokens.max() / c["reduce_block_tokens"]) * np.ceil(d / c["reduce_block_dim"])
    reduce_rate = np.minimum(grid * per_prog, hbm)
    fwd["reduce"] = reduce_bytes / reduce_rate + reduce_tasks / grid * hw.release_us * us + launch
    bounds["forward.reduce"] = "HBM / program copy rate"

    # ---- backward ----
    bwd["exchange"] = np.full(n, exchange)
    bounds["backward.exchange"] = "3 launches + counts exchange"
    bdisp, bdisp_bound = dispatch_time(2 * d * b, grid)
    bwd["dispatch"] = bdisp + launch
    bounds["backward.dispatch"] = bdisp_bound
    dh_per_sm = c["dh_programs_per_sm"] if saved_h13 else np.ones(n)
    copy_rows = saved_h13 & c["dh_copies_rows"]
    dh_flops = 2 * c["block_m"] * c["dh_block_n"] * d * (1 if saved_h13 else 3)
    dh_epi = c["block_m"] * c["dh_block_n"] * (4 if saved_h13 else 3 * b) + np.where(
        copy_rows, c["block_m"] * 2 * d * b / np.ceil(h / c["dh_block_n"]), 0)
    dh_eff_scale = 1.0 if saved_h13 else np.where(c["dh_two_pass"], 0.92, 0.8)
    dh = gemm_time("dh", tiles_m, c["dh_block_n"], c["dh_block_k"], d * (1 if saved_h13 else 3), h, dh_flops,
                   c["dh_num_warps"], c["dh_num_stages"], dh_per_sm, dh_epi, grid) / dh_eff_scale
    bwd["dh"] = dh + launch
    bounds["backward.dh"] = "GEMM tiles" + ("" if saved_h13 else " (h1 | h3 recomputed)")
    swiglu_bytes = rows_rank.max() * h * (4 + 2 * b + 3 * b)
    bwd["swiglu"] = np.full(n, swiglu_bytes / hbm + launch if saved_h13 else 0.0)
    bounds["backward.swiglu"] = "HBM"
    gather = rows_rank.max() * 2 * d * b * 2 / hbm + launch
    bwd["gather"] = np.where(copy_rows, 0.0, gather)
    bounds["backward.gather"] = "HBM"
    da_tile_bytes = c["block_m"] * c["da_block_n"] * b
    da_release = np.where(~c["da_defer_release"], da_tile_bytes * remote_frac / (link / sms) * 0.5
                          + hw.release_us * us, 0.0)
    da = gemm_time("da", tiles_m, c["da_block_n"], c["da_block_k"], 2 * h, d, 2 * c["block_m"] * c["da_block_n"] * 2 * h,
                   c["da_num_warps"], c["da_num_stages"], c["da_programs_per_sm"],
                   da_tile_bytes + da_release * (hbm / sms), grid)
    da = da * np.where(c["da_tma"] & (h % c["da_block_k"] == 0) & (b == 2), 0.95, 1.0)
    bwd["da"] = np.maximum(da, combine_link) + launch
    bounds["backward.da"] = "GEMM tiles and the combine's NVLink bytes"
    breduce_bytes = tokens.max() * k * d * b + tokens.max() * d * b
    breduce_tasks = np.ceil(tokens.max() / c["reduce_block_tokens"]) * np.ceil(d / c["reduce_block_dim"])
    bwd["reduce"] = breduce_bytes / reduce_rate + breduce_tasks / grid * hw.release_us * us + launch
    bounds["backward.reduce"] = "HBM / program copy rate"
    wgrad_flops = 3 * 2 * rows_rank.max() * d * h
    grouped = c["wgrad_backend"] != "triton"
    t_grouped = wgrad_flops / (hw.peak_tflops * 1e12 * hw.grouped_mm_efficiency) + 6 * launch
    w13_eff = _efficiency(hw, "wgrad_w13", c["wgrad_w13_block_m"], c["wgrad_w13_block_n"], c["wgrad_w13_block_k"],
                          c["wgrad_w13_num_warps"], c["wgrad_w13_num_stages"], 1)
    w2_eff = _efficiency(hw, "wgrad_w2", c["wgrad_w2_block_m"], c["wgrad_w2_block_n"], c["wgrad_w2_block_k"],
                         c["wgrad_w2_num_warps"], c["wgrad_w2_num_stages"], 1)
    t_triton = (2 / 3 * wgrad_flops / (hw.peak_tflops * 1e12 * w13_eff)
                + 1 / 3 * wgrad_flops / (hw.peak_tflops * 1e12 * w2_eff) + 2 * launch)
    bwd["wgrad"] = np.where(grouped, t_grouped, t_triton)
    bounds["backward.wgrad"] = "GEMM (torch._grouped_mm or the Triton kernel)"

    for direction, stages in (("forward", fwd), ("backward", bwd)):
        for stage in stages:
            stages[stage] = stages[stage] * hw.stage_scale.get(f"{direction}.{stage}", 1.0)

    # ---- the schedule: sequential sums; fused overlaps inside launches ----
    if schedule == "sequential":
        f_total = sum(fwd.values())
        b_total = sum(bwd.values())
        exposed_f = dict(fwd)
        exposed_b = dict(bwd)
    else:
        # dispatch_fc1: dispatch-first runs both back to back in one launch;
        # hybrid: dispatchers send while the others take tiles, tiles wait
        # for rows, so only part of the dispatch hides behind GEMM work.
        hybrid_disp, _ = dispatch_time(d * b, dispatchers)
        fc1_rest = fwd["fc1"] - launch
        hybrid = np.maximum(hybrid_disp, (1 - hw.dispatch_overlap) * hybrid_disp
                            + fc1_rest * grid / np.maximum(grid - dispatchers * (1 - hw.dispatch_overlap), 1))
        a_launch = np.where(dispatch_first, (fwd["dispatch"] - launch) + fc1_rest, hybrid) + launch
        exposed_f = {"exchange": fwd["exchange"], "dispatch": a_launch - fc1_rest - launch, "fc1": fc1_rest + launch}
        # fc2_combine: the reduce tail waits for each token's last row
        tail = 0.5
        fc2_part = fwd["fc2"] + np.where(staged | presum, 0.5 * fwd["combine"], 0.0)
        exposed_f.update(fc2=fc2_part, combine=np.where(staged | presum, 0.5 * fwd["combine"], 0.0),
                         reduce=tail * (fwd["reduce"] - launch))
        exposed_f["fc2"] = fwd["fc2"]
        f_total = sum(exposed_f.values())
        # dispatch_dh: every program dispatches first, then dH tiles
        exposed_b = dict(bwd)
        exposed_b["reduce"] = tail * (bwd["reduce"] - launch)
        b_total = sum(exposed_b.values())

    exposed = {f"forward.{k}": v for k, v in exposed_f.items()}
    exposed.update({f"backward.{k}": v for k, v in exposed_b.items()})
    full = lambda v: np.broadcast_to(np.asarray(v, dtype=float), (n,))  # noqa: E731
    return _Batch(schedule, {k: full(v) for k, v in fwd.items()}, {k: full(v) for k, v in bwd.items()},
                  {k: full(v) for k, v in exposed.items()}, bounds, full(f_total), full(b_total))


def _efficiency(hw: HardwareConstants, kernel: str, bm, bn, bk, warps, stages, per_sm) -> np.ndarray:
    """``hw.tile_efficiency`` over columns of points: calibrated keys looked up
    per distinct configuration, the formula elsewhere."""
    bm, bn, bk, warps, stages = (np.broadcast_to(np.asarray(x), np.shape(bm)).astype(int)
                                 for x in (bm, bn, bk, warps, stages))
    per_sm = np.broadcast_to(np.asarray(per_sm), bm.shape).astype(int)
    eff = _tile_efficiency(bm, bn, bk, warps, stages) * 1.0
    if hw.gemm_efficiency:
        configs = np.stack([bm, bn, bk, warps, stages, per_sm], axis=1)
        unique, inverse = np.unique(configs, axis=0, return_inverse=True)
        inverse = inverse.reshape(-1)
        for j, cfg in enumerate(unique):
            key = tile_key(kernel, *(int(x) for x in cfg))
            if key in hw.gemm_efficiency:
                eff[inverse == j] = hw.gemm_efficiency[key]
    return np.maximum(eff, 1e-3)
