"""Tuning knobs of the UniEP forward megakernels, with the defaults per EP size.

One table, keyed by EP size, in the spirit of DeepEP's ``Buffer`` configs; a
``KernelConfig`` passed per call overrides it. The GEMM tile shape is the one
that reached ``torch._grouped_mm`` speed on one H200 (DESIGN.md: BM=128,
BN=256, BK=64, 8 warps, 3-4 stages). fc1 keeps two accumulators (w1 and w3)
of ``block_n_fc1`` columns each, so its tile is 128 x (2 x 128) as well.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

COMBINES = ("direct", "staged", "presum")

__all__ = ["COMBINES", "KernelConfig", "DEFAULT_CONFIGS", "default_config", "interpreter_config"]


@dataclass(frozen=True)
class KernelConfig:
    num_comm_sms: int = 16
    """Programs of megakernel A that run dispatch tasks before joining the GEMM
    tasks; the others start on GEMM tiles at once and wait for their rows.
    A value >= the grid lets every program dispatch first. Measured on
    2 x H200 (docs/performance.md): in run 2 (host-bound layout) qwen3-like
    was best at 16-32; since the layout moved to the device (runs 4, 5) it is
    best with every program dispatching first (6% faster), which
    ``default_config(ep, hidden=H)`` picks for H <= 1024; deepseek- and
    mixtral-like are best at 16."""

    local_first: bool = False
    """Megakernel A (and the backward's BA): every program first copies the
    rows that stay on its own rank (no NVLink), then the first
    ``num_comm_sms`` programs send the others while the rest take GEMM tiles,
    those holding only the rank's own rows first (``Workspace.tile_order``).
    Inside an expert, rows are ordered by source rank, so about 1/W of the
    tiles need no peer's rows and can run while the peers' rows are in
    flight. A schedule choice: rows land where they always do, the same bits.
    Needs ``num_comm_sms`` below the grid to overlap anything. Measured on
    2 x H200, qwen3-like (docs/performance.md, run 15): megakernel A -0.026 ms,
    BA -0.06 ms, but the layer's forward and backward times unchanged (BB
    slower by what BA gained), hence off."""

    local_first_experts: float = 0.25
    """``local_first``: the fraction of the local experts whose own-rows tiles
    go first (the rest keep expert order). Tiles moved ahead read their
    expert's weights once more, so only as many as cover the peers' dispatch
    time: on one H200 (simulated EP = 2, qwen3-like) all of them (1.0) cost
    megakernel A's fc1 0.075 ms (5%) through the lost weight reuse
    (docs/performance.md, forward run 9)."""

    num_programs: int | None = None
    """Persistent programs per launch; ``None``: one per SM. Every spin-wait
    relies on the whole grid being resident, so never more than the SMs."""

    block_m: int = 128
    """Rows (receive-buffer slots) per GEMM tile; also the granularity of the
    per-tile arrival counters, so the workspace is sized with it."""

    block_n_fc1: int = 128
    """Columns of h per fc1 tile (two accumulators: x @ w1^T and x @ w3^T)."""

    block_n_fc2: int = 256
    """Columns of y per fc2 tile."""

    block_k: int = 64
    """Reduction slice per pipeline stage, both GEMMs."""

    group_m: int = 8
    """Row tiles walked together before moving to the next column block
    (L2 reuse of the gathered rows, as in Triton's matmul tutorial)."""

    num_warps: int = 8
    num_stages: int = 3

    fc2_programs_per_sm: int = 1
    """Programs of megakernel B per SM. With 2, one program's fc2 epilogue
    (remote row stores, then a system-scope release that waits for them) can
    overlap the other's K-loop; it needs a tile that lets two fit an SM
    (``block_n_fc2 = 128``: 96 KB of shared memory at 3 stages; the compile
    test checks that the shipped choice fits). B's waits are on fc2 tasks,
    which running programs claim in order before any of them takes a reduce
    task, so programs that are not resident yet cannot hold up a wait."""

    fc2_num_warps: int | None = None
    """Warps of megakernel B; ``None``: ``num_warps``."""

    fc2_num_stages: int | None = None
    """Software-pipelining depth of megakernel B's fc2 loop; ``None``: ``num_stages``."""

    fc2_tma: bool = False
    """Megakernel B reads fc2's operands (h and w2, both dense) through tensor
    descriptors made on the device (TMA) where they can serve: 16-bit data on
    a GPU, rows a multiple of 16 bytes. The same values, so the same bits.
    Measured on 2 x H200 (docs/performance.md, backward run 13): qwen3-like
    forward 1.60 against 1.57 ms with pointer loads, mixtral-like slower too,
    hence off (the backward's dA uses descriptors: there they are faster)."""

    fc2_max_registers: int | None = None
    """Register cap per thread of megakernel B (Triton's ``maxnreg``), e.g. 128
    so that two 8-warp programs fit an SM; ``None``: the compiler's choice."""

    combine: str = "direct"
    """How fc2 rows go back to their source ranks. ``"direct"``: the fc2 tile
    stores them into the sources' buffers itself. ``"staged"``: the tile is
    written locally (workspace buffer ``y``, ``S * D`` elements more) and
    separate send tasks move it, so GEMM programs never stall on NVLink.
    Measured equal or slower on 2 x H200 (docs/performance.md), hence off.
    ``"presum"``: the tile is written locally (``y``) and presum tasks on the
    expert rank sum each token's rows of this rank in fp32 in k order (with
    the router score, scores after the experts), then send ONE fp32 partial
    per (token, expert rank) to the source, whose reduce sums the partials in
    rank order. ``K / W``-fold fewer combine rows over NVLink (fp32: half the
    bytes of ``direct`` at K = 8, W = 2) and one release per (token, rank).
    It rounds differently from ``direct``/``staged`` (per-rank fp32 partial
    sums), so it is bitwise equal across schedules, not to the other modes.
    Needs a workspace built with it (``y`` plus the ``partials``,
    ``token_slots`` and ``token_tiles`` arena buffers). Measured on 2 x H200
    (docs/performance.md, run 5): correct (bitwise across schedules) but
    slower everywhere (qwen3-like 2.84 against 1.75 ms), hence off."""

    defer_release: bool = False
    """Direct combine: release a tile's row arrivals (system scope) only after
    the program has computed its next fc2 tile, instead of right after the
    tile's remote stores, so the release finds the stores landed and does not
    stall the SM. Changes when the reduce may start, never a value. Measured
    on 2 x H200 (docs/performance.md, run 4): qwen3-like 1% faster,
    deepseek-like 4% and mixtral-like 1% slower (the reduce starts one tile
    later), hence off."""

    num_combine_sms: int = 16
    """Programs of megakernel B that only send (staged combine) before joining
    the reduce tasks."""

    comm_block_tokens: int = 16
    """Tokens per dispatch task (one task copies their rows to every rank
    they route to, then signals the tiles of their copies)."""

    comm_block_dim: int = 512
    """Columns moved per step of a dispatch task."""

    reduce_block_tokens: int = 16
    """Tokens per combine-reduce task."""

    reduce_block_dim: int = 512
    """Columns summed per step of a combine-reduce task (forward B and
    backward BB). 16 x 512 (or 32 x 256) elements per step were 20-30% faster
    than 16 x 256 and than 16K-element steps on one H200 (simulated EP = 2,
    sequential reduce launch of both ranks: qwen3-like 0.215 -> 0.173 ms,
    deepseek-like at T = 2048 0.269 -> 0.186, mixtral-like 0.072 -> 0.063,
    backward BB -0.05 ms; docs/performance.md, forward run 8). Only the
    column chunking changes: the same sums, the same bits."""

    timeout_s: float = 30.0
    """Bound of every spin-wait on the GPU (globaltimer). A wait that runs out
    writes an error record and the host raises RuntimeError. The counts
    exchange also waits here for peers that are still on the host (e.g.
    compiling kernels on the first step), hence tens of seconds."""

    interpreter_max_spins: int = 10_000
    """Bound of every spin-wait under TRITON_INTERPRET=1, in polls. Programs run
    one after another there and producers always come first, so a wait that
    has to spin at all is already a bug."""

    debug_silent_rank: int = -1
    """Testing only: this rank runs no dispatch tasks (sends no rows and
    signals nothing), to prove that a missing peer ends in a clear error."""

    def replace(self, **changes) -> "KernelConfig":
        return dataclasses.replace(self, **changes)

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n_fc1", "block_n_fc2", "block_k", "comm_block_tokens",
                     "comm_block_dim", "reduce_block_tokens", "reduce_block_dim", "group_m"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"KernelConfig.{name} must be a power of two, got {value}")
        for name in ("block_m", "block_n_fc1", "block_n_fc2", "block_k"):
            if getattr(self, name) < 16:
                raise ValueError(f"KernelConfig.{name} must be >= 16 (tl.dot), got {getattr(self, name)}")
        if self.combine not in COMBINES:
            raise ValueError(f"KernelConfig.combine must be one of {COMBINES}, got {self.combine!r}")
        if self.combine == "presum" and self.reduce_block_tokens > self.block_m:
            raise ValueError(
                f"KernelConfig.reduce_block_tokens ({self.reduce_block_tokens}) must be <= block_m ({self.block_m}) "
                "with combine='presum' (its tasks split a tile's rows into blocks of that many)"
            )
        if not 0.0 <= self.local_first_experts <= 1.0:
            raise ValueError(f"KernelConfig.local_first_experts must be in [0, 1], got {self.local_first_experts}")
        if self.fc2_programs_per_sm < 1:
            raise ValueError(f"KernelConfig.fc2_programs_per_sm must be >= 1, got {self.fc2_programs_per_sm}")
        if self.num_combine_sms < 1:
            raise ValueError(f"KernelConfig.num_combine_sms must be >= 1, got {self.num_combine_sms}")
        if self.num_comm_sms < 1:
            raise ValueError(f"KernelConfig.num_comm_sms must be >= 1, got {self.num_comm_sms}")
        if self.num_programs is not None and self.num_programs <= max(self.num_comm_sms, self.num_combine_sms):
            raise ValueError(
                f"KernelConfig.num_programs ({self.num_programs}) must exceed num_comm_sms ({self.num_comm_sms}) "
                f"and num_combine_sms ({self.num_combine_sms})"
            )


