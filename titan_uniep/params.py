"""One parameter object for a UniEP MoE layer, forward and backward.

``LayerParams`` holds every knob the kernels and their host launches read,
one field each, grouped by the stage that reads it (the stage names are the
kernels': ``dispatch_fc1``, ``fc2_combine``, ``dispatch_dh``, ``da_combine``,
``wgrad``). It is passed per call (``params=``) and a workspace stores one as
its default; nothing reads a module-global mutable table.

Tuned defaults live in ``DEFAULTS``, keyed by EP size and shape class
(``shape_class``: by the expert hidden dim, which sets how long the expert
GEMMs' K-loops are against the bytes each row moves); ``default_params``
returns the entry for a shape. Why each default is what it is, with the
measurements: ``docs/design.md``, "Decisions".

Each field is declared once, by ``knob``: its default, its kind for the
tuner (schedule, numerics, mixed, fixed), the values a search may take, the
stage whose kernel reads it and the checks of its value;
``titan_uniep.tuning.space.FIELDS`` reads them (with the evidence for each
kind) and ``__post_init__`` runs the checks. In short, every
field is a *schedule* choice (when a task runs, which program runs it, how a
tile is loaded) except the GEMMs' K steps (``*_block_k``), which set the fp32
summation order of the partial products, the dH tile width ``dh_block_n``
(the router-score gradient sums one partial per dH column block),
``reduce_block_dim`` below 256 (da_combine's score-gradient steps) and
``wgrad_backend``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Literal

__all__ = [
    "apply_overrides",
    "DEFAULTS",
    "LayerParams",
    "SHAPE_CLASSES",
    "WGRAD_BACKENDS",
    "default_params",
    "interpreter_params",
    "shape_class",
]

WGRAD_BACKENDS = ("auto", "grouped_mm", "triton")
SHAPE_CLASSES = ("short", "medium", "long")

Kind = Literal["schedule", "numerics", "mixed", "fixed"]

# The values a search may give a field (the valid range, small tiles included for interpreter shapes).
TILES = (16, 32, 64, 128, 256)
K_STEPS = (16, 32, 64, 128)
WARPS = (4, 8)
STAGES = (2, 3, 4)
BOOL = (False, True)
REGS = (None, 128, 168, 232)


@dataclass(frozen=True)
class Check:
    """A condition a field's value must meet (None always passes), and how it reads in an error."""

    holds: Callable[[Any], bool]
    says: str


POWER_OF_TWO = Check(lambda v: v >= 1 and not v & (v - 1), "a power of two")
DOT_OPERAND = Check(lambda v: v >= 16, ">= 16 (tl.dot)")
AT_LEAST_ONE = Check(lambda v: v >= 1, ">= 1")
NON_NEGATIVE = Check(lambda v: v >= 0, ">= 0")
POSITIVE = Check(lambda v: v > 0, "> 0")
FRACTION = Check(lambda v: 0.0 <= v <= 1.0, "in [0, 1]")
KEPT_FRACTION = Check(lambda v: 0.0 < v <= 1.0, "in (0, 1]")
BACKEND = Check(lambda v: v in WGRAD_BACKENDS, f"one of {WGRAD_BACKENDS}")


def knob(default: Any, kind: Kind, values: tuple, stage: str, *, order_key: Callable[[Any], Any] | None = None,
         checks: tuple[Check, ...] = ()) -> Any:
    """A ``LayerParams`` field and all that is known of it, in one place: its
    ``default``; its ``kind`` for the tuner (``tuning.space``: ``"schedule"``
    keeps every bit, ``"numerics"`` may change them, ``"mixed"`` keeps them
    while ``order_key(value)`` stays, ``"fixed"`` is never searched); the
    ``values`` a search may take; the ``stage`` whose kernel reads it; the
    ``checks`` its value must pass (``LayerParams.__post_init__``)."""
    return dataclasses.field(default=default, metadata=dict(kind=kind, values=values, stage=stage,
                                                            order_key=order_key, checks=checks))


