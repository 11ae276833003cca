"""The measured search's decisions, without a GPU: which candidates the model's
ranking yields (a fake model and space: these tests must not depend on the
model's numbers), which measured point is cached, the alternating timing
order, and the MoE shapes of a train config."""

from __future__ import annotations

import dataclasses
import sys
import types
import weakref
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
from torchtitan_release import torchtitan_0_2
import torch

from titan_uniep import timing
from titan_uniep.params import default_params
from titan_uniep.tools import tune
from titan_uniep.tuning import search

REPO = Path(__file__).resolve().parents[1]
LAYER = search.MoELayer("layer", 4096, 2048, 768, 128, 8)


@dataclass(frozen=True)
class FakeShape:
    tokens: int
    dim: int
    hidden: int
    num_experts: int
    top_k: int
    ep_size: int
    dtype_bytes: int = 2
    score_before_experts: bool = False
    weight_grad_bytes: int | None = None

    def grouped_mm_weight_grads(self, backend):
        return backend == "auto" and self.weight_grad_bytes in (None, self.dtype_bytes)


def _field(kind, stage, order_key=None):
    return SimpleNamespace(kind=kind, stage=stage, order_key=order_key)


@pytest.fixture
def fake_model(monkeypatch):
    """A space of a few fields and a model that ranks the points in the given order."""
    space = types.ModuleType("titan_uniep.tuning.space")
    space.LayerShape = FakeShape
    space.FIELDS = {
        "block_m": _field("schedule", "all"),
        "dispatch_programs": _field("schedule", "dispatch"),
        "fc1_block_n": _field("schedule", "fc1"),
        "fc1_num_warps": _field("schedule", "fc1"),
        "fc2_block_n": _field("schedule", "fc2"),
        "fc2_tma": _field("schedule", "fc2"),
        "fc1_block_k": _field("numerics", "fc1"),
        "reduce_block_dim": _field("mixed", "fc2", lambda v: min(v, 256)),  # (a forward stage in this space)
        "da_num_warps": _field("schedule", "da"),
        "da_block_n": _field("schedule", "da"),
        "reduce_block_tokens": _field("schedule", "reduce"),
        "wgrad_w13_block_m": _field("schedule", "wgrad"),
        "wgrad_w2_num_stages": _field("schedule", "wgrad"),
        "timeout_s": _field("fixed", "all"),
    }
    space.WGRAD_CHOICES = {}
    space.points, space.times = [], None
    space.enumerate_points = lambda shape, numerics, hw: iter(space.points)
    space.feasible = lambda point, shape, hw: "too big" if point.fc2_block_n == 16 else None
    model = types.ModuleType("titan_uniep.tuning.model")

    def predict(shape, stats, world, params, hw, schedule):
        return SimpleNamespace(forward_total=float(params.fc2_block_n), backward_total=float(params.da_num_warps),
                               forward={}, backward={})

    def rank(shape, stats, world, points, hw, schedule):  # the given order, or space.times
        times = space.times or range(1, len(space.points) + 1)
        return [(p, SimpleNamespace(forward_total=float(t), backward_total=float(t))) for p, t in zip(points, times)]

    model.predict = predict
    model.rank = rank
    monkeypatch.setitem(sys.modules, "titan_uniep.tuning.space", space)
    monkeypatch.setitem(sys.modules, "titan_uniep.tuning.model", model)
    return space


