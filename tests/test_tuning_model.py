"""The tuner's constraints, grid and analytic model (CPU, no kernels).

Constraints: what the H200 runs is feasible (the tuned defaults, the
measured two-programs-per-SM variants), what it cannot run is rejected with
the reason (shared memory, registers, grid residency, the field
constraints). Grid: 10^4 points or more per shape, all feasible, all with
the base point's numerics. Model: ranks 10^4 points in under a second, grows
with tokens and with EP traffic, explains every stage, reproduces the
routing's byte counts of ``layout.py``, and stays near the measured layer
times of ``docs/performance.md`` before any calibration.
"""

import dataclasses
import json
import random
import time

import numpy as np
import pytest
import torch

from titan_uniep.layout import compute_layout, count_per_expert, token_destinations
from titan_uniep.params import DEFAULTS, LayerParams, default_params
from titan_uniep.tuning import calibrate
from titan_uniep.tuning.hardware import clock_factor, tile_key
from titan_uniep.tuning.model import (
    BACKWARD_STAGES,
    FORWARD_STAGES,
    RoutingStats,
    default_constants,
    load_constants,
    predict,
    rank,
    save_constants,
)
from titan_uniep.tuning.space import (
    FIELDS,
    LayerShape,
    enumerate_points,
    feasible,
    keeps_bits,
    numerics_fields,
    sample,
    schedule_fields,
)

H200 = default_constants("NVIDIA H200")
# docs/performance.md's bench shapes: T per rank, D, H, E, K
SHAPES = {"qwen3": (8192, 2048, 768, 128, 8), "deepseek": (4096, 7168, 2048, 256, 8),
          "mixtral": (8192, 4096, 14336, 8, 2)}


def layer(name: str, world: int = 2, tokens: int | None = None) -> tuple[LayerShape, RoutingStats]:
    t, d, h, e, k = SHAPES[name]
    t = tokens or t
    return LayerShape(t, d, h, e, k, world, 2), RoutingStats.uniform(t, e, k, world)


# ---- the table ---------------------------------------------------------------------


def test_every_layer_params_field_has_one_kind():
    """Every field's kind, stated a second time by rule, so that an edit of
    the table that calls a numerics field "schedule" (the search would then
    change a run's bits) fails here: every GEMM's K step sets an fp32
    summation order, the weight gradients' over an expert's rows included
    (``test_tuning_space.py`` shows their bits change); waits and testing
    hooks are fixed; the rest are schedule fields."""
    assert set(FIELDS) == {f.name for f in dataclasses.fields(LayerParams)}
    k_steps = {name for name in FIELDS if name.endswith("_block_k")}
    assert k_steps == {"fc1_block_k", "fc2_block_k", "dh_block_k", "da_block_k", "wgrad_w13_block_k",
                       "wgrad_w2_block_k"}
    fixed = {"timeout_s", "interpreter_max_spins"} | {name for name in FIELDS if name.startswith("debug_")}
    kinds = {name: "schedule" for name in FIELDS}
    kinds.update({name: "numerics" for name in k_steps | {"dh_block_n", "wgrad_backend"}})
    kinds.update({name: "fixed" for name in fixed})
    kinds["reduce_block_dim"] = "mixed"  # some values keep the bits
    wrong = {name: f"{field.kind}, expected {kinds[name]}" for name, field in FIELDS.items()
             if field.kind != kinds[name]}
    assert not wrong, wrong
    schedule, numerics = set(schedule_fields()), set(numerics_fields())
    assert schedule & numerics == {"reduce_block_dim"}
    assert schedule | numerics == set(FIELDS) - fixed
    base = LayerParams()
    assert keeps_bits(base.replace(reduce_block_dim=1024), base) is None  # 512 and 1024: 256 in da_combine
    assert keeps_bits(base.replace(reduce_block_dim=128), base) == "reduce_block_dim"