@dataclass(frozen=True)
class LayerParams:
    # ---- grid and layout (every kernel) ----
    block_m: int = knob(128, "schedule", TILES, "all", checks=(POWER_OF_TWO, DOT_OPERAND))
    """Receive slots per GEMM tile, and the granularity of the per-tile arrival counters (power of two, >= 16; the workspace is sized with it)."""
    # sample(): also explicit grids below the SM count
    num_programs: int | None = knob(None, "schedule", (None,), "all")
    """Persistent programs per launch; None: one per SM (at most the SMs: every spin-wait needs the whole grid resident)."""
    group_m: int = knob(8, "schedule", (1, 2, 4, 8, 16), "all", checks=(POWER_OF_TWO,))
    """Row tiles walked together before the next column block, for L2 reuse (power of two)."""

    # ---- dispatch (dispatch_fc1 and dispatch_dh) ----
    dispatch_programs: int = knob(16, "schedule", (1, 2, 4, 8, 16, 32, 64, 1024), "dispatch", checks=(AT_LEAST_ONE,))
    """Programs that run dispatch tasks before taking GEMM tiles (>= 1; >= the grid: every program dispatches first)."""
    dispatch_block_tokens: int = knob(16, "schedule", (1, 2, 4, 8, 16, 32, 64), "dispatch", checks=(POWER_OF_TWO,))
    """Tokens per dispatch task (power of two)."""
    dispatch_block_dim: int = knob(512, "schedule", (16, 32, 64, 128, 256, 512, 1024), "dispatch",
                                   checks=(POWER_OF_TWO,))
    """Columns a dispatch task copies per step (power of two)."""
    local_first: bool = knob(False, "schedule", BOOL, "dispatch")
    """Every program first copies the rows that stay on its rank, and tiles holding only those run first."""
    local_first_experts: float = knob(0.25, "schedule", (0.0, 0.25, 0.5, 1.0), "dispatch", checks=(FRACTION,))
    """With ``local_first``: the fraction of local experts, in [0, 1], whose own-rows tiles are moved ahead."""

    # ---- fc1 tiles (dispatch_fc1) ----
    fc1_block_n: int = knob(128, "schedule", TILES, "fc1", checks=(POWER_OF_TWO, DOT_OPERAND))
    """Columns of h per fc1 tile (two accumulators, w1 and w3; power of two, >= 16)."""
    fc1_block_k: int = knob(64, "numerics", K_STEPS, "fc1", checks=(POWER_OF_TWO, DOT_OPERAND))
    """K step of fc1 (power of two, >= 16; sets the summation order)."""
    fc1_num_warps: int = knob(8, "schedule", WARPS, "fc1", checks=(AT_LEAST_ONE,))
    """Warps per dispatch_fc1 program."""
    fc1_num_stages: int = knob(3, "schedule", STAGES, "fc1", checks=(NON_NEGATIVE,))
    """Software-pipelining depth of fc1's K-loop (>= 0; with scores before the experts, 1 always: ``kernels.dispatch_fc1.fc1_launch_stages``)."""
    fc1_one_dot: bool = knob(False, "schedule", BOOL, "fc1")
    """fc1 computes h1 and h3 in one ``block_m x 2 fc1_block_n`` product per K step over interleaved w1 | w3 columns, not two ``block_m x fc1_block_n`` ones (scores after the experts; with scores before, the two-product tile always: there the two give other bits on an H200)."""

    # ---- fc2 tiles (fc2_combine) ----
    fc2_block_n: int = knob(256, "schedule", TILES, "fc2", checks=(POWER_OF_TWO, DOT_OPERAND))
    """Columns of y per fc2 tile (power of two, >= 16)."""
    fc2_block_k: int = knob(64, "numerics", K_STEPS, "fc2", checks=(POWER_OF_TWO, DOT_OPERAND))
    """K step of fc2 (power of two, >= 16; sets the summation order)."""
    fc2_num_warps: int = knob(8, "schedule", WARPS, "fc2", checks=(AT_LEAST_ONE,))
    """Warps per fc2_combine program."""
    fc2_num_stages: int = knob(3, "schedule", STAGES, "fc2", checks=(NON_NEGATIVE,))
    """Software-pipelining depth of fc2's K-loop (>= 0)."""
    fc2_programs_per_sm: int = knob(1, "schedule", (1, 2), "fc2", checks=(AT_LEAST_ONE,))
    """fc2_combine programs per SM (GPU), so one program's epilogue overlaps another's K-loop (the tile must fit)."""
    fc2_max_registers: int | None = knob(None, "schedule", REGS, "fc2")
    """Register cap per thread of fc2_combine (Triton ``maxnreg``); None: the compiler's choice."""
    fc2_tma: bool = knob(False, "schedule", BOOL, "fc2")
    """fc2 reads h and w2 through tensor descriptors made on the device (16-bit data on a GPU)."""
    fc2_defer_release: bool = knob(False, "schedule", BOOL, "fc2")
    """Release a tile's row arrivals after the program's next tile, not right after its stores."""
    fc2_flat_loop: bool = knob(False, "schedule", BOOL, "fc2")
    """fc2 tiles dealt to the programs in turn (no claims) in one loop that Triton flattens and software-pipelines across tiles (GPU)."""

    # ---- reduce (fc2_combine and da_combine) ----
    reduce_block_tokens: int = knob(16, "schedule", (1, 2, 4, 8, 16, 32, 64), "reduce", checks=(POWER_OF_TWO,))
    """Tokens per reduce task (power of two)."""
    reduce_block_dim: int = knob(512, "mixed", (16, 32, 64, 128, 256, 512, 1024), "reduce",
                                 order_key=lambda v: min(v, 256), checks=(POWER_OF_TWO,))
    """Columns a reduce task sums per step (power of two; da_combine takes at most 256 with scores before the experts)."""

    # ---- dH tiles (dispatch_dh) ----
    dh_block_n: int = knob(128, "numerics", TILES, "dh", checks=(POWER_OF_TWO, DOT_OPERAND))
    """Columns of H per dH tile (power of two, >= 16)."""
    dh_block_k: int = knob(64, "numerics", K_STEPS, "dh", checks=(POWER_OF_TWO, DOT_OPERAND))
    """K step of the dH tile's loops over D (power of two, >= 16; sets the summation order)."""
    dh_num_warps: int = knob(8, "schedule", WARPS, "dh", checks=(AT_LEAST_ONE,))
    """Warps per dispatch_dh program."""
    dh_num_stages: int = knob(3, "schedule", STAGES, "dh", checks=(AT_LEAST_ONE,))
    """Software-pipelining depth of the dH K-loops (>= 1)."""
    dh_programs_per_sm: int = knob(2, "schedule", (1, 2), "dh", checks=(AT_LEAST_ONE,))
    """dispatch_dh programs per SM (GPU; run under a register cap that fits them)."""
    dh_copies_rows: bool = knob(True, "schedule", BOOL, "dh")
    """dH tasks also copy each slot's x and dOut rows for the weight gradients (else a gather launch)."""

    # ---- dA tiles (da_combine) ----
    # 256: other bits on an H200 (docs/design.md)
    da_block_n: int = knob(128, "schedule", TILES[:-1], "da", checks=(POWER_OF_TWO, DOT_OPERAND))
    """Columns of D per dA tile (power of two, >= 16)."""
    da_block_k: int = knob(64, "numerics", K_STEPS, "da", checks=(POWER_OF_TWO, DOT_OPERAND))
    """K step of the dA loop over H (power of two, >= 16; sets the summation order)."""
    da_num_warps: int = knob(8, "schedule", WARPS, "da", checks=(AT_LEAST_ONE,))
    """Warps per da_combine program."""
    da_num_stages: int = knob(3, "schedule", STAGES, "da", checks=(AT_LEAST_ONE,))
    """Software-pipelining depth of the dA K-loop (>= 1)."""
    da_programs_per_sm: int = knob(1, "schedule", (1, 2), "da", checks=(AT_LEAST_ONE,))
    """da_combine programs per SM (GPU)."""
    da_max_registers: int | None = knob(None, "schedule", REGS, "da")
    """Register cap per thread of da_combine (``maxnreg``); None: the compiler's choice."""
    da_tma: bool = knob(True, "schedule", BOOL, "da")
    """dA reads dh1 | dh3 and w1 | w3 through tensor descriptors (16-bit data on a GPU, H a multiple of da_block_k)."""

    # ---- weight gradients (wgrad) ----
    wgrad_backend: Literal["auto", "grouped_mm", "triton"] = knob("auto", "numerics", WGRAD_BACKENDS, "wgrad",
                                                                  checks=(BACKEND,))
    """Who computes dW from the dense slot rows: torch._grouped_mm, the Triton kernel, or "auto" (the first where it runs)."""
    wgrad_w13_block_m: int = knob(128, "schedule", TILES, "wgrad", checks=(POWER_OF_TWO, DOT_OPERAND))
    """Triton dW1 | dW3 tile rows (of H)."""
    wgrad_w13_block_n: int = knob(128, "schedule", TILES, "wgrad", checks=(POWER_OF_TWO, DOT_OPERAND))
    """Triton dW1 | dW3 tile columns (of D)."""
    wgrad_w13_block_k: int = knob(64, "numerics", K_STEPS, "wgrad", checks=(POWER_OF_TWO, DOT_OPERAND))
    """Triton dW1 | dW3 K step over slots (sets the summation order)."""
    wgrad_w13_num_warps: int = knob(8, "schedule", WARPS, "wgrad", checks=(AT_LEAST_ONE,))
    """Warps of the Triton dW1 | dW3 kernel."""
    wgrad_w13_num_stages: int = knob(4, "schedule", (2, 3, 4, 5), "wgrad", checks=(AT_LEAST_ONE,))
    """Pipelining depth of the Triton dW1 | dW3 kernel."""
    wgrad_w2_block_m: int = knob(128, "schedule", TILES, "wgrad", checks=(POWER_OF_TWO, DOT_OPERAND))
    """Triton dW2 tile rows (of D)."""
    wgrad_w2_block_n: int = knob(256, "schedule", TILES, "wgrad", checks=(POWER_OF_TWO, DOT_OPERAND))
    """Triton dW2 tile columns (of H)."""
    wgrad_w2_block_k: int = knob(64, "numerics", K_STEPS, "wgrad", checks=(POWER_OF_TWO, DOT_OPERAND))
    """Triton dW2 K step over slots (sets the summation order)."""
    wgrad_w2_num_warps: int = knob(8, "schedule", WARPS, "wgrad", checks=(AT_LEAST_ONE,))
    """Warps of the Triton dW2 kernel."""
    wgrad_w2_num_stages: int = knob(3, "schedule", (2, 3, 4, 5), "wgrad", checks=(AT_LEAST_ONE,))
    """Pipelining depth of the Triton dW2 kernel."""

    # ---- waits and testing hooks (every kernel) ----
    timeout_s: float = knob(30.0, "fixed", (30.0,), "all", checks=(POSITIVE,))
    """Bound of every GPU spin-wait, in seconds (> 0); a wait that runs out fails the call with an error naming it."""
    interpreter_max_spins: int = knob(10_000, "fixed", (10_000,), "all", checks=(AT_LEAST_ONE,))
    """Bound of every spin-wait under TRITON_INTERPRET=1, in polls (producers run first there, so any spin is a bug)."""
    debug_silent_rank: int = knob(-1, "fixed", (-1,), "all")
    """Testing only: this rank runs no dispatch tasks (sends nothing), to prove a missing peer ends in a clear error."""
    debug_race: bool = knob(False, "fixed", (False,), "all")
    """Testing only: race mode (kernels.scoreboard; Workspace.race_report), for a workspace built with it."""
    debug_race_keep: float = knob(0.9, "fixed", (0.9,), "all", checks=(KEPT_FRACTION,))
    """Testing only, race mode: the fraction of rows, in (0, 1], each producer delivers."""
    debug_race_seed: int = knob(0, "fixed", (0,), "all", checks=(NON_NEGATIVE,))
    """Testing only, race mode: the seed of which rows are delivered (>= 0)."""
    debug_wait_slack: int = knob(0, "fixed", (0,), "all", checks=(NON_NEGATIVE,))
    """Testing only: every tile-rows and token-rows wait target is lowered by this many arrivals (>= 0): a race on a GPU, which race mode must catch."""
    debug_epoch_store_delay_us: int = knob(0, "fixed", (0,), "all", checks=(NON_NEGATIVE,))
    """Testing only (GPU): the counts exchange's collecting program stores the call's epoch this many microseconds late in its first warp (>= 0), so its other warps run ahead of the store."""

    def replace(self, **changes) -> "LayerParams":
        return dataclasses.replace(self, **changes)

    def __post_init__(self) -> None:
        for spec in dataclasses.fields(self):
            value = getattr(self, spec.name)
            for check in spec.metadata["checks"]:
                if value is not None and not check.holds(value):
                    shown = repr(value) if isinstance(value, str) else value
                    raise ValueError(f"LayerParams.{spec.name} must be {check.says}, got {shown}")


