"""The hardware constants of the analytic model (``tuning.model``), per GPU model.

``HardwareConstants`` holds the limits that decide which tiles fit
(``tuning.space.feasible``: SMs, shared memory, registers) and the rates
the model predicts with (GEMM efficiency per tile configuration, HBM and
NVLink bandwidth, a program's copy rate, launch, barrier and release
latency, the fused launches' overlap). ``default_constants`` gives an
H200's from its documented limits and ``docs/performance.md``'s figures,
marked uncalibrated; ``python -m titan_uniep.tuning.calibrate --out FILE``
measures them once per GPU model and ``load_constants(FILE)`` reads them.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

__all__ = ["HardwareConstants", "clock_factor", "default_constants", "load_constants", "save_constants", "tile_key"]


def tile_key(kernel: str, bm: int, bn: int, bk: int, warps: int, stages: int, per_sm: int = 1) -> str:
    """The key of one GEMM tile configuration in ``HardwareConstants.gemm_efficiency``:
    ``kernel`` one of ``fc1``, ``fc2``, ``dh``, ``da``, ``wgrad_w13``, ``wgrad_w2``,
    with ``_one`` appended for fc1's one-dot tile (``fc1_one_dot``) and
    ``_tma`` for descriptor loads (``fc2_tma``, ``da_tma``);
    ``bn`` counts every accumulator's columns (fc1: 2 x ``fc1_block_n``)."""
    return f"{kernel}:{bm}x{bn}x{bk}:w{warps}:s{stages}:p{per_sm}"


@dataclass
class HardwareConstants:
    """What the model knows of one GPU model. Rates are per GPU unless named
    per SM; ``gemm_efficiency`` maps ``tile_key(...)`` to the fraction of
    ``peak_tflops`` a kernel's K-loop reaches at that tile (one SM's share
    per program), missing keys fall back to ``tile_efficiency``'s formula;
    ``stage_scale`` multiplies a stage's predicted time (``"forward.fc1"``,
    ...; else the direction's ``"forward"`` / ``"backward"``; else 1), as
    fitted by ``calibrate fit``; ``grouped_mm_efficiency_by_rows`` maps rows
    per expert (decimal strings, the calibration's powers of two: ``"256"``)
    to the fraction of ``peak_tflops`` torch._grouped_mm reaches on the
    weight gradients of experts that size (``grouped_mm_efficiency_at``),
    empty: the one ``grouped_mm_efficiency`` for every expert;
    ``sustained_clock`` and ``clock_settle_ms`` say how a GEMM slows down
    as the GPU stays busy (``clock_factor``); ``calibration_samples`` holds
    what ``calibrate measure`` timed, from which ``calibrate refit``
    derives the figures again. ``source``
    says where the figures come from ("uncalibrated: ..." until calibration)."""

    name: str
    source: str
    sm_count: int
    smem_per_sm: int  # bytes
    smem_per_block: int  # bytes
    registers_per_sm: int
    max_registers_per_thread: int
    max_threads_per_sm: int
    peak_tflops: float  # dense 16-bit tensor-core peak
    hbm_gbps: float  # achieved device-memory copy bandwidth (read + write counted)
    nvlink_gbps: float  # achieved per-GPU NVLink bandwidth, one direction (0: unknown / one GPU)
    copy_gbps_per_program: float  # what one program's row copies (dispatch, reduce) move
    launch_us: float  # one kernel launch plus the gap to the next, on the stream
    exchange_us: float  # the counts exchange's publish-and-wait with peers (W > 1)
    release_us: float  # a system-scope release / acquire round trip
    tile_fixed_us: float  # per GEMM tile: pipeline fill, address set-up, the tile wait
    dispatch_overlap: float  # fraction of the dispatch a hybrid fused launch hides behind GEMM tiles
    grouped_mm_efficiency: float  # torch._grouped_mm on the weight gradients, fraction of peak (no rows table)
    roofline_p: float  # a launch's compute and memory times t_c, t_m overlap as (t_c^p + t_m^p)^(1/p)
    tma_speedup: float  # descriptor operand loads against pointer loads, for tiles not calibrated with them
    reduce_tail: float  # fraction of a reduce launch left after the GEMM tiles (fused)
    gemm_efficiency: dict[str, float] = field(default_factory=dict)
    stage_scale: dict[str, float] = field(default_factory=dict)
    grouped_mm_efficiency_by_rows: dict[str, float] = field(default_factory=dict)
    sustained_clock: float = 1.0  # a GEMM's rate under sustained load over its rate in a burst (power limit)
    clock_settle_ms: float = 0.0  # busy time after which half of that loss has set in (0: no loss modelled)
    calibration_samples: dict = field(default_factory=dict)  # the raw measurements the fitted figures come from

    def tile_efficiency(self, kernel: str, bm: int, bn: int, bk: int, warps: int, stages: int, per_sm: int) -> float:
        """Fraction of the per-SM peak a K-loop step reaches: the calibrated
        figure of this tile, else a formula fitted to the figures of
        ``docs/performance.md`` (128 x 256 x 64, 8 warps, 3 stages ~0.66;
        64-row tiles ~40% slower; narrower tiles and shallow rings lose)."""
        key = tile_key(kernel, bm, bn, bk, warps, stages, per_sm)
        if key in self.gemm_efficiency:
            return self.gemm_efficiency[key]
        return _tile_efficiency(bm, bn, bk, warps, stages)

    def grouped_mm_efficiency_at(self, rows) -> np.ndarray:
        """torch._grouped_mm's fraction of peak on the weight gradients of an
        expert with ``rows`` rows (array-like, elementwise). Those rows are
        the GEMMs' reduction length (every dW tile loops over them), so a
        short expert pays its tiles' set-up and stores over few MMA steps.
        The table interpolated linearly in log2(rows) and clamped to its
        first and last entries (fewer than one row counts as one);
        ``grouped_mm_efficiency`` everywhere when the table is empty."""
        rows = np.asarray(rows, dtype=float)
        if not self.grouped_mm_efficiency_by_rows:
            return np.full(rows.shape, self.grouped_mm_efficiency)
        table = _rows_table(self.grouped_mm_efficiency_by_rows)
        return np.interp(np.log2(np.maximum(rows, 1.0)), np.log2(table[:, 0]), table[:, 1])