# ---- constraints -----------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(SHAPES))
@pytest.mark.parametrize("world", [1, 2, 4])
def test_tuned_defaults_are_feasible_on_an_h200(name, world):
    shape, _ = layer(name, world)
    assert feasible(default_params(world, hidden=shape.hidden), shape, H200) is None


def test_measured_variants_fit_and_the_one_that_did_not_fit_is_rejected():
    shape, _ = layer("qwen3")
    base = DEFAULTS[(2, "short")]
    # docs/design.md: fc2 at 8 warps, maxnreg 128, two per SM ran; dA 256 wide "does not fit the shared memory"
    assert feasible(base.replace(fc2_num_warps=8, fc2_max_registers=128), shape, H200) is None
    why = feasible(DEFAULTS[(2, "long")].replace(da_block_n=256), shape, H200)
    assert why and "da_combine" in why and "shared memory" in why, why


@pytest.mark.parametrize("changes, words", [
    (dict(fc1_block_n=256, fc1_block_k=128, fc1_num_stages=4), ("dispatch_fc1", "shared memory")),
    (dict(fc2_block_n=256, fc2_num_warps=4), ("fc2_combine", "accumulator registers")),
    (dict(fc2_block_n=128, fc2_num_warps=8, fc2_programs_per_sm=2), ("fc2_combine", "registers", "max_registers")),
    (dict(da_block_k=64, da_num_warps=4, da_programs_per_sm=2), ("da_combine", "2 program(s) x 192 KiB", "per SM")),
    (dict(num_programs=200, dispatch_programs=8), ("num_programs", "SMs")),
])
def test_infeasible_points_are_rejected_with_their_reason(changes, words):
    shape, _ = layer("qwen3")
    point = LayerParams().replace(**changes)
    why = feasible(point, shape, H200)
    assert why is not None and all(w in why for w in words), why


def test_samples_are_valid_feasible_and_keep_the_numerics():
    shape, _ = layer("deepseek")
    base = shape.default_params()
    rng = random.Random(5)
    for _ in range(50):
        point = sample(rng, shape, hw=H200)
        assert feasible(point, shape, H200) is None and keeps_bits(point, base) is None
        assert LayerParams(**point.__dict__) == point


# ---- the grid ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["qwen3", "mixtral"])
def test_grid_has_10k_feasible_distinct_points_with_the_base_numerics(name):
    shape, _ = layer(name)
    base = shape.default_params()
    points = list(enumerate_points(shape, limit=10_000))
    assert len(points) == 10_000
    assert len({tuple(p.__dict__.values()) for p in points}) == len(points)
    for point in random.Random(3).sample(points, 200):
        assert feasible(point, shape, H200) is None
        assert keeps_bits(point, base) is None
        assert LayerParams(**point.__dict__) == point  # every grid value passes the field checks
    assert any(keeps_bits(p, base) for p in enumerate_points(shape, numerics=True))


# ---- the model ---------------------------------------------------------------------------


def test_ranks_10k_points_in_under_a_second():
    shape, stats = layer("qwen3")
    points = list(enumerate_points(shape, limit=10_000))
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        ranking = rank(shape, stats, 2, points, H200)
        best = min(best, time.perf_counter() - start)
    assert len(ranking) == 10_000
    totals = [p.total for _, p in ranking[:50]]
    assert totals == sorted(totals)
    assert best < 1.0, f"ranking 10^4 points took {best:.2f} s"


def test_rank_agrees_with_predict_point_by_point():
    shape, stats = layer("deepseek")
    points = list(enumerate_points(shape, limit=300))[::37]
    ranking = rank(shape, stats, 2, points, H200)
    for params, pred in ranking:
        alone = predict(shape, stats, 2, params, H200)
        assert alone.forward == pred.forward and alone.backward == pred.backward
        assert alone.total == pytest.approx(pred.total)


