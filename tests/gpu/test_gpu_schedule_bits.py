"""The bitwise contract on the GPU at every point the tuner may choose.

Random points of the tuning space (``tuning.space.sample``: schedule fields
only, feasible on an H200) give the default point's bits, forward and every
gradient, in bf16 and fp16 on the compiled kernels, where a ``tl.sum``
adds in the order of its tile's layout (the interpreter cannot show that):

- ``test_sampled_point_gives_the_default_points_bits``: simulated worlds of
  W = 1, 2 and 4 ranks on four shapes whose dims are no powers of two, whose
  token counts fill no tile and whose experts do not split evenly into row
  tiles; every (shape, W, score mode, dtype) once (48 points). The point runs
  a random schedule; the reference is the default point, sequential. Compared:
  every rank's forward output, the used h1 | h3 rows, dx, dscores, dw1, dw2,
  dw3 (the backward on the saved h1 | h3).
- ``test_sampled_point_gives_the_default_points_fp32_weight_gradients``: the
  same in bf16 with the weight gradients in fp32 (master weights), where the
  weight-gradient kernel's tile fields reach the stored sums.
- ``test_weight_gradient_tile_choices_give_the_default_points_fp32_weight_gradients``:
  each of the tuner's weight-gradient tile choices (``WGRAD_CHOICES``) alone.
- ``test_sampled_point_on_the_real_path_gives_the_default_points_bits``: the
  same on ``moe_forward`` / ``moe_backward`` of a one-rank group (the real
  path at world size 1: symmetric memory, the counts exchange).
- ``test_tuner_refuses_to_cache_a_point_that_changes_bits``: the measured
  search with a planted pick that changes the summation order: nothing is
  cached, and the refusal names the fields and the tensors.
- ``test_the_search_times_the_backward_with_the_layers_weight_gradient_dtype``:
  a layer trained with fp32 master weights is timed with fp32 weight
  gradients, the weight-gradient tiles among its backward neighbours.

A failure names the seed, the point's fields and the tensors that differ (or
the error), then what each of those fields does alone on the default point
(``fields_alone``: the fields that alone change bits or stop the layer).
``UNIEP_TUNING_SEED`` (default 0) shifts every seed to explore other points.
Run on the GPU machine (with xdist: the compiles dominate):
``python -m pytest -n 12 tests/gpu/test_gpu_schedule_bits.py``.
"""

import itertools
import os
import random

import pytest
import torch

from titan_uniep.layout import slot_capacity
from titan_uniep.params import default_params
from titan_uniep.runtime import (BackwardWorkspace, Workspace, moe_backward, moe_forward, simulated_moe_backward,
                                 simulated_moe_forward)
from titan_uniep.tuning.hardware import default_constants
from titan_uniep.tuning.space import FIELDS, WGRAD_CHOICES, LayerShape, keeps_bits, sample

import worlds

pytestmark = pytest.mark.gpu

SEED = 20261204 + int(os.environ.get("UNIEP_TUNING_SEED", "0"))
# (D, H, E, K): D and H no powers of two; the H classes of params.DEFAULTS (<= 1024, <= 2048, > 2048)
SHAPES = {
    "d576_h744_e20_k4": (576, 744, 20, 4),
    "d1000_h1440_e12_k3": (1000, 1440, 12, 3),
    "d1536_h1408_e64_k6": (1536, 1408, 64, 6),
    "d2880_h2560_e8_k2": (2880, 2560, 8, 2),
}
# Tokens per rank: odd, one rank empty at W = 4, and skewed routing there (expert 0 on every token).
TOKENS = {1: [301], 2: [257, 131], 4: [129, 0, 255, 77]}
CASES = list(itertools.product(SHAPES, (1, 2, 4), (False, True), ("bfloat16", "float16")))
NAMES = ("dx", "dscores", "dw1", "dw2", "dw3")


def world_inputs(shape_name: str, world: int, dtype: torch.dtype) -> dict:
    dim, hidden, experts, top_k = SHAPES[shape_name]
    seed = sum(map(ord, shape_name)) + world
    return worlds.make_world(world, experts, top_k, TOKENS[world], seed=seed, dim=dim, hidden=hidden,
                             force=0 if world == 4 else None, device="cuda", dtype=dtype)


def layer_shape(shape_name: str, world: int, dtype: torch.dtype, score_before: bool) -> LayerShape:
    dim, hidden, experts, top_k = SHAPES[shape_name]
    return LayerShape(max(TOKENS[world]), dim, hidden, experts, top_k, world,
                      torch.empty((), dtype=dtype).element_size(), score_before)