def clock_factor(hw: "HardwareConstants", busy_s) -> np.ndarray:
    """A GEMM's rate after ``busy_s`` seconds of back-to-back work, relative
    to its rate on a rested GPU (elementwise): a sustained tensor-core load
    holds the board at its power limit and the SM clock settles lower,
    ``sustained + (1 - sustained) * 2^(-busy / settle)``. 1 everywhere while
    uncalibrated (``clock_settle_ms`` 0)."""
    busy = np.asarray(busy_s, dtype=float)
    if hw.clock_settle_ms <= 0 or hw.sustained_clock >= 1:
        return np.ones(busy.shape)
    s = hw.sustained_clock
    return s + (1 - s) * np.exp2(-busy / (hw.clock_settle_ms * 1e-3))


def _rows_table(entries: dict[str, float]) -> np.ndarray:
    """``grouped_mm_efficiency_by_rows`` as ``(n, 2)`` rows / efficiency,
    ascending in rows (the keys' numbers, not their strings: "64" < "1024")."""
    table = []
    for key, eff in entries.items():
        rows = int(key) if str(key).isdigit() else 0
        if rows < 1 or not isinstance(eff, (int, float)) or not 0 < eff <= 1:
            raise ValueError(f"grouped_mm_efficiency_by_rows[{key!r}] = {eff!r}: keys are rows per expert "
                             f"(positive integers as strings, e.g. \"256\"), values fractions of peak in (0, 1]")
        table.append((rows, float(eff)))
    table.sort()
    if len({rows for rows, _ in table}) < len(table):
        raise ValueError(f"grouped_mm_efficiency_by_rows: keys {sorted(entries)} name one row count twice")
    return np.array(table, dtype=float)