@pytest.mark.parametrize("name", sorted(SHAPES))
@pytest.mark.parametrize("schedule", ["fused", "sequential"])
def test_time_grows_with_tokens(name, schedule):
    totals = []
    for tokens in (512, 1024, 2048, 4096, 8192):
        shape, stats = layer(name, tokens=tokens)
        pred = predict(shape, stats, 2, shape.default_params(), H200, schedule=schedule)
        totals.append((pred.forward_total, pred.backward_total))
    for (f0, b0), (f1, b1) in zip(totals, totals[1:]):
        assert f1 > f0 and b1 > b0, totals


def test_more_ranks_send_more_and_dispatch_longer():
    sent, dispatch = [], []
    for world in (2, 4, 8):
        shape, stats = layer("qwen3", world)
        sent.append(stats.dedup_bytes(shape.dim, 2).sum(axis=1).max())
        dispatch.append(predict(shape, stats, world, shape.default_params(), H200).forward["dispatch"])
    assert sent[0] < sent[1] < sent[2] and dispatch[0] < dispatch[1] < dispatch[2], (sent, dispatch)
    shape, stats = layer("qwen3", 1)
    assert stats.dedup_bytes(shape.dim, 2).sum() == 0


def test_one_rank_dispatch_copies_no_rows():
    """At EP = 1 the tiles read x in place (``scoreboard.token_rows_of``): the
    dispatch costs the same whatever D is, and the D-wide ``[x | dOut]`` rows
    of the backward cost no more than the forward's x rows; with peers both
    grow with D."""
    times = {}
    for world in (1, 2):
        for dim in (2048, 7168):
            shape, stats = layer("qwen3", world)
            shape = dataclasses.replace(shape, dim=dim)
            pred = predict(shape, stats, world, shape.default_params(), H200)
            times[world, dim] = (pred.forward["dispatch"], pred.backward["dispatch"])
    assert times[1, 2048] == times[1, 7168] and times[1, 2048][0] == times[1, 2048][1], times
    assert times[2, 7168][0] > 2 * times[2, 2048][0] and times[2, 2048][1] > 1.5 * times[2, 2048][0], times


def test_fc1_one_product_tile_is_priced_only_where_it_runs():
    """``fc1_one_dot`` runs with scores after the experts only
    (``runtime.forward``): with scores before, the model prices the
    two-product tile whatever the field says."""
    shape, stats = layer("qwen3")
    one, two = shape.default_params(), shape.default_params().replace(fc1_one_dot=False)
    assert one.fc1_one_dot
    tile = (one.block_m, 2 * one.fc1_block_n, one.fc1_block_k, one.fc1_num_warps, one.fc1_num_stages, 1)
    hw = dataclasses.replace(H200, gemm_efficiency={tile_key("fc1", *tile): 0.6, tile_key("fc1_one", *tile): 0.9})
    fc1 = lambda s, p: predict(s, stats, 2, p, hw).forward["fc1"]  # noqa: E731
    assert fc1(shape, one) < 0.8 * fc1(shape, two)
    before = dataclasses.replace(shape, score_before_experts=True)
    assert fc1(before, one) == fc1(before, two) == fc1(shape, two)


