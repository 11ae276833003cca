"""The model's torch._grouped_mm weight gradients by rows per expert (CPU).

``HardwareConstants.grouped_mm_efficiency_by_rows`` is interpolated in
log2(rows) and clamped at its ends, survives the JSON round trip, and is
empty in files written before it (which then predict with the one
``grouped_mm_efficiency`` as before). ``backward.wgrad`` sums each expert's
time at its own rows' efficiency on the slowest rank, so at fixed total rows
it grows as the rows per expert fall where the table falls. The calibration
times the runtime's three calls (checked against a float64 reference here)
and recovers the table from their times.
"""

import dataclasses
import json

import numpy as np
import pytest
import torch

from titan_uniep.tuning import calibrate
from titan_uniep.tuning.model import RoutingStats, default_constants, load_constants, predict, save_constants
from titan_uniep.tuning.space import LayerShape

H200 = default_constants("NVIDIA H200")
# falls from 0.7 at 4096 rows per expert to 0.25 at 64 (a shape to test with, not measured figures)
FALLING = {"4096": 0.7, "1024": 0.6, "256": 0.42, "64": 0.25}


def log2_interp(table):
    rows = sorted(int(k) for k in table)
    return lambda r: float(np.interp(np.log2(max(r, 1)), np.log2(rows), [table[str(k)] for k in rows]))


def wgrad_reference_ms(hw, expert_rows, dim, hidden, efficiency) -> float:
    """backward.wgrad (grouped_mm) in float64 from its definition: per rank
    ``expert_rows[r]`` the roofline of sum_e 6 rows_e D H / (peak *
    efficiency(rows_e)) against the three gradients of every local expert
    written and the rows read (x, dOut; h, dh1, dh3), the slowest rank, plus
    three launches."""
    times = []
    for experts in np.asarray(expert_rows, dtype=float):
        compute = sum(6.0 * r * dim * hidden / (hw.peak_tflops * 1e12 * efficiency(r)) for r in experts)
        moved = 3.0 * len(experts) * dim * hidden * 2 + experts.sum() * (2 * dim + 3 * hidden) * 2
        memory = moved / (hw.hbm_gbps * 1e9)
        p = hw.roofline_p
        times.append((compute**p + memory**p) ** (1 / p))
    return 1e3 * max(times) + 3 * hw.launch_us * 1e-3


def skewed_stats(tokens, experts, top_k, world, seed=0):
    """Routing where the last experts get most rows and the first few or none
    (uniform logits plus a bias rising over the experts)."""
    gen = torch.Generator().manual_seed(seed)
    bias = torch.linspace(0, 1, experts)
    indices = [(torch.rand(tokens, experts, generator=gen) + bias).argsort(1, descending=True)[:, :top_k]
               for _ in range(world)]
    return RoutingStats.from_indices(indices, experts, world)


def wgrad_ms(shape, stats, hw):
    params = shape.default_params().replace(wgrad_backend="grouped_mm")
    return predict(shape, stats, shape.ep_size, params, hw, schedule="sequential").backward["wgrad"]


def test_efficiency_interpolates_in_log2_rows_and_clamps_at_the_ends():
    hw = dataclasses.replace(H200, grouped_mm_efficiency_by_rows={"1024": 0.6, "64": 0.2})  # not in row order
    rows = np.array([[0, 16, 64, 128], [256, 1024, 4096, 1e6]])
    expected = np.array([[0.2, 0.2, 0.2, 0.3], [0.4, 0.6, 0.6, 0.6]])  # 128: a quarter of the way in log2
    np.testing.assert_allclose(hw.grouped_mm_efficiency_at(rows), expected, rtol=1e-12)
    np.testing.assert_array_equal(H200.grouped_mm_efficiency_at([1, 256, 4096]), [H200.grouped_mm_efficiency] * 3)
    for bad in ({"0": 0.5}, {"rows": 0.5}, {"256": 1.5}, {"256": 0.5, "0256": 0.4}):
        with pytest.raises(ValueError, match="grouped_mm_efficiency_by_rows"):
            dataclasses.replace(H200, grouped_mm_efficiency_by_rows=bad).grouped_mm_efficiency_at(256)


def test_rows_table_round_trips_through_json_with_readable_keys(tmp_path):
    hw = dataclasses.replace(H200, grouped_mm_efficiency_by_rows=dict(FALLING))
    path = tmp_path / "hw.json"
    save_constants(hw, path)
    assert json.loads(path.read_text())["grouped_mm_efficiency_by_rows"] == FALLING
    assert load_constants(path) == hw
    data = json.loads(path.read_text())
    data["grouped_mm_efficiency_by_rows"] = {"256 rows": 0.4}
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="hw.json.*grouped_mm_efficiency_by_rows"):
        load_constants(path)