def run_simulated(w: dict, params, score_before: bool, schedule: str,
                  weight_grad_dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Every output of one point of a simulated world: the forward into NaN-poisoned buffers, then the backward
    (the weight gradients in ``weight_grad_dtype``: default the data's)."""
    world = len(w["xs"])
    rows = max(max(x.shape[0] for x in w["xs"]), 1)
    dim, hidden, el = w["xs"][0].shape[1], w["w1s"][0].shape[1], w["el"]
    dtype = w["xs"][0].dtype
    out = torch.full((world, rows + 1, dim), float("nan"), dtype=dtype, device="cuda")
    h13 = torch.full((world, slot_capacity(world, rows, w["indices"][0].shape[1], el), 2 * hidden), float("nan"),
                     dtype=dtype, device="cuda")
    outs = simulated_moe_forward(w["xs"], w["scores"], w["indices"], w["w1s"], w["w2s"], w["w3s"], schedule=schedule,
                                 score_before_experts=score_before, params=params, out=out, saved_h13=h13)
    result = {}
    for r in range(world):
        used = sum(int((idx // el == r).sum()) for idx in w["indices"])
        result[f"out.r{r}"] = outs[r].clone()
        result[f"h13.r{r}"] = h13[r, :used].clone()
    grads = simulated_moe_backward(w["grads"], w["xs"], w["scores"], w["indices"], w["w1s"], w["w2s"], w["w3s"],
                                   schedule=schedule, score_before_experts=score_before, params=params,
                                   poison_outputs=True, saved_h13=h13, weight_grad_dtype=weight_grad_dtype)
    for r in range(world):
        for name, g in zip(NAMES, grads[r]):
            result[f"{name}.r{r}"] = g.clone()
    for name, t in result.items():
        assert not torch.isnan(t).any(), f"{name}: NaN (an element no task wrote)"
    return result


def changed_fields(point, base) -> dict:
    return {f: getattr(point, f) for f in FIELDS if getattr(point, f) != getattr(base, f)}


def differing(ref: dict, got: dict) -> list[str]:
    assert ref.keys() == got.keys()
    return [name for name in ref if not torch.equal(ref[name], got[name])]


ALONE_TIMEOUT_S = 5.0  # each field alone: a stalled wait reports in 5 s, not the default bound


def fields_alone(run, ref: dict, point, base) -> dict[str, str]:
    """What each field the point changes does alone on the base point:
    ``run(params)`` against ``ref``; the fields whose value alone changes bits
    or stops the layer, with the tensors or the error's first line."""
    found = {}
    for field, value in changed_fields(point, base).items():
        try:
            alone = base.replace(**{field: value}, timeout_s=ALONE_TIMEOUT_S)
        except ValueError as e:
            found[field] = f"not valid alone: {e}"
            continue
        try:
            differ = differing(ref, run(alone))
        except RuntimeError as e:
            found[field] = "stops: " + str(e).splitlines()[0][:300]
            continue
        if differ:
            found[field] = f"bits differ in {differ}"
    return found


def check_point(run, ref: dict, point, base, what: str) -> None:
    """``run(point)`` gives ``ref``'s bits; a failure (other bits, or an error)
    names the point, then what each of its fields does alone."""
    try:
        got, error = run(point), None
    except RuntimeError as e:
        got, error = None, str(e)
    differ = differing(ref, got) if got is not None else None
    if error is None and not differ:
        return
    alone = fields_alone(run, ref, point, base)
    found = error if error is not None else f"bits differ in {differ}"
    pytest.fail(f"{what}, {changed_fields(point, base)}: {found}\nthe fields alone: {alone or 'none fails alone'}")


@pytest.mark.parametrize("shape_name,world,score_before,dtype", CASES,
                         ids=[f"{s}-w{w}-{'before' if b else 'after'}-{d}" for s, w, b, d in CASES])
def test_sampled_point_gives_the_default_points_bits(shape_name, world, score_before, dtype):
    dtype = getattr(torch, dtype)
    shape = layer_shape(shape_name, world, dtype, score_before)
    base = default_params(world, hidden=shape.hidden)
    seed = SEED + CASES.index((shape_name, world, score_before, str(dtype).removeprefix("torch.")))
    rng = random.Random(seed)
    point = sample(rng, shape, base=base, hw=default_constants("NVIDIA H200"))
    schedule = rng.choice(("sequential", "fused"))
    fields = changed_fields(point, base)
    assert fields and keeps_bits(point, base) is None, f"seed {seed}: not a schedule point: {fields}"
    w = world_inputs(shape_name, world, dtype)
    ref = run_simulated(w, base, score_before, "sequential")
    check_point(lambda params: run_simulated(w, params, score_before, schedule), ref, point, base,
                f"seed {seed}, {schedule}")


FP32_GRAD_CASES = list(itertools.product(SHAPES, (1, 2, 4)))


@pytest.mark.parametrize("shape_name,world", FP32_GRAD_CASES, ids=[f"{s}-w{w}" for s, w in FP32_GRAD_CASES])
def test_sampled_point_gives_the_default_points_fp32_weight_gradients(shape_name, world):
    """bf16 data with fp32 master weights (TorchTitan's NGPU = 1 training): the
    Triton weight-gradient kernel stores its fp32 sums unrounded, so its tile
    fields (schedule fields the tuner may pick) must not change a bit there."""
    shape = layer_shape(shape_name, world, torch.bfloat16, False)
    base = default_params(world, hidden=shape.hidden)
    seed = SEED + 2000 + FP32_GRAD_CASES.index((shape_name, world))
    rng = random.Random(seed)
    point = sample(rng, shape, base=base, hw=default_constants("NVIDIA H200"))
    schedule = rng.choice(("sequential", "fused"))
    w = world_inputs(shape_name, world, torch.bfloat16)
    ref = run_simulated(w, base, False, "sequential", torch.float32)
    assert all(ref[f"dw{i}.r0"].dtype == torch.float32 for i in (1, 2, 3))
    check_point(lambda params: run_simulated(w, params, False, schedule, torch.float32), ref, point, base,
                f"seed {seed}, {schedule}")


WGRAD_CASES = [(names, combo, world) for names, combos in WGRAD_CHOICES.items() for combo in combos[1:]
               for world in (1, 2)]


@pytest.mark.parametrize("names,combo,world", WGRAD_CASES, ids=[f"{c}-w{w}" for _, c, w in WGRAD_CASES])
def test_weight_gradient_tile_choices_give_the_default_points_fp32_weight_gradients(names, combo, world):
    shape = layer_shape("d1536_h1408_e64_k6", world, torch.bfloat16, False)
    base = default_params(world, hidden=shape.hidden)
    assert tuple(getattr(base, n) for n in names) == next(iter(WGRAD_CHOICES.values()))[0]
    point = base.replace(**dict(zip(names, combo)))
    assert keeps_bits(point, base) is None
    w = world_inputs("d1536_h1408_e64_k6", world, torch.bfloat16)
    ref = run_simulated(w, base, False, "sequential", torch.float32)
    got = run_simulated(w, point, False, "fused", torch.float32)
    differ = differing(ref, got)
    assert not differ, f"{changed_fields(point, base)}: bits differ in {differ}"


def run_real(group, w: dict, params, score_before: bool, schedule: str) -> dict[str, torch.Tensor]:
    x, scores, indices, grad = w["xs"][0], w["scores"][0], w["indices"][0], w["grads"][0]
    dim, hidden, experts, top_k = x.shape[1], w["w1"].shape[1], w["w1"].shape[0], indices.shape[1]
    sizes = dict(num_tokens=x.shape[0], dim=dim, hidden=hidden, num_experts=experts, top_k=top_k, dtype=x.dtype,
                 device=x.device, params=params)
    fwd_ws, bwd_ws = Workspace.for_group(group, **sizes), BackwardWorkspace.for_group(group, **sizes)
    h13 = torch.full((fwd_ws.shape.slot_capacity, 2 * hidden), float("nan"), dtype=x.dtype, device=x.device)
    out = moe_forward(x, scores, indices, w["w1"], w["w2"], w["w3"], workspace=fwd_ws, schedule=schedule,
                      score_before_experts=score_before, params=params, saved_h13=h13, error_check="sync")
    grads = moe_backward(grad, x, scores, indices, w["w1"], w["w2"], w["w3"], workspace=bwd_ws, schedule=schedule,
                         score_before_experts=score_before, params=params, saved_h13=h13, error_check="sync")
    used = indices.numel()
    return {"out": out.clone(), "h13": h13[:used].clone(), **{n: g.clone() for n, g in zip(NAMES, grads)}}


REAL_CASES = [("d576_h744_e20_k4", False, "bfloat16"), ("d1000_h1440_e12_k3", True, "bfloat16"),
              ("d1536_h1408_e64_k6", False, "float16")]


@pytest.mark.parametrize("shape_name,score_before,dtype", REAL_CASES,
                         ids=[f"{s}-{'before' if b else 'after'}-{d}" for s, b, d in REAL_CASES])
def test_sampled_point_on_the_real_path_gives_the_default_points_bits(one_rank_group, shape_name, score_before,
                                                                      dtype):
    dtype = getattr(torch, dtype)
    shape = layer_shape(shape_name, 1, dtype, score_before)
    base = default_params(1, hidden=shape.hidden)
    seed = SEED + 1000 + REAL_CASES.index((shape_name, score_before, str(dtype).removeprefix("torch.")))
    rng = random.Random(seed)
    point = sample(rng, shape, base=base, hw=default_constants("NVIDIA H200"))
    schedule = rng.choice(("sequential", "fused"))
    w = world_inputs(shape_name, 1, dtype)
    ref = run_real(one_rank_group, w, base, score_before, "sequential")
    got = run_real(one_rank_group, w, point, score_before, schedule)
    differ = differing(ref, got)
    assert not differ, f"seed {seed}, {schedule}, {changed_fields(point, base)}: bits differ in {differ}"
    # The real path and the simulated one-rank world are the same kernels: the same bits.
    sim = run_simulated(w, base, score_before, "sequential")
    assert not differing({k: v for k, v in ref.items()}, {k.removesuffix(".r0"): v for k, v in sim.items()})


def test_tuner_refuses_to_cache_a_point_that_changes_bits(one_rank_group, monkeypatch):
    """A pick whose dH tile width differs from the default's (a numerics field:
    the router-score gradient sums one fp32 partial per dH column block, so
    other bits with scores after the experts; the one-field check shows it on
    every GPU shape) planted as both directions' choice: the search caches
    nothing and its refusal names the field and the tensors."""
    from titan_uniep.tuning import search

    layer = search.MoELayer("planted", 512, 576, 744, 20, 4)
    default = default_params(1, hidden=layer.hidden)
    planted = default.replace(dh_block_n=64 if default.dh_block_n != 64 else 32)

    def two_candidates(layer, stats, world, direction, options, hw, ranked=None, best_out=None):
        from titan_uniep.tuning.model import predict

        shape = search.layer_shape(layer, world)
        if best_out is not None:
            best_out.append(default)
        return [(p, predict(shape, stats, world, p, hw)) for p in (default, planted)]

    monkeypatch.setattr(search, "candidates", two_candidates)
    # Whatever was measured, the planted point is picked for both directions (pick's own check bypassed).
    monkeypatch.setattr(search, "pick", lambda measured, names, default_name, min_gain, same_bits:
                        (search.label(planted, default), [], []))
    options = search.SearchOptions(top=1, warmup=1, reps=1, rounds=1, confirm_rounds=1, neighbours=False,
                                   progress=False)
    result = search.search_layer(one_rank_group, layer, options)
    assert result.entry is None, "a point that changes bits was cached"
    (message,) = result.violations
    assert "dh_block_n" in message and "refused" in message and "dscores" in message, message


def test_the_search_times_the_backward_with_the_layers_weight_gradient_dtype(one_rank_group, monkeypatch):
    """A layer whose training writes fp32 weight gradients (fp32 master
    weights) is timed that way, and the weight-gradient kernel's tile choices
    are among its backward candidates; the entry records the dtype."""
    from titan_uniep.tuning import search

    layer = search.MoELayer("fp32 grads", 512, 576, 744, 20, 4, weight_grad_dtype=torch.float32)
    timing, timed_dtypes = [False], set()
    real_backward, real_timing = search.moe_backward, search.time_alternating

    def recording_backward(*args, weight_grad_dtype=None, **kwargs):
        if timing[0]:
            timed_dtypes.add(weight_grad_dtype)
        return real_backward(*args, weight_grad_dtype=weight_grad_dtype, **kwargs)

    def flagged_timing(*args, **kwargs):
        timing[0] = True
        try:
            return real_timing(*args, **kwargs)
        finally:
            timing[0] = False

    monkeypatch.setattr(search, "moe_backward", recording_backward)
    monkeypatch.setattr(search, "time_alternating", flagged_timing)
    options = search.SearchOptions(top=1, warmup=1, reps=2, rounds=1, confirm_rounds=1, progress=False)
    result = search.search_layer(one_rank_group, layer, options)
    assert timed_dtypes == {torch.float32}
    backward_points = [row["point"] for row in result.table["backward"]]
    assert any("wgrad_w13_block_m" in name for name in backward_points), backward_points
    assert not result.violations and result.entry is not None
    assert result.entry.weight_grad_dtype == "float32"