_undeclared = [spec.name for spec in dataclasses.fields(LayerParams) if "kind" not in spec.metadata]
if _undeclared:  # a field without its kind, values and stage would be invisible to the tuner
    raise RuntimeError(f"LayerParams fields {_undeclared} are not declared with knob(...)")


def shape_class(hidden: int) -> str:
    """The defaults table's class of a layer, by its expert hidden dim ``H``:
    ``"short"`` (H <= 1024), ``"medium"`` (H <= 2048) or ``"long"``."""
    if hidden <= 1024:
        return "short"
    return "medium" if hidden <= 2048 else "long"


# GEMM + combine kernels at two programs per SM, for expert GEMMs with a short K.
_SHORT_DA = dict(da_block_k=32, da_num_warps=4, da_programs_per_sm=2)
_SHORT_FC2 = dict(fc2_block_n=128, fc2_num_warps=4, fc2_programs_per_sm=2)
# Every program dispatches first (>= any grid).
_DISPATCH_FIRST = dict(dispatch_programs=1024)
# The one-product fc1 tile (measured at EP = 1 on five shapes: docs/design.md).
_FC1 = dict(fc1_one_dot=True)

# Tuned on 2 x H200 (NV18); other EP sizes take the closest smaller tuned
# size's entry (the smallest's below it). docs/design.md says why.
DEFAULTS: dict[tuple[int, str], LayerParams] = {
    (2, "short"): LayerParams(**_DISPATCH_FIRST, **_SHORT_FC2, **_SHORT_DA, **_FC1),
    (2, "medium"): LayerParams(**_SHORT_DA, **_FC1),
    (2, "long"): LayerParams(**_FC1),
}