@pytest.mark.parametrize("world", [1, 2])
def test_constants_files_without_the_table_predict_wgrad_as_before(tmp_path, world):
    data = dataclasses.asdict(dataclasses.replace(H200, grouped_mm_efficiency=0.53))
    del data["grouped_mm_efficiency_by_rows"]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data))
    old = load_constants(path)
    assert old.grouped_mm_efficiency_by_rows == {} and old.grouped_mm_efficiency == 0.53
    t, d, h, e, k = 4096, 7168, 2048, 256, 8
    shape = LayerShape(t, d, h, e, k, world, 2)
    for stats in (RoutingStats.uniform(t, e, k, world), skewed_stats(t, e, k, world)):
        expected = wgrad_reference_ms(old, stats.expert_rows.reshape(world, -1), d, h, lambda r: 0.53)
        assert wgrad_ms(shape, stats, old) == pytest.approx(expected, rel=1e-12)


def test_wgrad_takes_each_experts_efficiency_on_the_slowest_rank():
    t, d, h, e, k, world = 4096, 2048, 768, 64, 4, 2
    shape = LayerShape(t, d, h, e, k, world, 2)
    stats = skewed_stats(t, e, k, world, seed=3)
    rows = stats.expert_rows.reshape(world, -1)
    assert rows.min() < 64 < 1024 < rows.max()  # experts below the table's first entry and between its entries
    hw = dataclasses.replace(H200, grouped_mm_efficiency_by_rows=dict(FALLING))
    expected = wgrad_reference_ms(hw, rows, d, h, log2_interp(FALLING))
    assert wgrad_ms(shape, stats, hw) == pytest.approx(expected, rel=1e-9)


def test_wgrad_grows_as_rows_per_expert_fall_at_fixed_total_rows():
    tokens, d, h, k = 16384, 2048, 1024, 4  # 65536 rows over 16 ... 1024 experts: 4096 ... 64 rows each
    falling = dataclasses.replace(H200, grouped_mm_efficiency_by_rows=dict(FALLING))
    flat = dataclasses.replace(H200, grouped_mm_efficiency_by_rows={"64": 0.7})  # FALLING's 4096-row figure
    times, flat_times = [], []
    for experts in (16, 64, 256, 1024):
        shape = LayerShape(tokens, d, h, experts, k, 1, 2)
        stats = RoutingStats.uniform(tokens, experts, k, 1)
        times.append(wgrad_ms(shape, stats, falling))
        flat_times.append(wgrad_ms(shape, stats, flat))
    assert times[0] == pytest.approx(flat_times[0], rel=1e-12)  # 4096 rows: the same efficiency
    assert all(a < b for a, b in zip(times, times[1:])), times
    # more than the gradients written for more experts (all the flat table sees): the falling efficiency
    assert all(t > 1.1 * f for t, f in zip(times[1:], flat_times[1:])), (times, flat_times)
    assert times[-1] / times[0] > 1.2 * flat_times[-1] / flat_times[0], (times, flat_times)


def test_calibration_calls_compute_each_experts_weight_gradients():
    dim, hidden, capacity = 48, 40, 72
    gen = torch.Generator().manual_seed(5)
    xs, dys, h, dh1, dh3 = calibrate._wgrad_operands(dim, hidden, capacity, "cpu", gen)
    sizes = [24, 0, 8, 32]  # an expert without rows; the last 8 rows belong to none
    ends = torch.tensor(np.cumsum(sizes), dtype=torch.int32)
    dw1, dw2, dw3 = calibrate._grouped_mm_wgrad(xs, dys, h, dh1, dh3, ends)
    assert dw1.shape == dw3.shape == (4, hidden, dim) and dw2.shape == (4, dim, hidden)
    start = 0
    for expert, end in enumerate(np.cumsum(sizes)):
        rows = slice(start, end)
        for got, a, b in ((dw1, dh1, xs), (dw2, dys, h), (dw3, dh3, xs)):
            ref = a[rows].double().t() @ b[rows].double()
            torch.testing.assert_close(got[expert].double(), ref, rtol=1e-2, atol=1e-2 * (1 + ref.abs().max()))
        start = end


def test_calibration_recovers_the_rows_table_from_grouped_mm_times():
    hw = dataclasses.replace(H200, launch_us=5.0)
    # two D x H pairs, the second 20% slower at every rows: the table holds their geometric mean
    pairs = {(2048, 768, 128): 1.0, (7168, 2048, 18): 0.8}
    samples = []
    for (dim, hidden, experts), factor in pairs.items():
        for rows in calibrate.GROUPED_MM_ROWS:
            eff = factor * log2_interp(FALLING)(rows)
            ms = wgrad_reference_ms(hw, np.full((1, experts), rows), dim, hidden, lambda r, eff=eff: eff)
            samples.append(dict(dim=dim, hidden=hidden, experts=experts, rows=rows, ms=ms))
    lines = []
    table = calibrate._grouped_mm_rows_table(hw, samples, log=lines.append)
    assert list(table) == [str(r) for r in calibrate.GROUPED_MM_ROWS]
    for rows in calibrate.GROUPED_MM_ROWS:
        assert table[str(rows)] == pytest.approx(0.8**0.5 * log2_interp(FALLING)(rows), abs=2e-4), (rows, table)
    assert len(lines) == len(calibrate.GROUPED_MM_ROWS)