def test_candidates_are_the_default_then_the_best_distinct_projected_points(fake_model):
    base = default_params(1, hidden=768)
    fake_model.points = [
        base.replace(fc2_block_n=256, da_num_warps=8),  # the backward field is dropped for the forward
        base.replace(fc2_block_n=256),  # the same forward point again
        base.replace(fc2_block_n=16),  # infeasible
        base.replace(fc1_block_k=32, dispatch_programs=32),  # numerics field reset: dispatch only
        base.replace(reduce_block_dim=128),  # changes bits: projects onto the default, a repeat
        base.replace(reduce_block_dim=1024, timeout_s=5.0),  # keeps the bits (as 512); timeouts are never tuned
        base.replace(block_m=64),
    ]
    options = search.SearchOptions(top=3, neighbours=False)
    got = [p for p, _ in search.candidates(LAYER, None, 1, "forward", options, None)]
    assert got == [base, base.replace(fc2_block_n=256), base.replace(dispatch_programs=32),
                   base.replace(reduce_block_dim=1024)]
    got = [p for p, _ in search.candidates(LAYER, None, 1, "backward", options, None)]
    assert got == [base, base.replace(da_num_warps=8), base.replace(dispatch_programs=32),
                   base.replace(block_m=64)]
    numerics = [p for p, _ in search.candidates(LAYER, None, 1, "forward",
                                                search.SearchOptions(top=9, numerics=True, neighbours=False), None)]
    assert base.replace(fc1_block_k=32, dispatch_programs=32) in numerics
    assert base.replace(reduce_block_dim=128) in numerics


def test_of_points_the_model_cannot_tell_apart_the_simplest_is_measured(fake_model):
    base = default_params(1, hidden=768)
    fake_model.points = [base.replace(fc2_block_n=256, dispatch_programs=32, block_m=64),
                         base.replace(fc2_block_n=256, dispatch_programs=32),
                         base.replace(fc2_block_n=256),  # the simplest of the tie
                         base.replace(dispatch_programs=64, block_m=64),
                         base.replace(dispatch_programs=16)]
    fake_model.times = [2.0, 2.0, 2.001, 3.0, 4.0]
    got = [p for p, _ in search.candidates(LAYER, None, 1, "forward", search.SearchOptions(top=2, neighbours=False),
                                           None)]
    assert got == [base, base.replace(fc2_block_n=256), base.replace(dispatch_programs=64, block_m=64)]


def test_neighbours_swap_one_gemm_stage_of_the_models_best_and_the_measured_best_choices_combine(fake_model):
    base = default_params(1, hidden=768)
    fake_model.GRID_STAGES = {
        ("fc1_block_n", "fc1_num_warps"): ((128, 8), (64, 4)),
        ("fc2_block_n", "fc2_tma"): ((128, False), (128, True), (256, False), (16, False)),
        ("da_block_n",): ((128,), (64,)),
        ("reduce_block_tokens",): ((16,), (32,)),
    }
    fake_model.repeats_another = lambda point, shape: point.fc2_tma and point.fc2_block_n == 256
    best = base.replace(dispatch_programs=32)
    fake_model.points = [best, base.replace(block_m=64)]
    out = []
    got = [p for p, _ in search.candidates(LAYER, None, 1, "forward", search.SearchOptions(top=1), None, best_out=out)]
    assert out == [best]
    # the default, the model's best, then each other fc1 and fc2 choice on the best (fc2 16 wide is
    # infeasible in the fake space; backward and reduce stages are not forward neighbours)
    assert got == [base, best, best.replace(fc1_block_n=64, fc1_num_warps=4), best.replace(fc2_tma=True),
                   best.replace(fc2_block_n=256)]
    back = [p for p, _ in search.candidates(LAYER, None, 1, "backward", search.SearchOptions(top=1), None)]
    assert back == [base, best, best.replace(da_block_n=64)]
    # No model point at all: the neighbours are the default's.
    fake_model.points = []
    out = []
    got = [p for p, _ in search.candidates(LAYER, None, 1, "forward", search.SearchOptions(top=1), None, best_out=out)]
    assert out == [base] and got[0] == base and got[1] == base.replace(fc1_block_n=64, fc1_num_warps=4)

    # The combination takes each stage's fastest choice that beat the best, and only those.
    fc1 = best.replace(fc1_block_n=64, fc1_num_warps=4)
    tma, wide = best.replace(fc2_tma=True), best.replace(fc2_block_n=256)
    measured = {base: 2.6, best: 2.5, fc1: 2.4, tma: 2.45, wide: 2.3, base.replace(block_m=64): 1.0}
    assert search.combined_choices(best, measured, "forward") == best.replace(fc1_block_n=64, fc1_num_warps=4,
                                                                              fc2_block_n=256)
    measured.update({fc1: 2.6, wide: None})
    assert search.combined_choices(best, measured, "forward") == tma  # fc1's choice lost, wide failed
    assert search.combined_choices(best, {best: None, tma: 1.0}, "forward") == best  # the best failed: no step