# Tuned on 2 x H200 (NV18). Other EP sizes start from the same point.
DEFAULT_CONFIGS: dict[int, KernelConfig] = {
    2: KernelConfig(),
}


# Shapes whose expert GEMMs are small per dispatched byte (expert hidden dim up
# to this) run best with every program dispatching first (num_comm_sms >= the
# grid; a runtime knob, no bits change). Measured on 2 x H200, direct combine
# (docs/performance.md, runs 4 and 5): qwen3-like (H = 768) 1.622 vs 1.738 and 1.649 vs 1.746 ms;
# deepseek-like (H = 2048) 4% and mixtral-like (H = 14336) 3-16% slower, so
# they keep the EP-size default.
DISPATCH_FIRST_MAX_HIDDEN = 1024
DISPATCH_FIRST_COMM_SMS = 1024  # >= any grid: every program dispatches first
# The same shapes run megakernel B as two 4-warp programs per SM with 128-column
# fc2 tiles: fc2's K (= H) is short, so a tile's epilogue (remote row stores
# and the system-scope release that waits for them) is a large part of it,
# and the second program's K-loop hides it. Measured on 2 x H200
# (docs/performance.md, forward run 7): qwen3-like B 0.695 -> 0.631 ms, the
# layer 1.660 -> 1.601 ms; deepseek- and mixtral-like B slower in the same
# probe (2.39 -> 2.51, 2.73 -> 3.25 ms, measured second on a hotter GPU).
SHORT_FC2 = dict(block_n_fc2=128, fc2_num_warps=4, fc2_programs_per_sm=2)


