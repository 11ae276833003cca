"""The tuning space of one UniEP layer: every ``LayerParams`` field, what a
change of it may do to the bits, the values a search tries, and the
constraints between fields on a given GPU.

``FIELDS`` collects, from each field's one declaration (``params.knob``),
which fields are *schedule* fields (when a task runs, which program runs it,
how an operand is loaded: a change never changes a bit of any output or
gradient) and which are *numerics* fields (they set an fp32 summation order:
another value gives other, equally deterministic bits). A search walks schedule fields only, unless its caller
opts in to numerics fields (``numerics=True``), so a cached or searched
point never changes a training run's loss curve.

Kinds (``FIELDS[name].kind``):

- ``"schedule"``: any value keeps the bits;
- ``"numerics"``: another value may change bits: the GEMMs' K steps
  (``*_block_k``), the dH tile width ``dh_block_n`` (the router-score
  gradient, scores after the experts, sums one fp32 partial per dH column
  block), ``wgrad_backend`` (``torch._grouped_mm`` or the Triton kernel);
- ``"mixed"``: some values keep the bits, others not; ``Field.order_key``
  maps a value to what sets the summation order, and a change keeps the
  bits iff the key stays: ``reduce_block_dim`` (da_combine's reduce takes
  ``min(reduce_block_dim, 256)`` columns a step with scores before the
  experts and sums ``<x, dA>`` per step);
- ``"fixed"``: waits and testing hooks, never searched.

Evidence for each kind: ``scripts/check_schedule_bits.py`` varies one field
at a time on tiny shapes (interpreter, fp32; or bf16 on a GPU) and reports
which outputs change; ``tests/test_tuning_space.py`` samples random schedule
points and compares every output and gradient with the default point's bits.
Both run the interpreter with a shape-independent ``tl.dot``
(``tests/interpreter_dot.py``; numpy's BLAS rounds by the tile shape, MMA
chains do not). On a GPU a ``tl.sum`` adds in the order of its tile's
layout, which follows the tile shape and the warps; the kernels' sums over
a tile's columns (the router-score gradients in da_combine) therefore add
in an order fixed by the column indices (``kernels.ordered_sums``), and the
GPU evidence is ``check_schedule_bits.py --device cuda --values all`` (every
value of every field on three shapes, both score modes; its table is in
``docs/design.md``, "Schedule and numerics fields") and the GPU property
test ``tests/gpu/test_gpu_schedule_bits.py`` (48 sampled points, bf16 and
fp16). The tuner also compares a point's every output with the default's
before caching it (``search.verify_entry``).

``LayerShape`` is a layer's shape as the tuner sees it; ``feasible`` is the
constraint check (shared memory and registers per program times programs per
SM, grid residency, divisibility), ``sample`` draws a random valid point,
``enumerate_points`` yields the grid the analytic model ranks.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from ..params import Kind, LayerParams, default_params
from .hardware import HardwareConstants, default_constants

__all__ = [
    "FIELDS",
    "Field",
    "LayerShape",
    "enumerate_points",
    "feasible",
    "fixed_fields",
    "keeps_bits",
    "numerics_fields",
    "repeats_another",
    "resources",
    "sample",
    "schedule_fields",
]

@dataclass(frozen=True)
class LayerShape:
    """One MoE layer as the tuner sees it: ``tokens`` per rank and call,
    ``dim`` D, expert ``hidden`` H, ``num_experts`` E (all ranks), ``top_k``
    K, EP size ``ep_size`` W, ``dtype_bytes`` per activation element (2 for
    bf16 / fp16, 4 for fp32), ``score_before_experts`` (the router score
    scales the expert input: fc1 then runs its two-product tile whatever
    ``fc1_one_dot`` says), ``weight_grad_bytes`` per element of the weight
    gradients the backward writes (None: the data's; 4 for the fp32 master
    weights of 16-bit data, ``compute_dtype.weight_grad_dtype``)."""

    tokens: int
    dim: int
    hidden: int
    num_experts: int
    top_k: int
    ep_size: int
    dtype_bytes: int = 2
    score_before_experts: bool = False
    weight_grad_bytes: int | None = None

    def __post_init__(self) -> None:
        for name in ("dim", "hidden", "num_experts", "top_k", "ep_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"LayerShape.{name} must be >= 1, got {getattr(self, name)}")
        if self.tokens < 0:
            raise ValueError(f"LayerShape.tokens must be >= 0, got {self.tokens}")
        if self.num_experts % self.ep_size:
            raise ValueError(f"LayerShape.num_experts ({self.num_experts}) must be divisible by ep_size "
                             f"({self.ep_size})")
        if self.dtype_bytes not in (2, 4):
            raise ValueError(f"LayerShape.dtype_bytes must be 2 or 4, got {self.dtype_bytes}")
        if self.weight_grad_bytes not in (None, 2, 4) or (self.weight_grad_bytes or 4) < self.dtype_bytes:
            raise ValueError(f"LayerShape.weight_grad_bytes must be None, or 2 or 4 and at least dtype_bytes "
                             f"({self.dtype_bytes}), got {self.weight_grad_bytes}")

    @property
    def grad_bytes(self) -> int:
        """Bytes per element of the weight gradients the backward writes."""
        return self.weight_grad_bytes or self.dtype_bytes

    def grouped_mm_weight_grads(self, backend: str) -> bool:
        """Whether the weight gradients run on ``torch._grouped_mm`` for
        ``LayerParams.wgrad_backend = backend`` (``runtime.backward.wgrad_backend``
        on a GPU that runs it): ``"auto"`` takes it for 16-bit data whose
        gradients are the data's dtype, the Triton kernel for fp32 gradients.
        (The run time takes it for bf16 only; the shape knows bytes, not the
        type, so fp16 data counts as bf16 here.)"""
        if backend == "auto":
            return self.dtype_bytes == 2 and self.grad_bytes == self.dtype_bytes
        return backend == "grouped_mm"

    @property
    def local_experts(self) -> int:
        return self.num_experts // self.ep_size

    def default_params(self) -> LayerParams:
        """The tuned defaults of this shape (``params.default_params``)."""
        return default_params(self.ep_size, hidden=self.hidden)


@dataclass(frozen=True)
class Field:
    """One ``LayerParams`` field in the space: its ``kind`` (module
    docstring), the ``values`` a random sample may take (the valid range,
    small tiles included for interpreter shapes), the stage whose kernel
    reads it, and for ``"mixed"`` fields the ``order_key`` (value -> what
    sets the summation order)."""

    kind: Kind
    values: tuple
    stage: str
    order_key: Callable[[Any], Any] | None = None


# Read from each field's ``params.knob`` (its one declaration).
FIELDS: dict[str, Field] = {
    spec.name: Field(spec.metadata["kind"], spec.metadata["values"], spec.metadata["stage"],
                     spec.metadata["order_key"])
    for spec in dataclasses.fields(LayerParams)
}


def schedule_fields() -> tuple[str, ...]:
    """Fields a search may change without changing a bit (``"mixed"`` ones
    included: for them only the values with the base's ``order_key``)."""
    return tuple(n for n, f in FIELDS.items() if f.kind in ("schedule", "mixed"))


def numerics_fields() -> tuple[str, ...]:
    """Fields whose other values may change bits (``"mixed"`` ones included)."""
    return tuple(n for n, f in FIELDS.items() if f.kind in ("numerics", "mixed"))


def fixed_fields() -> tuple[str, ...]:
    return tuple(n for n, f in FIELDS.items() if f.kind == "fixed")


def keeps_bits(params: LayerParams, base: LayerParams) -> str | None:
    """None when ``params`` must give ``base``'s bits (it differs from it in
    schedule fields only), else the first field that may change them."""
    for name, field in FIELDS.items():
        a, b = getattr(params, name), getattr(base, name)
        if a == b or field.kind == "schedule":
            continue
        if field.kind == "mixed" and field.order_key(a) == field.order_key(b):
            continue
        return name
    return None


# ---- resources and constraints ------------------------------------------------


@dataclass(frozen=True)
class Program:
    """What one program of a kernel asks of an SM (estimates from the tiles:
    the operand ring ``stages * (A tile + B tiles)`` in shared memory, the
    fp32 accumulators in registers)."""

    smem_bytes: int
    acc_registers: int  # fp32 accumulator registers per thread
    threads: int
    per_sm: int
    max_registers: int | None  # maxnreg of the launch (None: the compiler's choice)


# Registers per thread besides the accumulators, for a residency estimate of
# programs launched without a register cap (ptxas took fc2 at 128 x 128, 4
# warps to 218 and dA at 128 x 128 x 32, 4 warps to 238: 90-110 on top of 128).
REGISTER_OVERHEAD = 96
# The least a program needs besides its accumulators (addresses, loop state).
REGISTER_FLOOR = 32


def resources(params: LayerParams, shape: LayerShape) -> dict[str, Program]:
    """Per kernel (``dispatch_fc1``, ``fc2_combine``, ``dispatch_dh``,
    ``da_combine``, ``wgrad_w13``, ``wgrad_w2``): shared memory, accumulator
    registers and programs per SM of one program at ``params``."""
    p, b = params, shape.dtype_bytes

    def ring(stages: int, a: int, b_tiles: int) -> int:
        return max(stages, 1) * (a + b_tiles) * b

    def acc(tiles: int, bm: int, bn: int, warps: int) -> int:
        return tiles * bm * bn // (32 * warps)

    bm = p.block_m
    progs = {
        "dispatch_fc1": Program(ring(p.fc1_num_stages, bm * p.fc1_block_k, 2 * p.fc1_block_k * p.fc1_block_n),
                                acc(2, bm, p.fc1_block_n, p.fc1_num_warps), 32 * p.fc1_num_warps, 1, None),
        "fc2_combine": Program(ring(p.fc2_num_stages, bm * p.fc2_block_k, p.fc2_block_k * p.fc2_block_n),
                               acc(1, bm, p.fc2_block_n, p.fc2_num_warps), 32 * p.fc2_num_warps,
                               p.fc2_programs_per_sm, p.fc2_max_registers),
        "da_combine": Program(ring(p.da_num_stages, 2 * bm * p.da_block_k, 2 * p.da_block_k * p.da_block_n),
                              acc(1, bm, p.da_block_n, p.da_num_warps), 32 * p.da_num_warps,
                              p.da_programs_per_sm, p.da_max_registers),
    }
    # the dH tile: G = dOut @ w2 (dOut rows, w2), one accumulator; the register cap of runtime.backward
    dh_per_sm = p.dh_programs_per_sm
    dh_cap = 65536 // (32 * p.dh_num_warps * dh_per_sm) // 8 * 8 if dh_per_sm > 1 else None
    progs["dispatch_dh"] = Program(ring(p.dh_num_stages, bm * p.dh_block_k, p.dh_block_k * p.dh_block_n),
                                   acc(1, bm, p.dh_block_n, p.dh_num_warps), 32 * p.dh_num_warps, dh_per_sm, dh_cap)
    w = p
    progs["wgrad_w13"] = Program(
        ring(w.wgrad_w13_num_stages, 2 * w.wgrad_w13_block_k * w.wgrad_w13_block_m,
             w.wgrad_w13_block_k * w.wgrad_w13_block_n),
        acc(2, w.wgrad_w13_block_m, w.wgrad_w13_block_n, w.wgrad_w13_num_warps), 32 * w.wgrad_w13_num_warps, 1, None)
    progs["wgrad_w2"] = Program(
        ring(w.wgrad_w2_num_stages, w.wgrad_w2_block_k * w.wgrad_w2_block_m, w.wgrad_w2_block_k * w.wgrad_w2_block_n),
        acc(1, w.wgrad_w2_block_m, w.wgrad_w2_block_n, w.wgrad_w2_num_warps), 32 * w.wgrad_w2_num_warps, 1, None)
    return progs


def feasible(params: LayerParams, shape: LayerShape, hw: HardwareConstants | None = None) -> str | None:
    """None if ``params`` can run ``shape`` on ``hw``, else the reason (the
    first constraint broken, naming the fields). ``hw`` None: no GPU limits
    (the CPU interpreter). Checked: the grid (every program resident:
    ``num_programs`` at most the SMs), and per kernel that ``programs_per_sm``
    programs fit one SM: shared memory plus the per-block reserve within
    ``hw.smem_per_sm`` together (``hw.smem_per_block`` for one), fp32
    accumulators plus ``REGISTER_FLOOR`` within the register cap (or 255),
    registers times threads within ``hw.registers_per_sm``. The Triton
    weight gradients are checked also where ``torch._grouped_mm`` runs
    instead: a point holds for both backends."""
    p = params
    if hw is None:
        return None
    if p.num_programs is not None and p.num_programs > hw.sm_count:
        return (f"num_programs ({p.num_programs}) must be at most the SMs ({hw.sm_count}): every spin-wait needs "
                "the whole grid resident")
    for kernel, prog in resources(p, shape).items():
        reason = _kernel_misfit(prog, hw)
        if reason:
            return f"{kernel}: {reason}"
    return None


def _kernel_misfit(prog: Program, hw: HardwareConstants) -> str | None:
    """Why ``prog.per_sm`` programs of one kernel do not fit an SM of ``hw``, or None."""
    # Each resident block also holds the driver's reserve (smem_per_sm - smem_per_block, 1 KiB on an H200),
    # so one program may take smem_per_block and n programs n x (theirs + the reserve).
    reserve = hw.smem_per_sm - hw.smem_per_block
    if (prog.smem_bytes + reserve) * prog.per_sm > hw.smem_per_sm:
        return (f"{prog.per_sm} program(s) x {prog.smem_bytes / 1024:.0f} KiB of shared memory exceed "
                f"{hw.smem_per_sm // 1024} KiB per SM ({hw.smem_per_block // 1024} KiB for one program; smaller "
                "tiles, K step, fewer stages or fewer programs per SM)")
    cap = prog.max_registers or hw.max_registers_per_thread
    if prog.acc_registers + REGISTER_FLOOR > cap:
        return (f"{prog.acc_registers} fp32 accumulator registers per thread do not fit a cap of {cap} (more warps "
                "or a smaller tile)")
    if prog.per_sm > 1:
        used = prog.max_registers or min(hw.max_registers_per_thread, prog.acc_registers + REGISTER_OVERHEAD)
        if used * prog.threads * prog.per_sm > hw.registers_per_sm:
            return (f"{prog.per_sm} programs x {prog.threads} threads x ~{used} registers exceed "
                    f"{hw.registers_per_sm} per SM (set its max_registers, fewer warps or one program per SM)")
    if prog.threads * prog.per_sm > hw.max_threads_per_sm:
        return f"{prog.per_sm} x {prog.threads} threads exceed {hw.max_threads_per_sm} per SM"
    return None


# ---- random points ---------------------------------------------------------------


def _useful(name: str, value, shape: LayerShape) -> bool:
    """Whether a tile width is worth trying for ``shape``: at most the next
    power of two of the dimension it tiles (wider tiles are all masks; row
    tiles: the rows of an expert under balanced routing)."""
    if not isinstance(value, int) or isinstance(value, bool):
        return True
    dim, hidden = shape.dim, shape.hidden
    rows = max(1, shape.tokens * shape.ep_size * shape.top_k // shape.num_experts)  # rows of an expert, balanced
    bound = {
        "block_m": rows, "fc1_block_n": hidden, "fc1_block_k": dim, "fc2_block_n": dim, "fc2_block_k": hidden,
        "dh_block_n": hidden, "dh_block_k": dim, "da_block_n": dim, "da_block_k": hidden,
        "wgrad_w13_block_m": hidden, "wgrad_w13_block_n": dim, "wgrad_w2_block_m": dim, "wgrad_w2_block_n": hidden,
        "wgrad_w13_block_k": rows, "wgrad_w2_block_k": rows, "dispatch_block_dim": dim, "reduce_block_dim": dim,
        "dispatch_block_tokens": shape.tokens, "reduce_block_tokens": shape.tokens,
    }.get(name)
    if bound is None:
        return True
    # floors: a 16-wide tile (tl.dot's least), 32 rows (so that tiny test shapes try two row-tile widths)
    floor = {"dispatch_block_tokens": 1, "reduce_block_tokens": 1, "block_m": 32}.get(name, 16)
    return value <= max(floor, 1 << max(0, math.ceil(math.log2(max(bound, 1)))))


def _allowed(name: str, base_value, numerics: bool, shape: LayerShape) -> list:
    field = FIELDS[name]
    if field.kind == "fixed" or (field.kind == "numerics" and not numerics):
        return [base_value]
    values = [v for v in field.values if _useful(name, v, shape)]
    if field.kind == "mixed" and not numerics:
        values = [v for v in values if field.order_key(v) == field.order_key(base_value)]
    return values or [base_value]


def _build(base: LayerParams, changes: dict) -> LayerParams:
    """``base`` with ``changes``, without running the field validation again:
    every value comes from ``FIELDS`` (which hold valid values only) and
    ``feasible`` checks what spans fields. About 30x cheaper than
    ``replace`` (the grid builds 10^5 points)."""
    point = object.__new__(LayerParams)
    point.__dict__.update(base.__dict__)
    point.__dict__.update(changes)
    return point


def sample(rng: random.Random, shape: LayerShape, *, numerics: bool = False, base: LayerParams | None = None,
           hw: HardwareConstants | None = None, tries: int = 1000) -> LayerParams:
    """A random valid point: every schedule field (and with ``numerics``,
    every numerics field) drawn from its ``FIELDS`` values (tile widths up to
    the dimension they tile), the rest as ``base`` (default: the shape's
    tuned defaults); redrawn until ``feasible(point, shape, hw)``. With
    ``hw`` None (the interpreter) the grid is explicit: 2 to 4 programs.
    ``block_m`` is drawn too: the caller builds the workspace with the
    point (``params.block_m`` sizes it)."""
    base = base or shape.default_params()
    for _ in range(tries):
        changes = {name: rng.choice(_allowed(name, getattr(base, name), numerics, shape)) for name in FIELDS}
        if hw is None:
            changes["num_programs"] = rng.choice((2, 3, 4))
        elif rng.random() < 0.25:
            changes["num_programs"] = rng.randint(2, hw.sm_count)
        else:
            changes["num_programs"] = None
        point = LayerParams(**{**base.__dict__, **changes})  # validated: a sample is a user-facing point
        if feasible(point, shape, hw) is None:
            return point
    raise RuntimeError(f"no feasible point for {shape} in {tries} draws (hw={getattr(hw, 'name', None)})")


# ---- the grid the model ranks --------------------------------------------------------

# The grid: fields shared by the stages, then one tuple of values per stage
# (the stages' tile choices are few combinations, not a product of fields).
# Sized so that one shape gives 10^4 - 10^5 feasible points.
GRID_SHARED: dict[str, tuple] = {
    "block_m": (64, 128),
    "group_m": (4, 8),
    "dispatch_programs": (16, 32, 1024),
    "dispatch_block_tokens": (16, 32),
    "local_first": (False, True),
}
GRID_STAGES: dict[tuple[str, ...], tuple[tuple, ...]] = {
    ("fc1_block_n", "fc1_num_warps", "fc1_num_stages", "fc1_one_dot"): (
        (128, 8, 3, False), (128, 8, 4, False), (128, 8, 3, True), (128, 8, 4, True), (64, 4, 3, False),
        (64, 4, 3, True), (64, 8, 4, False), (256, 8, 2, False)),
    ("fc2_block_n", "fc2_num_warps", "fc2_num_stages", "fc2_programs_per_sm", "fc2_tma", "fc2_defer_release",
     "fc2_flat_loop"): (
        (256, 8, 3, 1, False, False, False), (256, 8, 3, 1, True, False, False), (256, 8, 3, 1, False, True, False),
        (128, 4, 3, 2, False, False, False), (128, 4, 3, 2, True, False, False), (128, 8, 3, 1, False, False, False),
        (256, 8, 3, 1, False, False, True), (256, 8, 3, 1, True, False, True), (128, 4, 3, 2, False, False, True),
        (128, 4, 3, 2, True, False, True)),
    ("dh_num_warps", "dh_num_stages", "dh_programs_per_sm", "dh_copies_rows"): (
        (8, 3, 2, True), (8, 3, 1, True), (8, 3, 2, False)),
    ("da_block_n", "da_num_warps", "da_num_stages", "da_programs_per_sm", "da_tma"): (
        (128, 8, 3, 1, True), (128, 8, 3, 1, False), (128, 4, 3, 2, True), (128, 4, 3, 2, False),
        (64, 4, 3, 2, True)),
    ("reduce_block_tokens", "reduce_block_dim"): ((16, 512), (32, 512), (32, 256), (64, 256)),
}
# The weight-gradient kernel's tile choices (w13, then w2; K steps kept: a
# numerics field), the first the defaults'. Not a grid axis: the wgrad stage
# adds to the others' times, so the grid would repeat every point per
# choice. The measured search tries them as neighbours where the Triton
# kernel runs (``LayerShape.grouped_mm_weight_grads``: fp32 gradients).
WGRAD_CHOICES: dict[tuple[str, ...], tuple[tuple, ...]] = {
    ("wgrad_w13_block_m", "wgrad_w13_block_n", "wgrad_w13_num_stages", "wgrad_w2_block_m", "wgrad_w2_block_n",
     "wgrad_w2_num_stages"): (
        (128, 128, 4, 128, 256, 3), (64, 256, 4, 128, 256, 4), (128, 128, 3, 128, 128, 4)),
}
# With opt-in numerics: joint choices of the K steps of fc1, fc2, dA and the
# dH tile width (the first is the defaults').
GRID_NUMERICS: dict[tuple[str, ...], tuple[tuple, ...]] = {
    ("fc1_block_k", "fc2_block_k", "da_block_k", "dh_block_n"): (
        (64, 64, 64, 128), (64, 64, 32, 128), (32, 32, 32, 128), (64, 32, 32, 128), (64, 64, 64, 64)),
}


# Which kernels' resources each grid axis changes (the others keep base's).
_AXIS_KERNELS = {"fc1": ("dispatch_fc1",), "fc2": ("fc2_combine",), "dh": ("dispatch_dh",), "da": ("da_combine",),
                 "reduce": ()}


def _fits(point: LayerParams, shape: LayerShape, hw: HardwareConstants, kernels: tuple[str, ...]) -> bool:
    progs = resources(point, shape)
    return not any(_kernel_misfit(progs[k], hw) for k in kernels)


def repeats_another(point: LayerParams, shape: LayerShape) -> bool:
    """Whether ``point`` sets a field that has no effect on ``shape``, so that
    it runs as another point does: descriptor loads where the kernel cannot
    use them (not 16-bit data, or H not a multiple of what the descriptor
    needs)."""
    tma_ok = shape.dtype_bytes == 2
    if point.fc2_tma and (not tma_ok or shape.hidden % 8):
        return True
    return bool(point.da_tma and (not tma_ok or shape.hidden % point.da_block_k))


def enumerate_points(shape: LayerShape, *, numerics: bool = False, limit: int | None = None,
                     base: LayerParams | None = None, hw: HardwareConstants | None = None) -> Iterator[LayerParams]:
    """The grid the analytic model ranks for ``shape``: ``GRID_SHARED`` x one
    choice per ``GRID_STAGES`` entry (x ``GRID_NUMERICS`` with
    ``numerics``), the other fields as ``base`` (default: the shape's tuned
    defaults). Left out: points ``feasible`` rejects on ``hw`` (default: the
    uncalibrated H200 constants) and points that repeat another (a field
    without effect: TMA where it cannot run). Schedule points keep
    ``base``'s numerics fields (and the order keys of its mixed fields), so
    they all give ``base``'s bits. Deterministic order; at most ``limit`` points."""
    base = base or shape.default_params()
    hw = hw or default_constants("NVIDIA H200")
    grid = base.num_programs or hw.sm_count
    if grid > hw.sm_count or not _fits(base, shape, hw, ("wgrad_w13", "wgrad_w2")):
        return  # what every point shares with base does not fit
    shared = {k: v for k, v in GRID_SHARED.items() if k != "block_m"}
    shared_names = tuple(shared)
    stage_axes = []
    reduce_key = FIELDS["reduce_block_dim"].order_key
    for names, combos in GRID_STAGES.items():
        if names[0] == "reduce_block_tokens" and not numerics:
            combos = tuple(v for v in combos if reduce_key(v[1]) == reduce_key(base.reduce_block_dim))
        stage_axes.append((names, combos, _AXIS_KERNELS[names[0].split("_")[0]]))
    numerics_names, numerics_choices = ((), [()])
    if numerics:
        (numerics_names, numerics_choices), = GRID_NUMERICS.items()
    count = 0
    for block_m in GRID_SHARED["block_m"]:
        for num_choice in numerics_choices:
            fixed = {"block_m": block_m, **dict(zip(numerics_names, num_choice))}
            probe = _build(base, fixed)
            # feasibility separates by kernel: filter each axis's combos alone
            filtered = [[dict(zip(names, combo)) for combo in combos
                         if _fits(_build(probe, dict(zip(names, combo))), shape, hw, kernels)]
                        for names, combos, kernels in stage_axes]
            for shared_choice in itertools.product(*(shared[k] for k in shared_names)):
                head = dict(fixed, **dict(zip(shared_names, shared_choice)))
                if head["local_first"]:
                    head["local_first_experts"] = 0.25
                for stage_choice in itertools.product(*filtered):
                    changes = dict(head)
                    for part in stage_choice:
                        changes.update(part)
                    point = _build(base, changes)
                    if repeats_another(point, shape):
                        continue
                    yield point
                    count += 1
                    if limit is not None and count >= limit:
                        return