def test_weight_gradient_tiles_are_backward_neighbours_where_the_triton_kernel_writes_fp32_gradients(fake_model):
    base = default_params(1, hidden=768)
    fake_model.GRID_STAGES = {("fc1_block_n",): ((128,), (64,)), ("da_block_n",): ((128,), (64,))}
    fake_model.WGRAD_CHOICES = {("wgrad_w13_block_m", "wgrad_w2_num_stages"): (
        (base.wgrad_w13_block_m, base.wgrad_w2_num_stages), (64, base.wgrad_w2_num_stages), (64, 4))}
    fake_model.repeats_another = lambda point, shape: False
    fake_model.points = [base.replace(dispatch_programs=32)]
    best = fake_model.points[0]
    wgrad = [best.replace(wgrad_w13_block_m=64), best.replace(wgrad_w13_block_m=64, wgrad_w2_num_stages=4)]
    options = search.SearchOptions(top=1)
    fp32 = dataclasses.replace(LAYER, weight_grad_dtype=torch.float32)
    for layer, direction, want in ((LAYER, "backward", [best.replace(da_block_n=64)]),
                                   (dataclasses.replace(LAYER, weight_grad_dtype=torch.bfloat16), "backward",
                                    [best.replace(da_block_n=64)]),
                                   (fp32, "backward", [best.replace(da_block_n=64), *wgrad]),
                                   (fp32, "forward", [best.replace(fc1_block_n=64)])):
        got = [p for p, _ in search.candidates(layer, None, 1, direction, options, None)]
        assert got == [base, best, *want], (layer.weight_grad_dtype, direction)
    # The combination adopts the weight-gradient choice only where those tiles are neighbours.
    measured = {best: 2.5, wgrad[0]: 2.6, wgrad[1]: 2.2, best.replace(da_block_n=64): 2.4}
    shape = search.layer_shape(fp32, 1)
    assert search.combined_choices(best, measured, "backward", shape) == wgrad[1].replace(da_block_n=64)
    assert search.combined_choices(best, measured, "backward", search.layer_shape(LAYER, 1)) == \
        best.replace(da_block_n=64)


def test_pick_takes_the_fastest_point_with_the_default_bits():
    measured = {"default": 10.0, "numerics": 7.0, "broken": 7.5, "good": 8.0, "better_but_failed": None, "tie": 9.9}
    kinds = {"numerics": (False, False), "broken": (False, True), "good": (True, True), "tie": (True, True)}
    asked = []

    def same_bits(name):
        asked.append(name)
        return kinds[name]

    chosen, notes, violations = search.pick(measured, list(measured), "default", 0.02, same_bits)
    assert chosen == "good" and asked == ["numerics", "broken", "good"]
    assert notes == ["numerics: 1.429x faster but changes bits (not cached)"]
    assert violations == ["broken: a schedule point whose bits differ from the default's"]
    # Within min_gain of the default (9.9 vs 10.0): the default stays, nothing is verified.
    asked.clear()
    assert search.pick({"default": 10.0, "tie": 9.9}, ["default", "tie"], "default", 0.02, same_bits)[0] == "default"
    assert asked == []
    # Every faster point changes bits: the default.
    chosen, notes, _ = search.pick({"default": 10.0, "numerics": 7.0}, ["default", "numerics"], "default", 0.02,
                                   same_bits)
    assert chosen == "default" and len(notes) == 1
    assert search.pick({"default": 5.0, "good": 8.0}, ["default", "good"], "default", 0.0, same_bits)[0] == "default"


def test_changed_fields_are_the_cache_form_of_a_point():
    base = default_params(2, hidden=768)
    point = base.replace(fc2_block_n=256, local_first=True)
    assert search.changed_fields(point, base) == {"fc2_block_n": 256, "local_first": True}
    assert base.replace(**search.changed_fields(point, base)) == point
    assert search.label(base, base) == "default" and search.label(point, base) == "local_first=True,fc2_block_n=256"