def default_config(ep_size: int, *, hidden: int | None = None) -> KernelConfig:
    """The tuned defaults for ``ep_size``; the closest smaller tuned size
    otherwise. ``hidden`` (the expert hidden dim), when given, applies the
    per-shape choice above (``fused.moe_forward`` does so when called without
    a config on a workspace that has the EP-size default)."""
    known = [w for w in sorted(DEFAULT_CONFIGS) if w <= ep_size]
    config = DEFAULT_CONFIGS[known[-1] if known else min(DEFAULT_CONFIGS)]
    if hidden is not None and hidden <= DISPATCH_FIRST_MAX_HIDDEN:
        config = config.replace(num_comm_sms=max(config.num_comm_sms, DISPATCH_FIRST_COMM_SMS), **SHORT_FC2)
    return config


def interpreter_config(**changes) -> KernelConfig:
    """Small tiles for the CPU interpreter (tiny test shapes, fast to run)."""
    base = KernelConfig(
        num_comm_sms=1, num_combine_sms=1, num_programs=2, block_m=16, block_n_fc1=16, block_n_fc2=16, block_k=16,
        group_m=2, num_warps=4, num_stages=1, comm_block_tokens=4, comm_block_dim=16,
        reduce_block_tokens=4, reduce_block_dim=16,
    )
    return base.replace(**changes)