def test_skewed_routing_is_slower_than_balanced():
    shape, uniform = layer("qwen3")
    gen = torch.Generator().manual_seed(0)
    t, e, k = shape.tokens, shape.num_experts, shape.top_k
    hot = [torch.rand(t, e // 2, generator=gen).argsort(1)[:, :k] for _ in range(2)]  # every copy to rank 0
    skewed = RoutingStats.from_indices(hot, e, 2)
    params = shape.default_params()
    assert predict(shape, skewed, 2, params, H200).total > 1.3 * predict(shape, uniform, 2, params, H200).total


def test_routing_stats_count_what_the_layout_sends():
    world, experts, top_k, tokens = 4, 16, 3, 200
    gen = torch.Generator().manual_seed(11)
    indices = [torch.rand(tokens - 37 * r, experts, generator=gen).argsort(1)[:, :top_k] for r in range(world)]
    counts_all = torch.stack([count_per_expert(i, experts) for i in indices])
    stats = RoutingStats.from_indices(indices, experts, world)
    for r, idx in enumerate(indices):
        lay = compute_layout(idx, counts_all, r)
        assert np.array_equal(stats.send_copies[r], lay.send_counts.numpy())
        assert np.array_equal(stats.send_rows[r], token_destinations(lay).sum(0).numpy())
        assert stats.tokens[r] == len(idx)
    assert np.array_equal(stats.expert_rows, counts_all.sum(0).numpy())
    big = RoutingStats.from_indices([torch.rand(20000, experts, generator=gen).argsort(1)[:, :top_k]
                                     for _ in range(world)], experts, world)
    uniform = RoutingStats.uniform(20000, experts, top_k, world)
    for name in ("expert_rows", "send_rows", "send_copies"):
        np.testing.assert_allclose(getattr(big, name), getattr(uniform, name), rtol=0.03)


def test_prediction_table_explains_every_stage():
    shape, stats = layer("qwen3")
    pred = predict(shape, stats, 2, shape.default_params(), H200)
    table = pred.table()
    for direction, stages in (("forward", FORWARD_STAGES), ("backward", BACKWARD_STAGES)):
        assert tuple(getattr(pred, direction)) == stages
        for stage in stages:
            assert f"| {direction}.{stage} |" in table
    assert f"**{pred.total:.4f}**" in table
    assert pred.forward_total <= sum(pred.forward.values())  # the fused schedule overlaps, never adds
    seq = predict(shape, stats, 2, shape.default_params(), H200, schedule="sequential")
    assert seq.forward_total == pytest.approx(sum(seq.forward.values()))


# measured on 2 x H200, docs/performance.md (fused forward, fused backward alone; ms)
MEASURED = {"qwen3": (1.513, 3.07), "deepseek": (6.717, 15.86), "mixtral": (9.414, 21.94)}


@pytest.mark.parametrize("name", sorted(MEASURED))
def test_uncalibrated_model_is_near_the_measured_h200_times(name):
    shape, stats = layer(name)
    pred = predict(shape, stats, 2, shape.default_params(), H200)
    forward, backward = MEASURED[name]
    assert pred.forward_total == pytest.approx(forward, rel=0.25)
    assert pred.backward_total == pytest.approx(backward, rel=0.25)


def test_constants_round_trip_and_unknown_keys_are_rejected(tmp_path):
    hw = dataclasses.replace(H200, gemm_efficiency={"fc1:128x256x64:w8:s3:p1": 0.6}, stage_scale={"forward.fc1": 1.1})
    path = tmp_path / "hw.json"
    save_constants(hw, path)
    assert load_constants(path) == hw
    path.write_text(json.dumps({"name": "NVIDIA H200", "hbm_gbs": 1.0}))
    with pytest.raises(ValueError, match="hbm_gbs"):
        load_constants(path)


def test_constants_files_from_before_the_recomputing_backward_was_removed_still_load(tmp_path):
    """A file that still holds the removed path's constants (its one-pass dH
    efficiency, its dH tiles' GEMM efficiencies) loads without them, and
    predicts as the same file without them."""
    kept = {"dh:128x128x64:w8:s3:p2": 0.5}
    data = dataclasses.asdict(dataclasses.replace(H200, gemm_efficiency=kept))
    path = tmp_path / "old.json"
    path.write_text(json.dumps(dict(data, one_pass_dh_efficiency=0.9,
                                    gemm_efficiency=dict(kept, **{"dh_recompute:128x384x64:w8:s3:p1": 0.4}))))
    old = load_constants(path)
    assert old == dataclasses.replace(H200, gemm_efficiency=kept)
    shape, stats = layer("qwen3")
    assert predict(shape, stats, 2, shape.default_params(), old).total == \
        predict(shape, stats, 2, shape.default_params(), dataclasses.replace(H200, gemm_efficiency=kept)).total


def test_measurement_records_from_before_the_recomputing_backward_was_removed():
    """Old records say ``"saved_h13": true`` (the backward that remains) and may
    carry ``dh_two_pass``, which that backward never read: they predict as
    records without them; a record of the removed backward is refused."""
    shape, _ = layer("qwen3")
    record = calibrate.measurement_record(shape, {"dispatch_programs": 16}, {"forward": 1, "backward": 1})
    assert "saved_h13" not in record
    old = dict(record, saved_h13=True, params={"dispatch_programs": 16, "dh_two_pass": False})
    assert calibrate.record_prediction(old, H200) == calibrate.record_prediction(record, H200)
    with pytest.raises(ValueError, match="recomputing backward .*saved_h13 false.*drop it"):
        calibrate.record_prediction(dict(old, saved_h13=False), H200)


def test_fit_recovers_a_stage_scale_and_check_flags_a_bad_model():
    shape, _ = layer("qwen3")
    records = []
    for changes in ({}, {"dispatch_programs": 16}, {"fc2_block_n": 256, "fc2_num_warps": 8, "fc2_programs_per_sm": 1}):
        probe = calibrate.measurement_record(shape, changes, {"forward": 1, "backward": 1, "forward.fc2": 1},
                                             schedule="sequential")
        pred = calibrate.record_prediction(probe, H200)
        measured = dict(pred, **{"forward.fc2": 1.3 * pred["forward.fc2"]})
        measured["forward"] += 0.3 * pred["forward.fc2"]
        records.append(calibrate.measurement_record(shape, changes, measured, schedule="sequential"))
    _, ok = calibrate.check(H200, records, tolerance=0.01)
    assert not ok
    fitted = calibrate.fit(H200, records)
    assert fitted.stage_scale["forward.fc2"] == pytest.approx(1.3, rel=1e-6)
    table, ok = calibrate.check(fitted, records, tolerance=0.01)
    assert ok, table


# ---- the sustained clock and the calibration samples ------------------------------


def test_clock_constants_recover_a_sustained_curve_and_find_no_loss_in_a_flat_one():
    rng = np.random.default_rng(0)
    rested, sustained, settle = 1.40, 1.40 / 0.86, 40.0  # ms per call; half the loss after 40 ms busy
    times, busy = [], 0.0
    for _ in range(300):
        rate = 0.86 + 0.14 * 2 ** (-busy / settle)
        times.append(rested / rate * (1 + rng.normal(0, 0.002)))
        busy += times[-1]
    s, half = calibrate.clock_constants(times)
    assert s == pytest.approx(rested / sustained, abs=0.01)
    assert half == pytest.approx(settle, rel=0.15)
    assert calibrate.clock_constants([1.4 * (1 + rng.normal(0, 0.001)) for _ in range(300)]) == (1.0, 0.0)


def test_a_calibrated_clock_slows_long_layers_more_than_short_ones():
    """Uncalibrated (or a clock without loss), the clocked model is the rested one
    bit for bit; with a loss, a layer whose timing loop keeps the GPU busy
    longer loses more of its GEMM rate."""
    hw = dataclasses.replace(H200, sustained_clock=0.85, clock_settle_ms=30.0)
    ratios = {}
    for name in ("qwen3", "mixtral"):
        shape, stats = layer(name, world=1, tokens=SHAPES[name][0] * 2)
        point = shape.default_params()
        rested = predict(shape, stats, 1, point, H200)
        assert predict(shape, stats, 1, point, dataclasses.replace(H200, sustained_clock=0.85)).total == rested.total
        clocked = predict(shape, stats, 1, point, hw)
        assert clocked.forward["fc1"] > rested.forward["fc1"] and clocked.backward["da"] > rested.backward["da"]
        assert clocked.forward["dispatch"] == rested.forward["dispatch"]  # no GEMM: no clock
        ratios[name] = clocked.forward["fc1"] / rested.forward["fc1"]
    assert 1 < ratios["qwen3"] < ratios["mixtral"] < 1 / 0.85 + 1e-9


def _synthetic_samples(hw, tiles: list[dict]) -> dict:
    """Calibration samples whose GEMM launch times are the model's at ``hw``
    (what a GPU with exactly these constants would have measured)."""
    shape = LayerShape(8192, 4096, 2048, 8, 2, 1, 2)
    stats = RoutingStats.uniform(8192, 8, 2, 1)
    out = []
    for overrides in tiles:
        params = LayerParams().replace(**overrides)
        pred = predict(shape, stats, 1, params, hw, schedule="sequential", busy_calls=calibrate.SAMPLE_BUSY_CALLS)
        stages = {k: pred.forward[k] - hw.launch_us * 1e-3 for k in ("fc1", "fc2")}
        stages.update({k: pred.backward[k] - hw.launch_us * 1e-3 for k in ("dh", "da")})
        out.append(dict(overrides=overrides, stages=stages))
    clock, busy = [], 0.0
    for _ in range(300):  # 1.4 ms a call on a rested GPU, at the clock of the busy time near its middle
        clock.append(1.4 / float(clock_factor(hw, (busy + 0.7) * 1e-3)))
        busy += clock[-1]
    return {"gpu": hw.name, "hbm_copy": dict(bytes=2 << 30, ms=2 * (1 << 30) / (hw.hbm_gbps * 1e9) * 1e3),
            "launches": dict(count=200, ms=200 * hw.launch_us * 1e-3), "clock": dict(flops=2 * 8192**3, ms=clock),
            "dispatch": dict(rows=25000.0, row_bytes=8192, programs=8,
                             ms=25000 * 8192 / (8 * hw.copy_gbps_per_program * 1e9) * 1e3),
            "tile_layer": dict(shape=dataclasses.asdict(shape),
                               routing={n: np.asarray(getattr(stats, n)).tolist()
                                        for n in ("tokens", "expert_rows", "send_rows", "send_copies")}),
            "tiles": out}


def test_fit_samples_recovers_the_constants_that_made_the_samples_and_refit_reads_them_back(tmp_path):
    # A clock that falls far and fast: solving the tiles at another load than the samples' shows.
    truth = dataclasses.replace(H200, sustained_clock=0.6, clock_settle_ms=6.0, hbm_gbps=3300.0, launch_us=3.0,
                                copy_gbps_per_program=21.0)
    key_fc1 = tile_key("fc1", 128, 256, 64, 8, 3, 1)
    key_fc2 = tile_key("fc2", 128, 128, 64, 4, 3, 2)
    key_dh = tile_key("dh", 128, 128, 64, 8, 3, 2)  # its tiles also copy rows at the dispatch's rate
    truth.gemm_efficiency = {key_fc1: 0.71, key_fc2: 0.58, key_dh: 0.62}
    tiles = [dict(), dict(fc2_block_n=128, fc2_num_warps=4, fc2_programs_per_sm=2)]
    samples = _synthetic_samples(truth, tiles)
    # a configuration of a field LayerParams no longer has (a file from before its removal): skipped, said so
    samples["tiles"].append(dict(overrides={"fc1_removed_knob": 2}, stages={"fc1": 99.0}))
    said = []
    fitted = calibrate.fit_samples(default_constants("NVIDIA H200"), samples, log=said.append)
    assert any("fc1_removed_knob" in line and "skipped" in line for line in said)
    assert fitted.hbm_gbps == pytest.approx(3300.0) and fitted.launch_us == pytest.approx(3.0)
    assert fitted.sustained_clock == pytest.approx(0.6, abs=0.01)
    assert fitted.gemm_efficiency[key_fc1] == pytest.approx(0.71, rel=0.02)
    assert fitted.gemm_efficiency[key_fc2] == pytest.approx(0.58, rel=0.02)
    assert fitted.copy_gbps_per_program == pytest.approx(21.0)
    assert fitted.gemm_efficiency[key_dh] == pytest.approx(0.62, rel=0.02)
    path = tmp_path / "hw.json"
    save_constants(fitted, path)
    assert load_constants(path).calibration_samples == json.loads(json.dumps(samples))
    assert calibrate.main(["refit", "--constants", str(path), "--out", str(tmp_path / "again.json")]) == 0
    again = load_constants(tmp_path / "again.json")
    assert again.gemm_efficiency == fitted.gemm_efficiency and again.sustained_clock == fitted.sustained_clock


# ---- the weight gradients' dtype ----------------------------------------------------


def test_the_weight_gradients_run_where_their_dtype_sends_them():
    """bf16 gradients: ``auto`` is torch._grouped_mm (the weight-gradient
    kernel's tiles change nothing). fp32 gradients of fp32 master weights:
    ``auto`` is the Triton kernel (its tiles matter, its fp32 stores cost
    more bytes than bf16 ones), and an explicit ``grouped_mm`` pays for
    widening its bf16 output to fp32 after the GEMM."""
    t, d, h, e, k = SHAPES["qwen3"]
    stats = RoutingStats.uniform(t, e, k, 1)
    bf16, fp32 = (LayerShape(t, d, h, e, k, 1, 2, weight_grad_bytes=g) for g in (None, 4))
    base = bf16.default_params()
    slow_tiles = base.replace(wgrad_w13_num_warps=4, wgrad_w2_num_warps=4)

    def wgrad(shape, point):
        return predict(shape, stats, 1, point, H200, schedule="sequential").backward["wgrad"]

    grouped = wgrad(bf16, base.replace(wgrad_backend="grouped_mm"))
    assert wgrad(bf16, base) == wgrad(bf16, slow_tiles) == grouped
    triton = wgrad(fp32, base.replace(wgrad_backend="triton"))
    assert wgrad(fp32, base) == triton != wgrad(fp32, slow_tiles)
    assert triton > wgrad(bf16, base.replace(wgrad_backend="triton"))
    widen_bytes = 3 * e * d * h * (2 + 4)
    widened = grouped + widen_bytes / (H200.hbm_gbps * 1e9) * 1e3 + 3 * H200.launch_us * 1e-3
    assert wgrad(fp32, base.replace(wgrad_backend="grouped_mm")) == pytest.approx(widened, rel=1e-9)
    with pytest.raises(ValueError, match="weight_grad_bytes"):
        LayerShape(t, d, h, e, k, 1, 4, weight_grad_bytes=2)


def test_the_weight_gradient_tile_choices_are_feasible_schedule_points_led_by_the_defaults():
    """``WGRAD_CHOICES`` (the search's weight-gradient neighbours): the first is
    every tuning shape's default, each is a schedule point (the default's
    bits) that runs on an H200 at EP 1 and 2, and each is predicted apart
    where the Triton kernel writes fp32 gradients."""
    from titan_uniep.shapes import SHAPES as NAMED, TUNING_SHAPES
    from titan_uniep.tuning.space import WGRAD_CHOICES

    (names, combos), = WGRAD_CHOICES.items()
    assert len(set(combos)) == len(combos) >= 2
    for shape_name in TUNING_SHAPES:
        t, d, h, e, k = NAMED[shape_name]
        for world in (1, 2):
            shape = LayerShape(t, d, h, e, k, world, 2, weight_grad_bytes=4)
            base = shape.default_params()
            assert tuple(getattr(base, n) for n in names) == combos[0], shape_name
            stats = RoutingStats.uniform(t, e, k, world)
            times = set()
            for combo in combos:
                point = base.replace(**dict(zip(names, combo)))
                assert keeps_bits(point, base) is None and feasible(point, shape, H200) is None, (shape_name, combo)
                times.add(predict(shape, stats, world, point, H200).backward["wgrad"])
            assert len(times) == len(combos), shape_name
