"""The measured search of UniEP's kernel parameters for one MoE layer shape,
and the verification of its pick before it becomes a tuning-cache entry.

``search_layer`` runs on every rank of an EP group; it is what
``python3 -m titan_uniep.tools.tune`` (the command line, ``--shape`` /
``--config``) and ``[uniep] tuning = "search"`` (``tuning.selection``, at
start-up) call per layer shape. The ``SearchOptions`` fields are the
command line's options. Per direction:

1. the analytic model (``tuning.model``, calibrated constants with
   ``constants``) ranks the grid of ``tuning.space`` by the direction's
   predicted time; the first ``top`` distinct points, projected on the
   fields that direction reads and on the schedule fields (unless
   ``numerics``), the shipped default and (with ``neighbours``) every
   one-stage neighbour of the model's best point (its tile choice of one
   of the direction's GEMM stages swapped for another of the grid's) are
   the candidates: the model ranks the grid, the measurement decides
   between the tile choices it cannot tell apart;
2. each candidate is measured on the real path on the EP group:
   ``moe_forward`` saving h1 | h3, as the custom op runs it, and
   ``moe_backward`` reading them, each point on a workspace built with it,
   in ``rounds`` rounds of alternating order (``timing.time_alternating``),
   median of ``reps`` calls of the slowest rank;
3. the fastest point is measured again against the default (with the
   neighbours, also the model's best with each GEMM stage's fastest
   choice: ``combined_choices``) in a confirmation run of its own
   (``confirm_rounds`` rounds: few points, so more rounds cost little and
   the pick rests on more samples); of those, the fastest in that run, if
   it beats the default by ``min_gain``, must give the default's bits on
   the measured inputs (forward output and h1 | h3, every gradient); a
   point that does not is never cached (a schedule point that does not is
   a broken contract: ``SearchResult.violations``, and the tuner exits 1);
   the next fastest is tried instead;
4. before the picks of both directions become one entry of the cache
   (``tuning.cache``; the caller merges it into the file), the tuned layer
   (forward at the forward pick, backward at the backward pick) runs once
   more beside the default: its forward output, h1 | h3 and every gradient
   must equal the default's bit for bit on every rank (``verify_entry``),
   else nothing of the shape is cached and the refusal names the fields
   and the tensors that differ.

The backward is timed with its weight gradients in the dtype the training
writes them in (``MoELayer.weight_grad_dtype``: fp32 where TorchTitan
applies no FSDP, as at NGPU = 1: fp32 master weights, whose gradients the
Triton weight-gradient kernel writes; then its tile choices,
``tuning.space.WGRAD_CHOICES``, are backward neighbours too). Bits are
compared with the weight gradients in both dtypes the backward writes in
training (``WEIGHT_GRAD_DTYPES``): the data's, and fp32, where the
weight-gradient kernel's tile fields reach the stored sums; so an entry
serves either.

A progress bar per shape counts the measurements (``progress``, rank 0).
``numerics`` lets the candidates change summation-order fields too: they
are measured and reported, but a point that changes bits is never cached.

``tuning.space`` and ``tuning.model`` are imported where they are used, not
here: the CPU tests put a fake model and space in their place, and
``predictions`` answers None in a tree without the model.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..params import LayerParams, default_params
from ..runtime import BackwardWorkspace, Workspace, moe_backward, moe_forward
from ..shapes import layer_inputs
from ..timing import time_alternating
from .cache import CacheEntry, CacheKey, dtype_name

__all__ = ["BACKWARD_NAMES", "MoELayer", "SearchOptions", "SearchResult", "WEIGHT_GRAD_DTYPES", "predictions",
           "routing_stats", "search_layer", "verify_entry"]

# Which stages of tuning.space.FIELDS each direction's kernels read.
DIRECTION_STAGES = {
    "forward": {"all", "dispatch", "fc1", "fc2", "reduce"},
    "backward": {"all", "dispatch", "reduce", "dh", "da", "wgrad"},
}


@dataclass(frozen=True)
class MoELayer:
    """One MoE layer shape to tune: ``tokens`` per rank, ``D``, ``H``, ``E``, ``K``."""

    name: str
    tokens: int
    dim: int
    hidden: int
    num_experts: int
    top_k: int
    score_before_experts: bool = False
    dtype: torch.dtype = torch.bfloat16
    weight_grad_dtype: torch.dtype | None = None
    """The weight gradients' dtype the training writes, which the backward
    is timed in: None for the data's, fp32 for fp32 master weights
    (``compute_dtype.weight_grad_dtype``)."""

    @property
    def dims(self) -> tuple[int, int, int, int, int]:
        return self.tokens, self.dim, self.hidden, self.num_experts, self.top_k


@dataclass
class SearchOptions:
    """How one shape is searched (the command line's options)."""

    top: int = 4
    numerics: bool = False
    warmup: int = 3
    reps: int = 10
    rounds: int = 2
    confirm_rounds: int = 4
    min_gain: float = 0.02
    neighbours: bool = True
    schedule: str = "fused"
    constants: str = ""
    progress: bool = True


@dataclass
class SearchResult:
    """What one shape's search found: the entry to cache (None if refused),
    the measured table per direction, and the problems it saw."""

    layer: MoELayer
    entry: CacheEntry | None
    table: dict[str, list[dict]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)


# ---- the model's side ------------------------------------------------------------------


def layer_shape(layer: MoELayer, ep_size: int):
    from .space import LayerShape

    grad_dtype = layer.weight_grad_dtype
    return LayerShape(tokens=layer.tokens, dim=layer.dim, hidden=layer.hidden, num_experts=layer.num_experts,
                      top_k=layer.top_k, ep_size=ep_size, dtype_bytes=layer.dtype.itemsize,
                      score_before_experts=layer.score_before_experts,
                      weight_grad_bytes=None if grad_dtype in (None, layer.dtype) else grad_dtype.itemsize)


def routing_stats(indices: torch.Tensor, num_experts: int, group: dist.ProcessGroup):
    """The model's ``RoutingStats`` of every rank's ``indices`` (gathered: a collective)."""
    from .model import RoutingStats

    world = dist.get_world_size(group)
    every = torch.empty(world * indices.shape[0], *indices.shape[1:], dtype=indices.dtype, device=indices.device)
    dist.all_gather_into_tensor(every, indices.contiguous(), group=group)
    return RoutingStats.from_indices(list(every.view(world, *indices.shape).cpu()), num_experts, world)


def hardware(options: SearchOptions, device: torch.device):
    """The model's constants: ``options.constants`` (the calibration's file) or this GPU's uncalibrated ones."""
    from .model import default_constants, load_constants

    return load_constants(options.constants) if options.constants else default_constants(
        torch.cuda.get_device_name(device))


def predictions(layer: MoELayer, indices: torch.Tensor, group: dist.ProcessGroup,
                points: dict[str, LayerParams | tuple[LayerParams, LayerParams]], constants: str = "",
                schedule: str = "fused") -> dict | None:
    """The model's prediction of each named point (one for both directions,
    or a ``(forward, backward)`` pair), for reports: ``{"hardware": source,
    name: {"forward": {stage: ms}, "backward": {...}, "forward_total": ms,
    "backward_total": ms}}``; None in a tree without the tuning model. A
    collective (it gathers the routing)."""
    if importlib.util.find_spec("titan_uniep.tuning.model") is None:
        return None
    from .model import predict

    world = dist.get_world_size(group)
    stats = routing_stats(indices, layer.num_experts, group)
    hw = hardware(SearchOptions(constants=constants), indices.device)
    shape = layer_shape(layer, world)
    out = {"hardware": hw.source}
    for name, point in points.items():
        fwd, bwd = point if isinstance(point, tuple) else (point, point)
        forward = prediction_record(predict(shape, stats, world, fwd, hw, schedule=schedule))
        backward = forward if bwd is fwd else prediction_record(predict(shape, stats, world, bwd, hw,
                                                                        schedule=schedule))
        out[name] = {"forward": forward["forward"], "forward_total": forward["forward_total"],
                     "backward": backward["backward"], "backward_total": backward["backward_total"]}
    return out


def prediction_record(pred) -> dict:
    return {"forward": {k: float(v) for k, v in pred.forward.items()},
            "backward": {k: float(v) for k, v in pred.backward.items()},
            "forward_total": float(pred.forward_total), "backward_total": float(pred.backward_total)}


def project(point: LayerParams, default: LayerParams, direction: str, numerics: bool) -> LayerParams | None:
    """``point`` with every field ``direction`` does not read (and, unless
    ``numerics``, every value that may change bits: ``tuning.space`` kinds)
    set back to the default's; None if the mix is not a valid point."""
    from .space import FIELDS

    changes = {}
    for name, spec in FIELDS.items():
        value, base = getattr(point, name), getattr(default, name)
        if value == base or spec.kind == "fixed" or spec.stage not in DIRECTION_STAGES[direction]:
            continue
        if not numerics and (spec.kind == "numerics"
                             or (spec.kind == "mixed" and spec.order_key(value) != spec.order_key(base))):
            continue
        changes[name] = value
    try:
        return default.replace(**changes)
    except ValueError:
        return None


def ranked_points(layer: MoELayer, stats, world: int, options: SearchOptions, hw) -> list[tuple]:
    """Every grid point of ``tuning.space`` with the model's prediction
    (``[(params, prediction)]``), ranked once for both directions."""
    from .model import rank
    from .space import enumerate_points

    shape = layer_shape(layer, world)
    return list(rank(shape, stats, world, enumerate_points(shape, numerics=options.numerics, hw=hw), hw,
                     schedule=options.schedule))


# Predictions within this fraction of each other are a tie the model cannot break.
TIE = 1e-3
# At most this many points of one tie are looked at for the simplest one.
TIE_SCAN = 256


def candidates(layer: MoELayer, stats, world: int, direction: str, options: SearchOptions, hw,
               ranked: list[tuple] | None = None, best_out: list | None = None) -> list[tuple]:
    """``[(params, prediction)]``: the default, then the model's best
    ``options.top`` distinct feasible points of ``direction``, projected
    (``project``) from ``ranked`` (``ranked_points``, computed if None), then
    (``options.neighbours``) the feasible one-stage neighbours of the first
    of them (``stage_neighbours``; of the default if there is none), which
    is appended to ``best_out`` when given. Of points whose predicted times
    tie (``TIE``), only the one that changes the fewest fields is kept:
    measuring several points the model cannot tell apart would spend the
    search on one guess."""
    from .model import predict
    from .space import feasible

    shape = layer_shape(layer, world)
    default = default_params(world, hidden=layer.hidden)
    ranked = ranked if ranked is not None else ranked_points(layer, stats, world, options, hw)
    chosen = [(default, predict(shape, stats, world, default, hw, schedule=options.schedule))]
    seen = {default}
    last_ms, scanned = None, 0
    for params, pred in sorted(ranked, key=lambda item: _predicted_ms(item[1], direction)):
        ms = _predicted_ms(pred, direction)
        tie = last_ms is not None and abs(ms - last_ms) <= TIE * last_ms
        if tie and scanned >= TIE_SCAN:
            continue
        if not tie and len(chosen) > options.top:
            break
        point = project(params, default, direction, options.numerics)
        if point is None or point in seen or feasible(point, shape, hw) is not None:
            continue
        if tie:
            scanned += 1
            if len(changed_fields(point, default)) < len(changed_fields(chosen[-1][0], default)):
                seen.add(point)
                chosen[-1] = (point, pred)
            continue
        seen.add(point)
        chosen.append((point, pred))
        last_ms, scanned = ms, 0
    best = chosen[1][0] if len(chosen) > 1 else default
    if best_out is not None:
        best_out.append(best)
    if options.neighbours:
        for point in stage_neighbours(best, shape, direction):
            point = project(point, default, direction, options.numerics)
            if point is None or point in seen or feasible(point, shape, hw) is not None:
                continue
            seen.add(point)
            chosen.append((point, None))
    return [(point, predict(shape, stats, world, point, hw, schedule=options.schedule)) for point, _ in chosen]


# The GEMM stages whose tile choices (tuning.space.GRID_STAGES) each direction's neighbours swap.
NEIGHBOUR_STAGES = {"forward": ("fc1", "fc2"), "backward": ("dh", "da")}


def neighbour_axes(direction: str, shape=None) -> dict[tuple[str, ...], tuple[tuple, ...]]:
    """The ``GRID_STAGES`` entries (field names -> tile choices) of
    ``direction``'s GEMM stages; for the backward of a ``shape`` whose
    weight gradients run on the Triton kernel (fp32 gradients), also its
    tile choices (``tuning.space.WGRAD_CHOICES``)."""
    from .space import GRID_STAGES, WGRAD_CHOICES

    axes = {names: combos for names, combos in GRID_STAGES.items()
            if names[0].split("_")[0] in NEIGHBOUR_STAGES[direction]}
    if direction == "backward" and shape is not None and not shape.grouped_mm_weight_grads("auto"):
        axes.update(WGRAD_CHOICES)
    return axes


def stage_neighbours(point: LayerParams, shape, direction: str) -> list[LayerParams]:
    """``point`` with the tile choice of one GEMM stage of ``direction``
    replaced by each other choice of ``neighbour_axes`` (the grid's
    ``GRID_STAGES``, and the weight-gradient kernel's where it runs), one
    stage at a time; choices that repeat another point on ``shape`` are
    left out."""
    from .space import repeats_another

    out = []
    for names, combos in neighbour_axes(direction, shape).items():
        for combo in combos:
            changes = dict(zip(names, combo))
            if all(getattr(point, k) == v for k, v in changes.items()):
                continue
            try:
                near = point.replace(**changes)
            except ValueError:
                continue
            if not repeats_another(near, shape):
                out.append(near)
    return out


def combined_choices(best: LayerParams, measured: dict[LayerParams, float | None], direction: str,
                     shape=None) -> LayerParams:
    """``best`` (the model's best point) with, for each GEMM stage of
    ``direction``, the tile choice of the fastest measured point that
    differs from ``best`` only in that stage's choice, where it beat ``best``
    (a step of coordinate descent over the stages' measured neighbours)."""
    base_ms = measured.get(best)
    if base_ms is None:
        return best
    adopted = {}
    for names in neighbour_axes(direction, shape):
        own = {k: getattr(best, k) for k in names}
        fastest, fastest_ms = None, base_ms
        for point, ms in measured.items():
            if ms is None or ms >= fastest_ms or point == best:
                continue
            if point.replace(**own) == best:
                fastest, fastest_ms = point, ms
        if fastest is not None:
            adopted.update({k: getattr(fastest, k) for k in names})
    return best.replace(**adopted)


# ---- the measured side -------------------------------------------------------------------


def confirmation_set(times: dict[str, float | None], points: dict[str, LayerParams], default: LayerParams,
                     best: LayerParams, direction: str, options: SearchOptions, shape, hw
                     ) -> tuple[list[str], dict[str, LayerParams]]:
    """What the confirmation run measures after the first (``times`` by the
    names of ``points``, the measured candidates; "default" among them): the
    default, the fastest point, and (``options.neighbours``) the model's
    ``best`` with each GEMM stage's fastest choice where one beat it
    (``combined_choices``, projected; if feasible). Of many noisy measurements the fastest is
    partly luck; a run of its own does not share that luck, and the pick
    compares these points on that run's figures only. Returns the names to
    measure (just the default: no run) and the new points among them."""
    from .space import feasible

    measured = [n for n in times if times[n] is not None]
    final = list(dict.fromkeys(["default", *sorted(measured, key=lambda n: times[n])[:1]]))
    new = {}
    if options.neighbours:
        combined = combined_choices(best, {p: times.get(n) for n, p in points.items()}, direction, shape)
        combined = project(combined, default, direction, options.numerics) if combined != best else None
        if combined is not None and feasible(combined, shape, hw) is None:
            name = label(combined, default)
            if name not in points:
                new[name] = combined
            final = list(dict.fromkeys([*final, name]))
    return final, new


def changed_fields(point: LayerParams, base: LayerParams) -> dict[str, object]:
    """The fields of ``point`` that differ from ``base`` (the cache's form of a point)."""
    return {f.name: getattr(point, f.name) for f in dataclasses.fields(LayerParams)
            if getattr(point, f.name) != getattr(base, f.name)}


def label(point: LayerParams, base: LayerParams) -> str:
    changes = changed_fields(point, base)
    return ",".join(f"{k}={v}" for k, v in changes.items()) if changes else "default"


def pick(measured: dict[str, float | None], names: list[str], default_name: str, min_gain: float,
         same_bits) -> tuple[str, list[str], list[str]]:
    """The point to cache among ``names`` (measured ms, None: failed): the
    fastest that beats the default by ``min_gain`` and for which
    ``same_bits(name)`` is ``(True, _)``, else the default. Returns
    ``(name, notes, violations)``: why faster points were passed over, and
    schedule points whose bits differ (``same_bits`` gives ``(False, True)``
    for those: a broken contract)."""
    base = measured[default_name]
    notes, violations = [], []
    order = sorted((n for n in names if measured[n] is not None and n != default_name), key=lambda n: measured[n])
    for name in order:
        if measured[name] > base * (1.0 - min_gain):
            break
        equal, schedule_only = same_bits(name)
        if equal:
            return name, notes, violations
        if schedule_only:
            violations.append(f"{name}: a schedule point whose bits differ from the default's")
        else:
            notes.append(f"{name}: {base / measured[name]:.3f}x faster but changes bits (not cached)")
    return default_name, notes, violations


WEIGHT_GRAD_DTYPES = (None, torch.float32)
"""The weight gradients' dtypes the bits are compared in: the data's (None),
and fp32 (fp32 master weights: ``runtime.backward``'s ``weight_grad_dtype``)."""


def backward_outputs(backward, point: LayerParams) -> list[torch.Tensor]:
    """``(dx, dscores, dw1, dw2, dw3)`` of ``backward(point, None)``, then the
    weight gradients of every other ``WEIGHT_GRAD_DTYPES`` entry (copies)."""
    outputs = [g.clone() for g in backward(point, None)]
    for dtype in WEIGHT_GRAD_DTYPES[1:]:
        outputs += [g.clone() for g in backward(point, dtype)[2:]]
    return outputs


BACKWARD_NAMES = ("dx", "dscores", "dw1", "dw2", "dw3",
                  *(f"{w} in {str(d).removeprefix('torch.')}" for d in WEIGHT_GRAD_DTYPES[1:]
                    for w in ("dw1", "dw2", "dw3")))


def equal_everywhere(pairs, group: dist.ProcessGroup, device) -> bool:
    """Whether every ``(a, b)`` tensor pair is bitwise equal on every rank of ``group``."""
    flag = torch.tensor([int(all(torch.equal(a, b) for a, b in pairs))], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def verify_entry(forward, backward, default: LayerParams, forward_point: LayerParams, backward_point: LayerParams,
                 h13: torch.Tensor, group: dist.ProcessGroup, device) -> list[str]:
    """The tensors (``out``, ``h13``, then ``BACKWARD_NAMES``: every gradient,
    the weight gradients in each of ``WEIGHT_GRAD_DTYPES``) in which the tuned
    layer (the forward at ``forward_point``, the backward at ``backward_point``
    on that forward's h1 | h3) differs from the default's on any rank of
    ``group``; empty when every bit is equal. ``forward(point)`` /
    ``backward(point, weight_grad_dtype)`` run one call into ``h13``."""
    names = ("out", "h13", *BACKWARD_NAMES)
    runs = []
    for fwd, bwd in ((default, default), (forward_point, backward_point)):
        h13.zero_()
        out = forward(fwd).clone()
        saved = h13.clone()
        runs.append((out, saved, *backward_outputs(backward, bwd)))
    flags = torch.tensor([int(torch.equal(a, b)) for a, b in zip(*runs)], device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=group)
    return [name for name, same in zip(names, flags.tolist()) if not same]


def search_layer(group: dist.ProcessGroup, layer: MoELayer, options: SearchOptions) -> SearchResult:
    """Measure ``layer``'s candidates on ``group`` (every rank calls it) and
    return the entry for the cache (module docstring). GPU only."""
    from .model import predict
    from .space import keeps_bits

    if not torch.cuda.is_available():
        raise RuntimeError("the measured search times CUDA kernels: run it on a GPU (or use [uniep] tuning = "
                           "\"cached\" with a cache tuned on one, or \"off\")")
    dev = torch.device("cuda", torch.cuda.current_device())
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if layer.num_experts % world:
        raise ValueError(f"{layer.name}: {layer.num_experts} experts do not split over EP {world}")
    inputs = layer_inputs(layer.dims, rank, world, dev, layer.dtype)
    x, grad, scores, indices = (inputs[n] for n in ("x", "grad", "scores", "indices"))
    weights = (inputs["w1l"], inputs["w2l"], inputs["w3l"])
    sb = layer.score_before_experts
    hw = hardware(options, dev)
    stats = routing_stats(indices, layer.num_experts, group)
    default = default_params(world, hidden=layer.hidden)
    sizes = dict(num_tokens=layer.tokens, dim=layer.dim, hidden=layer.hidden, num_experts=layer.num_experts,
                 top_k=layer.top_k, dtype=layer.dtype, device=dev)
    shape = layer_shape(layer, world)
    ranked = ranked_points(layer, stats, world, options, hw)
    model_best = {d: [] for d in ("forward", "backward")}
    cands = {d: {label(p, default): (p, pred)
                 for p, pred in candidates(layer, stats, world, d, options, hw, ranked, model_best[d])}
             for d in ("forward", "backward")}
    del ranked
    workspaces: dict[tuple, Workspace | BackwardWorkspace] = {}

    def workspace(point: LayerParams, direction: str):
        # One per buffer-sizing choice (block_m), built with the point.
        key = (direction, point.block_m)
        if key not in workspaces:
            kind = Workspace if direction == "forward" else BackwardWorkspace
            workspaces[key] = kind.for_group(group, **sizes, params=point)
        return workspaces[key]

    h13 = torch.empty(workspace(default, "forward").shape.slot_capacity, 2 * layer.hidden, dtype=layer.dtype,
                      device=dev)

    def forward(point):
        return moe_forward(x, scores, indices, *weights, workspace=workspace(point, "forward"),
                           schedule=options.schedule, score_before_experts=sb, params=point, saved_h13=h13)

    def backward(point, weight_grad_dtype=layer.weight_grad_dtype):
        return moe_backward(grad, x, scores, indices, *weights, workspace=workspace(point, "backward"),
                            schedule=options.schedule, score_before_experts=sb, params=point, saved_h13=h13,
                            weight_grad_dtype=weight_grad_dtype)

    def same_bits(direction: str, point: LayerParams) -> bool:
        if direction == "forward":
            h13.zero_()
            want = (forward(default), h13.clone())
            h13.zero_()
            got = (forward(point), h13)
        else:
            forward(default)
            want, got = backward_outputs(backward, default), backward_outputs(backward, point)
        return equal_everywhere(zip(want, got), group, dev)

    result = SearchResult(layer, None)
    bar = _progress(sum(len(c) for c in cands.values()) * options.rounds, layer.name, options.progress and rank == 0)
    picks = {}
    try:
        for direction, run in (("forward", forward), ("backward", backward)):
            points = cands[direction]
            if direction == "backward":
                forward(default)  # h1 | h3 for the backward: every schedule point writes the default's

            def failed(name, trace, direction=direction):
                result.problems.append(f"{direction} {name} failed: {trace.strip().splitlines()[-1]}")

            def measured(name, ms, direction=direction):
                bar.update(1)
                bar.set_postfix_str(f"{direction} {name[:40]}: {'failed' if ms is None else f'{ms:.3f} ms'}")

            with torch.no_grad():
                times = time_alternating({name: (lambda p=p: lambda: run(p)) for name, (p, _) in points.items()},
                                         warmup=options.warmup, reps=options.reps, rounds=options.rounds,
                                         group=group, on_error=failed, after_each=measured)
                if times["default"] is None:
                    raise RuntimeError(f"{layer.name}: the default point failed ({'; '.join(result.problems)})")
                final, new = confirmation_set(times, {n: p for n, (p, _) in points.items()}, default,
                                              model_best[direction][0], direction, options, shape, hw)
                for name, point in new.items():
                    points[name] = (point, predict(shape, stats, world, point, hw, schedule=options.schedule))
                first_ms = {}
                if len(final) > 1:
                    bar.total += len(final) * options.confirm_rounds
                    again = time_alternating({n: (lambda p=points[n][0]: lambda: run(p)) for n in final},
                                             warmup=options.warmup, reps=options.reps, rounds=options.confirm_rounds,
                                             group=group, on_error=failed, after_each=measured)
                    first_ms = {n: times.get(n) for n in final}
                    times.update(again)
                    if times["default"] is None:
                        raise RuntimeError(f"{layer.name}: the default point failed ({'; '.join(result.problems)})")
                chosen, notes, violations = pick(
                    times, final, "default", options.min_gain,
                    lambda name: (same_bits(direction, points[name][0]),
                                  keeps_bits(points[name][0], default) is None))
            result.problems += [f"{direction} {note}" for note in notes]
            result.violations += [f"{layer.name} {direction} {v}" for v in violations]
            picks[direction] = chosen
            result.table[direction] = [
                {"point": name, "measured_ms": times[name], "predicted_ms": _predicted_ms(pred, direction),
                 "picked": name == chosen, **({"first_run_ms": first_ms[name]} if name in first_ms else {})}
                for name, (_, pred) in points.items()]
    finally:
        bar.close()
        workspaces.clear()
        torch.cuda.empty_cache()
    if result.violations:
        return result  # a broken contract: nothing of this shape is cached
    tuned = (cands["forward"][picks["forward"]][0], cands["backward"][picks["backward"]][0])
    if tuned != (default, default):
        differ = verify_entry(forward, backward, default, *tuned, h13, group, dev)
        if differ:
            result.violations.append(
                f"{layer.name}: refused: the tuned point (forward {label(tuned[0], default)}; backward "
                f"{label(tuned[1], default)}) gives other bits than the default in {', '.join(differ)}")
            return result
    rows = {d: {row["point"]: row for row in result.table[d]} for d in result.table}
    result.entry = CacheEntry(
        key=CacheKey.for_layer(gpu=torch.cuda.get_device_name(dev), ep_size=world, dtype=layer.dtype,
                               num_tokens=layer.tokens, dim=layer.dim, hidden=layer.hidden,
                               num_experts=layer.num_experts, top_k=layer.top_k, score_before_experts=sb),
        forward=changed_fields(cands["forward"][picks["forward"]][0], default),
        backward=changed_fields(cands["backward"][picks["backward"]][0], default),
        measured_ms={d: {"default": rows[d]["default"]["measured_ms"], "tuned": rows[d][picks[d]]["measured_ms"]}
                     for d in rows},
        predicted_ms={d: {"default": rows[d]["default"]["predicted_ms"], "tuned": rows[d][picks[d]]["predicted_ms"]}
                      for d in rows},
        tokens=layer.tokens, schedule=options.schedule, candidates=sum(len(c) for c in cands.values()),
        weight_grad_dtype=dtype_name(layer.weight_grad_dtype or layer.dtype),
    )
    return result


def _predicted_ms(pred, direction: str) -> float:
    return float(pred.forward_total if direction == "forward" else pred.backward_total)


class _NoBar:
    """Stands in for tqdm where it is not installed (or not on rank 0)."""

    total = 0

    def update(self, n: int) -> None:
        pass

    def set_postfix_str(self, text: str) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(total: int, name: str, show: bool):
    if not show:
        return _NoBar()
    try:
        from tqdm import tqdm
    except ImportError:  # a dependency of titan_uniep, but an install with --no-deps may lack it
        print(f"tuning {name}: {total} measurements (install tqdm for a progress bar)", flush=True)
        return _NoBar()
    return tqdm(total=total, desc=f"tune {name}", unit="run", file=sys.stderr, dynamic_ncols=True)