def test_alternating_rounds_build_each_path_alone_and_drop_a_failing_one(monkeypatch):
    built, timed, returned, problems, alive = [], [], {}, [], []

    class TimedPath:
        def __init__(self, name):
            self.name = name

        def __call__(self):
            return None

    def builder(name):
        def build():
            if any(ref() is not None for ref in alive):
                problems.append(f"{name} built while an earlier path was alive")
            built.append(name)
            path = TimedPath(name)
            alive.append(weakref.ref(path))
            if name == "broken":
                raise RuntimeError("no kernel for this point")
            return path
        return build

    def fake_time_ms(fn, warmup, reps, group=None):
        timed.append(fn.name)
        ms = {"a": 1.0, "b": 2.0, "c": 3.0}[fn.name] + len(timed) / 100
        returned.setdefault(fn.name, []).append(ms)
        return ms

    monkeypatch.setattr(timing, "time_ms", fake_time_ms)
    errors, seen = [], []
    out = timing.time_alternating({n: builder(n) for n in ("a", "broken", "b", "c")}, warmup=1, reps=1, rounds=3,
                                  on_error=lambda name, trace: errors.append((name, trace.splitlines()[-1])),
                                  after_each=lambda name, ms: seen.append(name))
    assert timed == ["a", "b", "c", "c", "b", "a", "a", "b", "c"]
    assert built.count("b") == 3 and built.count("broken") == 1, built
    assert problems == []
    assert errors == [("broken", "RuntimeError: no kernel for this point")]
    assert out["broken"] is None
    assert all(out[name] == sorted(values)[1] for name, values in returned.items())
    assert seen.count("broken") == 1 and len(seen) == 10


@torchtitan_0_2  # a TorchTitan 0.2.2 TOML
def test_config_layers_reads_the_moe_shape_of_a_train_config():
    layers, ep = tune.config_layers(str(REPO / "train_configs" / "qwen3_30b_a3b_4l_uniep.toml"))
    assert ep == 1
    # One GPU: no FSDP, fp32 parameters under AMP, bf16 GEMMs: fp32 master weights' gradients.
    assert [(l.dims, l.score_before_experts, l.dtype, l.weight_grad_dtype) for l in layers] == [
        ((2 * 4096, 2048, 768, 128, 8), False, torch.bfloat16, torch.float32)]
    # Two GPUs (dp_shard -1 -> 2): FSDP hands the experts bf16 weights, whose gradients are bf16.
    layers, _ = tune.config_layers(str(REPO / "train_configs" / "qwen3_30b_a3b_4l_uniep.toml"), 2)
    assert [l.weight_grad_dtype for l in layers] == [None]
    layers, ep = tune.config_layers(str(REPO / "train_configs" / "qwen3_debug_moe_uniep.toml"), 2)
    assert ep == 2 and {l.weight_grad_dtype for l in layers} == {None}


@torchtitan_0_2
def test_the_command_line_sets_the_weight_gradients_dtype_the_backward_is_timed_in():
    parser = tune.build_parser()
    config = str(REPO / "train_configs" / "qwen3_30b_a3b_4l_uniep.toml")
    for argv, want in ((["--shape", "qwen3_1gpu"], None),
                       (["--shape", "qwen3_1gpu", "--weight-grad-dtype", "float32"], torch.float32),
                       (["--config", config], torch.float32),
                       (["--config", config, "--weight-grad-dtype", "data"], None)):
        (layer,) = tune.requested_layers(parser, parser.parse_args(argv), 1)
        assert layer.weight_grad_dtype == want, argv
        assert search.layer_shape(layer, 1).grad_bytes == (4 if want else 2)