def _tile_efficiency(bm, bn, bk, warps, stages):
    """numpy-friendly fallback of ``HardwareConstants.tile_efficiency``."""
    bm, bn, bk = np.asarray(bm, float), np.asarray(bn, float), np.asarray(bk, float)
    warps, stages = np.asarray(warps, float), np.asarray(stages, float)
    # operand bytes per flop fall with the tile: 1/bm + 1/bn; 128 x 256 is the reference
    intensity = (1 / 128 + 1 / 256) / (1 / np.maximum(bm, 16) + 1 / np.maximum(bn, 16))
    eff = 0.66 * np.minimum(1.0, intensity) ** 0.8
    eff = eff * np.where(bm < 64, 0.5, np.where(bm < 128, 0.6, 1.0))
    eff = eff * np.where(stages < 2, 0.55, np.where(stages < 3, 0.85, 1.0))
    eff = eff * np.where(bk < 32, 0.7, np.where(bk < 64, 0.92, 1.0))
    # 4 warps cover a 128-row tile with one warpgroup: fewer MMAs in flight
    eff = eff * np.where((warps < 8) & (bm * bn >= 128 * 256), 0.8, 1.0)
    return eff


def default_constants(gpu_name: str = "NVIDIA H200") -> HardwareConstants:
    """Uncalibrated constants of a GPU model, from its documented limits and
    the measured figures of ``docs/performance.md`` (H200: 132 SMs, 228 KiB
    shared memory per SM and 227 KiB per block, 64K registers per SM, 989
    dense bf16 TFLOP/s, 4.8 TB/s HBM3e spec (about 4.0 copied), NV18 at 450
    GB/s per direction spec (about 0.29 TB/s measured by the qwen3-like
    dispatch: 33.5 MB in 0.117 ms)). Only the H200 is known; other names get
    the H200's figures, marked so in ``source``."""
    known = "H200" in gpu_name
    return HardwareConstants(
        name=gpu_name,
        source=("uncalibrated: H200 specifications and docs/performance.md figures" if known else
                f"uncalibrated: H200 figures used for an unknown GPU ({gpu_name}); run titan_uniep.tuning.calibrate"),
        sm_count=132, smem_per_sm=228 * 1024, smem_per_block=227 * 1024, registers_per_sm=65536,
        max_registers_per_thread=255, max_threads_per_sm=2048, peak_tflops=989.0, hbm_gbps=4000.0,
        nvlink_gbps=360.0, copy_gbps_per_program=40.0, launch_us=4.0, exchange_us=40.0, release_us=2.0,
        tile_fixed_us=2.0, dispatch_overlap=0.5, grouped_mm_efficiency=0.64, roofline_p=1.6, tma_speedup=1.0,
        reduce_tail=0.5,
    )


def save_constants(hw: HardwareConstants, path: str | Path) -> None:
    Path(path).write_text(json.dumps(dataclasses.asdict(hw), indent=2, sort_keys=True) + "\n")


# Constants of code that is gone, which files saved before its removal still hold: dropped on load.
# (the recomputing backward: its one-pass dH efficiency and its dH tiles' keys in gemm_efficiency;
# the staged and pre-summed combine: the share of their sends hidden behind the fc2 tiles)
_RETIRED_FIELDS = ("one_pass_dh_efficiency", "combine_overlap")
_RETIRED_TILE_KERNELS = ("dh_recompute",)


def load_constants(path: str | Path) -> HardwareConstants:
    """Constants stored by ``save_constants`` (the calibration's output);
    fields it lacks take the uncalibrated defaults of its GPU name (a file
    from before ``grouped_mm_efficiency_by_rows``: an empty table, so its
    one ``grouped_mm_efficiency`` as before); the constants of removed code
    paths that older files hold (``_RETIRED_FIELDS``, ``gemm_efficiency``
    keys of ``_RETIRED_TILE_KERNELS``) are dropped."""
    data = json.loads(Path(path).read_text())
    for name in _RETIRED_FIELDS:
        data.pop(name, None)
    if isinstance(data.get("gemm_efficiency"), dict):
        data["gemm_efficiency"] = {key: eff for key, eff in data["gemm_efficiency"].items()
                                   if key.split(":", 1)[0] not in _RETIRED_TILE_KERNELS}
    names = {f.name for f in dataclasses.fields(HardwareConstants)}
    unknown = set(data) - names
    if unknown:
        raise ValueError(f"{path}: unknown hardware constants {sorted(unknown)} (expected {sorted(names)})")
    base = dataclasses.asdict(default_constants(data.get("name", "NVIDIA H200")))
    base.update(data)
    hw = HardwareConstants(**base)
    if hw.grouped_mm_efficiency_by_rows:
        try:
            _rows_table(hw.grouped_mm_efficiency_by_rows)
        except ValueError as err:
            raise ValueError(f"{path}: {err}") from None
    return hw