def default_params(ep_size: int, *, hidden: int) -> LayerParams:
    """The tuned defaults of a layer with expert hidden dim ``hidden`` at EP
    size ``ep_size`` (``DEFAULTS``)."""
    if ep_size < 1:
        raise ValueError(f"ep_size must be >= 1, got {ep_size}")
    sizes = sorted({size for size, _ in DEFAULTS})
    known = [size for size in sizes if size <= ep_size]
    return DEFAULTS[(known[-1] if known else sizes[0], shape_class(hidden))]


def interpreter_params(**changes) -> LayerParams:
    """Small tiles for the CPU interpreter (tiny test shapes, fast to run)."""
    small = LayerParams(
        block_m=16, num_programs=2, group_m=2, dispatch_programs=1, dispatch_block_tokens=4, dispatch_block_dim=16,
        fc1_block_n=16, fc1_block_k=16, fc1_num_warps=4, fc1_num_stages=1,
        fc2_block_n=16, fc2_block_k=16, fc2_num_warps=4, fc2_num_stages=1,
        reduce_block_tokens=4, reduce_block_dim=16,
        dh_block_n=16, dh_block_k=16, dh_num_warps=4, dh_num_stages=1, dh_programs_per_sm=1,
        da_block_n=16, da_block_k=16, da_num_warps=4, da_num_stages=1, da_programs_per_sm=1, da_tma=False,
        wgrad_w13_block_m=16, wgrad_w13_block_n=16, wgrad_w13_block_k=16, wgrad_w13_num_warps=4,
        wgrad_w13_num_stages=1, wgrad_w2_block_m=16, wgrad_w2_block_n=16, wgrad_w2_block_k=16,
        wgrad_w2_num_warps=4, wgrad_w2_num_stages=1,
    )
    return small.replace(**changes)


def apply_overrides(params: LayerParams, overrides: list[str]) -> LayerParams:
    """``params`` with ``FIELD=VALUE`` overrides (command lines): values parsed
    as the field's type (``none`` for None, ``true``/``false`` for bools)."""
    fields = {f.name: f for f in dataclasses.fields(LayerParams)}
    changes = {}
    for item in overrides:
        name, sep, text = item.partition("=")
        if not sep or name not in fields:
            raise ValueError(f"override {item!r}: expected FIELD=VALUE with FIELD one of {sorted(fields)}")
        current = getattr(params, name)
        if text.lower() == "none":
            value = None
        elif isinstance(current, bool):
            if text.lower() not in ("true", "false", "1", "0"):
                raise ValueError(f"override {item!r}: {name} takes true or false")
            value = text.lower() in ("true", "1")
        elif isinstance(current, int) or (current is None and fields[name].type.startswith("int")):
            value = int(text)
        elif isinstance(current, float):
            value = float(text)
        else:
            value = text
        changes[name] = value
    return params.replace(**changes)