def test_the_confirmation_run_takes_the_fastest_the_default_and_the_combined_choices(fake_model):
    base = default_params(1, hidden=768)
    fake_model.GRID_STAGES = {
        ("fc1_block_n", "fc1_num_warps"): ((128, 8), (64, 4)),
        ("fc2_block_n", "fc2_tma"): ((128, False), (128, True)),
    }
    fake_model.repeats_another = lambda point, shape: False
    best = base.replace(dispatch_programs=32)
    fc1, tma = best.replace(fc1_block_n=64, fc1_num_warps=4), best.replace(fc2_tma=True)
    names = {p: search.label(p, base) for p in (base, best, fc1, tma)}
    points = {names[p]: p for p in names}

    def timed(default_ms, best_ms, fc1_ms, tma_ms):
        return dict(zip(points, (default_ms, best_ms, fc1_ms, tma_ms)))

    times = timed(2.6, 2.5, 2.45, 2.4)
    plain = search.SearchOptions(neighbours=False)
    assert search.confirmation_set(times, points, base, best, "forward", plain, None, None) == \
        (["default", names[tma]], {})
    # With neighbours: also the model's best with both stages' faster choices, a new point.
    final, new = search.confirmation_set(times, points, base, best, "forward", search.SearchOptions(), None, None)
    both = best.replace(fc1_block_n=64, fc1_num_warps=4, fc2_tma=True)
    assert new == {search.label(both, base): both} and final == ["default", names[tma], search.label(both, base)]
    # One stage's choice beat the best: that neighbour, already measured, is confirmed, not a new point.
    final, new = search.confirmation_set(timed(2.6, 2.5, 2.7, 2.55), points, base, best, "forward",
                                         search.SearchOptions(), None, None)
    assert final == ["default", names[best]] and new == {}
    final, new = search.confirmation_set(timed(2.6, 2.5, 2.7, 2.45), points, base, best, "forward",
                                         search.SearchOptions(), None, None)
    assert final == ["default", names[tma]] and new == {}
    # The default is the fastest and no stage choice beat the best: nothing to confirm (no second run).
    final, new = search.confirmation_set(timed(2.0, 2.5, 2.6, None), points, base, best, "forward",
                                         search.SearchOptions(), None, None)
    assert final == ["default"] and new == {}
    # A combination the space rejects is not measured.
    fake_model.feasible = lambda point, shape, hw: "too big" if point == both else None
    assert search.confirmation_set(times, points, base, best, "forward", search.SearchOptions(), None, None) == \
        (["default", names[tma]], {})


def test_the_tuned_entry_is_verified_with_the_weight_gradients_in_each_dtype():
    """``verify_entry`` compares the weight gradients also in fp32 (fp32 master
    weights), where a tile field of the weight-gradient kernel reaches the
    stored sums: a point whose fp32 gradients alone differ is named."""
    import torch.distributed as dist

    default = default_params(1, hidden=768)
    tuned = default.replace(wgrad_w13_num_warps=4 if default.wgrad_w13_num_warps != 4 else 8)
    h13 = torch.zeros(4, 2)
    gen = torch.Generator().manual_seed(3)
    dx, ds, w = torch.randn(5, 2, generator=gen), torch.rand(5, 2, generator=gen), torch.randn(3, 2, generator=gen)

    def forward(point):
        h13.copy_(torch.arange(8.0).view(4, 2))
        return dx * 2

    def backward_of(differs_in):
        def backward(point, weight_grad_dtype):
            dtype = weight_grad_dtype or torch.bfloat16
            grads = [w.to(dtype) for _ in range(3)]
            if point is tuned and weight_grad_dtype == differs_in:
                grads[0] = grads[0] * (1 + 2**-20)  # below bf16's precision, within fp32's
            return (dx.clone(), ds.clone(), *grads)
        return backward

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        group = dist.group.WORLD
        assert search.verify_entry(forward, backward_of(torch.float32), default, default, tuned, h13, group,
                                   "cpu") == ["dw1 in float32"]
        assert search.verify_entry(forward, backward_of("never"), default, default, tuned, h13, group, "cpu") == []
        assert search.BACKWARD_NAMES[2:5] == ("dw1", "dw2", "dw3")
    finally:
        dist.destroy_process_group()
