"""Measure the analytic model's hardware constants on a GPU, fit them to
measured layer times, and check the model against measurements.

    python -m titan_uniep.tuning.calibrate --out h200.json             # one GPU, about 3 min (cold Triton cache)
    python -m titan_uniep.tuning.calibrate --out h200.json --tiles grid   # every tile of the search grid
    torchrun --standalone --nproc_per_node 2 -m titan_uniep.tuning.calibrate --out h200_x2.json
    python -m titan_uniep.tuning.calibrate refit --constants h200.json --out h200.json   # anywhere
    python -m titan_uniep.tuning.calibrate fit --constants h200.json --measurements m.json --out h200_fit.json
    python -m titan_uniep.tuning.calibrate check --constants h200_fit.json --measurements m.json

``measure`` (the default) starts from ``default_constants(<GPU name>)``,
times what the model needs on the GPU (``_measure_samples``; the samples are
kept in the file as ``calibration_samples``) and fits the figures from them
(``fit_samples``), which ``refit`` does again from a saved file on any
machine:

- the GPU's limits (SMs, shared memory per SM and per block, registers);
- ``hbm_gbps``: a 1 GiB device copy (read + write bytes over time);
- ``launch_us``: back-to-back launches of a one-element kernel;
- ``sustained_clock`` and ``clock_settle_ms``: 300 bf16 8192^3 matmuls back
  to back from a rested GPU, how far and how fast the rate falls
  (``clock_constants``; the model's ``hardware.clock_factor``);
- per tile configuration of the project's own kernels (``--tiles
  defaults``: the tuned defaults of every shape class; ``grid``: also every
  tile choice of ``space.GRID_STAGES``), the GEMM efficiency that makes the
  model reproduce the kernel's measured time on dense rows (``TILE_LAYER``):
  a simulated one-rank world (every expert local, balanced routing), the
  sequential schedule, each launch's device time from the profiler (fc1,
  fc2, dH, dA; ``tile_key`` per configuration, the median over the samples
  that ran it), solved at the clock of the samples' own load. The
  ``grouped_mm`` weight gradients give ``grouped_mm_efficiency``; the
  dispatch launch of a simulated two-rank
  world with 8 programs gives ``copy_gbps_per_program`` (a one-rank
  dispatch copies no rows: its tiles read x in place);
- ``grouped_mm_efficiency_by_rows``: the weight gradients' three
  torch._grouped_mm calls (the runtime's operands and layout) at
  ``GROUPED_MM_ROWS`` rows per expert for the (D, H) of every
  ``shapes.TUNING_SHAPES`` shape, CUDA events; per rows the efficiency with
  which ``model.grouped_mm_wgrad_time`` reproduces each time, the geometric
  mean over the (D, H) pairs;
- with a process group of more than one GPU (torchrun): ``nvlink_gbps``
  (every rank copies 256 MiB into its next peer's symmetric buffer at once)
  and ``exchange_us`` (the counts exchange kernel of a tiny real-EP
  forward). On one GPU they keep the uncalibrated figures and ``source``
  says so.

``refit`` fits a saved file's samples again (also dropping a ``fit``'s
stage scales, which were fitted on the old figures). ``fit`` sets
``stage_scale`` from measurements: per stage the geometric mean
of measured over predicted (sequential records with per-stage times), then
``dispatch_overlap`` and ``reduce_tail`` by a grid search on the fused
records' totals. ``check`` prints predicted against measured per record
and stage and exits 1 when a total is off by more than ``--tolerance``.

Measurements are a JSON list of records (``measurement_record`` builds one):

    {"shape": {"tokens": 8192, "dim": 2048, "hidden": 768, "num_experts": 128,
               "top_k": 8, "ep_size": 2, "dtype_bytes": 2},
     "params": {"dispatch_programs": 32},      # LayerParams fields over the shape's defaults
     "routing": "uniform",                      # or RoutingStats' arrays: tokens, expert_rows,
                                                # send_rows, send_copies (lists)
     "schedule": "fused",
     "measured": {"forward": 1.52, "backward": 3.07,     # ms, the slowest rank
                  "forward.fc1": 0.77, ...}}             # optional stages (sequential launches)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from pathlib import Path

import numpy as np

from ..params import LayerParams
from .hardware import HardwareConstants, clock_factor, default_constants, load_constants, save_constants, tile_key
from .model import RoutingStats, grouped_mm_wgrad_time, predict
from .space import GRID_STAGES, LayerShape

__all__ = ["GROUPED_MM_ROWS", "check", "clock_constants", "fit", "fit_samples", "measurement_record", "measure",
           "record_prediction"]

# Rows per expert at which ``measure`` times the grouped_mm weight gradients:
# from deepseek-like's 256 (8192 tokens x top-8 over 256 experts) down to the
# shorter experts of EP > 1 and skewed routing, up to mixtral-like's 4096.
GROUPED_MM_ROWS = (64, 128, 256, 512, 1024, 2048, 4096)


# ---- records --------------------------------------------------------------------


def measurement_record(shape: LayerShape, params: dict, measured: dict[str, float], *, schedule: str = "fused",
                       routing: RoutingStats | None = None) -> dict:
    """One measurement for ``fit`` / ``check``: ``params`` are LayerParams
    fields over ``shape.default_params()``; ``measured`` in ms (``"forward"``,
    ``"backward"``, optional ``"forward.fc1"``-style stages); ``routing``
    None: balanced (``RoutingStats.uniform``)."""
    if routing is None:
        route = "uniform"
    else:
        route = {name: np.asarray(getattr(routing, name)).tolist()
                 for name in ("tokens", "expert_rows", "send_rows", "send_copies")}
    return dict(shape=dataclasses.asdict(shape), params=dict(params), routing=route, schedule=schedule,
                measured=dict(measured))


def _record_inputs(record: dict):
    # Records written before the recomputing backward was removed say "saved_h13" (true: the backward
    # that remains) and may carry its dh_two_pass field, which the saved-h1 | h3 backward never read.
    if not record.get("saved_h13", True):
        raise ValueError(f"a measurement record of the recomputing backward (saved_h13 false), which was removed: "
                         f"drop it from the measurements ({record.get('shape')})")
    shape = LayerShape(**record["shape"])
    params = shape.default_params().replace(**{k: v for k, v in record.get("params", {}).items()
                                               if k != "dh_two_pass"})
    routing = record.get("routing", "uniform")
    if routing == "uniform":
        stats = RoutingStats.uniform(shape.tokens, shape.num_experts, shape.top_k, shape.ep_size)
    else:
        stats = RoutingStats(shape.top_k, *(np.asarray(routing[n], dtype=float)
                                            for n in ("tokens", "expert_rows", "send_rows", "send_copies")))
    return shape, params, stats


def record_prediction(record: dict, hw: HardwareConstants) -> dict[str, float]:
    """The model's figures for the keys a record measured (ms)."""
    shape, params, stats = _record_inputs(record)
    pred = predict(shape, stats, shape.ep_size, params, hw, schedule=record.get("schedule", "fused"))
    out = {"forward": pred.forward_total, "backward": pred.backward_total}
    out.update({f"forward.{s}": v for s, v in pred.forward.items()})
    out.update({f"backward.{s}": v for s, v in pred.backward.items()})
    return {key: out[key] for key in record["measured"] if key in out}


# ---- fit and check -----------------------------------------------------------------


def fit(hw: HardwareConstants, records: list[dict]) -> HardwareConstants:
    """``hw`` fitted to ``records``: ``stage_scale`` per measured stage (the
    geometric mean of measured over predicted), ``dispatch_overlap`` and
    ``reduce_tail`` (grid search on the fused records' totals, least squared
    log error), then per direction a scale of the stages no record measured
    (``stage_scale["forward"]`` / ``["backward"]``) that brings the totals'
    geometric-mean ratio to 1."""
    base = dataclasses.replace(hw, stage_scale={})
    ratios: dict[str, list[float]] = {}
    for record in records:
        pred = record_prediction(record, base)
        for key, measured in record["measured"].items():
            if "." in key and key in pred and pred[key] > 0 and measured > 0:
                ratios.setdefault(key, []).append(measured / pred[key])
    scale = {key: float(math.exp(np.mean(np.log(r)))) for key, r in ratios.items()}
    fitted = dataclasses.replace(base, stage_scale=scale)

    def log_errors(candidate: HardwareConstants, direction: str, schedules=("fused", "sequential")) -> list[float]:
        errs = []
        for record in records:
            if record.get("schedule", "fused") in schedules and direction in record["measured"]:
                pred = record_prediction(record, candidate)
                errs.append(math.log(record["measured"][direction] / pred[direction]))
        return errs

    if any(r.get("schedule", "fused") == "fused" for r in records):
        grid = [(o, t) for o in np.linspace(0.0, 1.0, 11) for t in np.linspace(0.0, 1.0, 11)]

        def loss(ot) -> float:
            candidate = dataclasses.replace(fitted, dispatch_overlap=float(ot[0]), reduce_tail=float(ot[1]))
            return sum(e * e for d in ("forward", "backward") for e in log_errors(candidate, d, ("fused",)))

        best = min(grid, key=loss)
        fitted = dataclasses.replace(fitted, dispatch_overlap=float(best[0]), reduce_tail=float(best[1]))
    for direction in ("forward", "backward"):
        for _ in range(8):  # the unmeasured stages are only part of a total: iterate to the fixed point
            errs = log_errors(fitted, direction)
            if not errs or abs(np.mean(errs)) < 1e-4:
                break
            scale = dict(fitted.stage_scale)
            scale[direction] = scale.get(direction, 1.0) * float(math.exp(np.mean(errs)))
            fitted = dataclasses.replace(fitted, stage_scale=scale)
    fitted.source = f"{hw.source}; fitted to {len(records)} measurements"
    return fitted


def check(hw: HardwareConstants, records: list[dict], tolerance: float = 0.15) -> tuple[str, bool]:
    """A Markdown table of predicted against measured per record and key,
    and whether every total (``forward``, ``backward``) is within
    ``tolerance`` (relative)."""
    lines = ["| record | key | measured (ms) | predicted (ms) | error |", "|---|---|---|---|---|"]
    ok = True
    for i, record in enumerate(records):
        pred = record_prediction(record, hw)
        s = record["shape"]
        name = (f"{i}: T={s['tokens']} D={s['dim']} H={s['hidden']} E={s['num_experts']} K={s['top_k']} "
                f"W={s['ep_size']} {record.get('schedule', 'fused')} {record.get('params', {})}")
        for key, measured in record["measured"].items():
            if key not in pred:
                continue
            err = pred[key] / measured - 1 if measured else float("inf")
            bad = key in ("forward", "backward") and abs(err) > tolerance
            ok &= not bad
            flag = " **over**" if bad else ""
            lines.append(f"| {name} | {key} | {measured:.4f} | {pred[key]:.4f} | {err:+.1%}{flag} |")
            name = ""
    return "\n".join(lines), ok


# ---- measure (GPU) -----------------------------------------------------------------


def _kernel_times(fn, reps: int = 5) -> list[tuple[str, float]]:
    """(kernel name, ms) of every CUDA kernel one ``fn()`` call launches, in
    launch order: the median over ``reps`` profiled calls after a warm-up."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
            torch.cuda.synchronize()
    events = sorted((e for e in prof.events() if e.device_type.name == "CUDA"), key=lambda e: e.time_range.start)
    if not events or len(events) % reps:
        raise RuntimeError(f"profiled {len(events)} kernels over {reps} calls: not one sequence per call")
    per_call = len(events) // reps
    out = []
    for j in range(per_call):
        times = sorted(events[i * per_call + j].time_range.elapsed_us() / 1e3 for i in range(reps))
        out.append((events[j].name, times[reps // 2]))
    return out


def _named(times: list[tuple[str, float]], name: str) -> list[float]:
    return [ms for kernel, ms in times if name in kernel]


def _solve_efficiency(stage_ms: float, predict_ms, lo: float = 0.02, hi: float = 1.0) -> float:
    """The efficiency ``e`` with ``predict_ms(e) == stage_ms`` (bisection; the
    prediction falls as ``e`` grows); clamped to ``[lo, hi]``."""
    if predict_ms(hi) >= stage_ms:
        return hi
    if predict_ms(lo) <= stage_ms:
        return lo
    for _ in range(40):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if predict_ms(mid) > stage_ms else (lo, mid)
    return math.sqrt(lo * hi)


def _tile_configs(which: str) -> list[dict]:
    """LayerParams overrides to measure: the defaults of every shape class, and with
    ``"grid"`` every tile choice of the search grid."""
    from ..params import DEFAULTS

    configs = [dict()]
    for params in DEFAULTS.values():
        configs.append({f.name: getattr(params, f.name) for f in dataclasses.fields(LayerParams)
                        if getattr(params, f.name) != getattr(LayerParams(), f.name)})
    if which == "grid":
        for names, combos in GRID_STAGES.items():
            if names[0].startswith(("fc1", "fc2", "dh", "da")):
                configs += [dict(zip(names, combo)) for combo in combos]
    unique = []
    for c in configs:
        if c not in unique:
            unique.append(c)
    return unique


def measure(*, tiles: str = "defaults", tokens: int = 8192, log=print) -> HardwareConstants:
    """The constants of this process's GPU (see the module docstring): what
    ``_measure_samples`` times, fitted by ``fit_samples``."""
    import torch

    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    hw = default_constants(props.name)
    hw.sm_count = props.multi_processor_count
    hw.smem_per_sm = int(getattr(props, "shared_memory_per_multiprocessor", hw.smem_per_sm))
    hw.smem_per_block = int(getattr(props, "shared_memory_per_block_optin", hw.smem_per_block))
    hw.registers_per_sm = int(getattr(props, "regs_per_multiprocessor", hw.registers_per_sm))
    hw.max_threads_per_sm = int(getattr(props, "max_threads_per_multi_processor", hw.max_threads_per_sm))
    return fit_samples(hw, _measure_samples(tiles=tiles, tokens=tokens, log=log), log)


# The dense layer the GEMM tiles are calibrated on: 8 experts, top-2 (every
# tile full but the last of an expert), D and H long enough for steady K-loops.
TILE_LAYER = dict(dim=4096, hidden=2048, num_experts=8, top_k=2)
# Loads of the GEMM tile samples (calibrate._kernel_times): a warm-up call, then
# the median of 5 calls, each ended by a host sync.
SAMPLE_BUSY_CALLS = 3.5


def _measure_samples(*, tiles: str, tokens: int, log=print) -> dict:
    """Time what ``fit_samples`` fits (GPU): HBM copy, launch latency, the
    SM clock under a sustained GEMM load, every tile configuration's GEMM
    launches on ``TILE_LAYER``, the weight gradients and a dispatch there,
    the grouped_mm weight gradients by rows, and with a process group of
    more than one GPU NVLink and the counts exchange. Plain numbers and
    lists: ``HardwareConstants.calibration_samples``."""
    import torch
    import torch.distributed as dist
    import triton
    import triton.language as tl

    from ..runtime import BackwardWorkspace, Workspace, simulated_moe_backward, simulated_moe_forward

    dev = torch.device("cuda", torch.cuda.current_device())
    samples: dict = {"gpu": torch.cuda.get_device_name(dev)}

    # HBM: a 1 GiB copy
    src = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    samples["hbm_copy"] = dict(bytes=2 * src.numel(), ms=_event_ms(lambda: dst.copy_(src), reps=10))
    src = dst = None

    # launch latency: back-to-back one-element kernels
    @triton.jit
    def _touch(ptr):
        tl.store(ptr, tl.load(ptr) + 1)

    cell = torch.zeros(1, dtype=torch.int32, device=dev)
    launches = 200
    samples["launches"] = dict(count=launches, ms=_event_ms(lambda: [_touch[(1,)](cell) for _ in range(launches)],
                                                             reps=5))
    samples["clock"] = _clock_samples(dev)
    log(f"sustained GEMM: {len(samples['clock']['ms'])} calls, first {samples['clock']['ms'][1]:.3f} ms, "
        f"last {samples['clock']['ms'][-1]:.3f} ms")

    # GEMM tiles on dense rows: a simulated one-rank world, every expert local
    num_experts, top_k, dim, hidden = (TILE_LAYER[k] for k in ("num_experts", "top_k", "dim", "hidden"))
    gen = torch.Generator(device=dev).manual_seed(7)
    dtype = torch.bfloat16
    x = torch.randn(1, tokens, dim, generator=gen, device=dev).to(dtype)
    grad = torch.randn(1, tokens, dim, generator=gen, device=dev).to(dtype)
    w1 = (torch.randn(1, num_experts, hidden, dim, generator=gen, device=dev) * dim**-0.5).to(dtype)
    w3 = (torch.randn(1, num_experts, hidden, dim, generator=gen, device=dev) * dim**-0.5).to(dtype)
    w2 = (torch.randn(1, num_experts, dim, hidden, generator=gen, device=dev) * hidden**-0.5).to(dtype)
    probs = torch.softmax(torch.randn(tokens, num_experts, generator=gen, device=dev), 1)
    scores, indices = (t.contiguous() for t in probs.topk(top_k, dim=1))
    stats = RoutingStats.from_indices([indices.cpu().numpy()], num_experts, 1)
    samples["tile_layer"] = dict(
        shape=dataclasses.asdict(LayerShape(tokens, dim, hidden, num_experts, top_k, 1, 2)),
        routing={name: np.asarray(getattr(stats, name)).tolist()
                 for name in ("tokens", "expert_rows", "send_rows", "send_copies")})
    samples["tiles"] = []
    for overrides in _tile_configs(tiles):
        params = LayerParams().replace(**overrides)
        try:
            ws = Workspace.simulated(1, num_tokens=tokens, dim=dim, hidden=hidden, num_experts=num_experts,
                                     top_k=top_k, dtype=dtype, device=dev, params=params)
            bws = BackwardWorkspace.simulated(1, num_tokens=tokens, dim=dim, hidden=hidden, num_experts=num_experts,
                                              top_k=top_k, dtype=dtype, device=dev, params=params)
            h13 = torch.empty(1, ws.shape.slot_capacity, 2 * hidden, dtype=dtype, device=dev)

            def forward():
                simulated_moe_forward(x, [scores], [indices], w1, w2, w3, schedule="sequential",
                                      score_before_experts=False, params=params, workspace=ws, saved_h13=h13,
                                      error_check="lazy")

            def backward():
                simulated_moe_backward(grad, x, [scores], [indices], w1, w2, w3, schedule="sequential",
                                       score_before_experts=False, params=params, workspace=bws, saved_h13=h13,
                                       error_check="lazy")

            fwd, bwd = _kernel_times(forward), _kernel_times(backward)
        except Exception as err:  # a configuration that does not compile or run here: skip it, say so
            log(f"tiles {overrides}: skipped ({type(err).__name__}: {err})")
            continue
        found = {
            "fc1": _named(fwd, "dispatch_fc1")[1:2], "fc2": _named(fwd, "fc2_combine")[:1],
            "dh": _named(bwd, "dispatch_dh")[1:2], "da": _named(bwd, "da_combine")[:1],
        }
        sample = dict(overrides=overrides, stages={k: v[0] for k, v in found.items() if v})
        if not overrides:
            # grouped_mm weight gradients: the kernels between da_combine's launches
            da_at = [i for i, (name, _) in enumerate(bwd) if "da_combine" in name]
            if len(da_at) >= 2:
                sample["wgrad"] = sum(ms for _, ms in bwd[da_at[0] + 1:da_at[-1]])
            # Two simulated ranks routing alike (the same experts split over them):
            # every de-duplicated row a rank sends, its own included, is one copy.
            few = params.replace(num_programs=8)
            ws_few = Workspace.simulated(2, num_tokens=tokens, dim=dim, hidden=hidden, num_experts=num_experts,
                                         top_k=top_k, dtype=dtype, device=dev, params=few)
            x2 = x.expand(2, -1, -1).contiguous()
            w1_2, w2_2, w3_2 = (w.reshape(2, num_experts // 2, *w.shape[2:]) for w in (w1, w2, w3))
            slow = _named(_kernel_times(lambda: simulated_moe_forward(
                x2, [scores, scores], [indices, indices], w1_2, w2_2, w3_2, schedule="sequential",
                score_before_experts=False, params=few, workspace=ws_few, error_check="lazy")), "dispatch_fc1")[0]
            rows = RoutingStats.from_indices([indices.cpu().numpy()] * 2, num_experts, 2).send_rows.sum()
            samples["dispatch"] = dict(rows=float(rows), row_bytes=dim * 2, programs=8, ms=slow)
        samples["tiles"].append(sample)
        torch.cuda.empty_cache()

    samples["grouped_mm"] = _grouped_mm_samples(dev, log)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        samples["nvlink_gbps"] = _nvlink_gbps(dev)
        samples["exchange_us"] = _exchange_us(dev)
        samples["world"] = dist.get_world_size()
    return samples


def _clock_samples(dev, calls: int = 300, idle_s: float = 0.5) -> dict:
    """A sustained tensor-core load from a rested GPU: ``calls`` bf16
    8192^3 matmuls back to back after ``idle_s`` seconds idle, each timed
    with CUDA events (ms, in order)."""
    import time

    import torch

    n = 8192
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    out = torch.empty_like(a)
    torch.mm(a, b, out=out)
    torch.cuda.synchronize()
    time.sleep(idle_s)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(calls)]
    for start, end in events:
        start.record()
        torch.mm(a, b, out=out)
        end.record()
    torch.cuda.synchronize()
    return dict(flops=2 * n**3, ms=[start.elapsed_time(end) for start, end in events])


def clock_constants(times_ms: list[float]) -> tuple[float, float]:
    """``(sustained_clock, clock_settle_ms)`` of one sustained load's call
    times (``_clock_samples``): the sustained rate is the median of the last
    quarter; the rested rate and the settle time are the least-squares fit of
    ``sustained + (rested - sustained) * 2^(-busy / settle)`` to the calls'
    rates at their busy times (grid search; the first call, which may still
    pay a warm-up, left out). ``(1, 0)`` when the load loses nothing."""
    t = np.asarray(times_ms, dtype=float)
    rate = 1.0 / t
    busy = (np.cumsum(t) - t / 2)[1:]  # the middle of each call
    rate = rate[1:]
    sustained = float(np.median(rate[-max(5, len(rate) // 4):]))
    early = float(np.median(rate[:5]))
    if early <= sustained * 1.005:  # within noise: no loss
        return 1.0, 0.0
    rested = early * np.linspace(1.0, 1.5, 101)[:, None, None]
    settle = np.geomspace(max(float(t[0]), 0.1), max(float(busy[-1]), 1.0), 80)[None, :, None]
    fit = sustained + (rested - sustained) * np.exp2(-busy[None, None, :] / settle)
    err = ((fit - rate[None, None, :]) ** 2).sum(axis=2)
    a, b = np.unravel_index(np.argmin(err), err.shape)
    return sustained / float(rested[a, 0, 0]), float(settle[0, b, 0])


def fit_samples(hw: HardwareConstants, samples: dict, log=print) -> HardwareConstants:
    """``hw`` with every figure ``samples`` (``_measure_samples``) gives, the
    samples kept in ``hw.calibration_samples`` (``refit`` runs this again on
    a saved file). Order matters: the tile efficiencies are solved with the
    model at the HBM rate, launch latency and clock found first."""
    hw = dataclasses.replace(hw, gemm_efficiency={}, stage_scale={},
                             grouped_mm_efficiency_by_rows={}, calibration_samples=samples)
    measured = ["limits"]
    if "hbm_copy" in samples:
        hw.hbm_gbps = samples["hbm_copy"]["bytes"] / (samples["hbm_copy"]["ms"] * 1e-3) / 1e9
        log(f"HBM copy: {hw.hbm_gbps:.0f} GB/s")
        measured.append("hbm")
    if "launches" in samples:
        hw.launch_us = samples["launches"]["ms"] * 1e3 / samples["launches"]["count"]
        log(f"launch: {hw.launch_us:.2f} us")
        measured.append("launch")
    if "clock" in samples:
        hw.sustained_clock, hw.clock_settle_ms = clock_constants(samples["clock"]["ms"])
        rested = samples["clock"]["flops"] / (np.median(samples["clock"]["ms"][1:6]) * 1e-3) / 1e12
        log(f"GEMM clock: {rested:.0f} TFLOP/s rested, x{hw.sustained_clock:.3f} sustained, half of the loss "
            f"after {hw.clock_settle_ms:.0f} ms busy")
        measured.append("clock")
    if "dispatch" in samples:  # (before the tiles: the dH tiles' row copies go at this rate)
        d = samples["dispatch"]
        hw.copy_gbps_per_program = d["rows"] * d["row_bytes"] / (d["ms"] * 1e-3) / d["programs"] / 1e9
        log(f"dispatch of {d['rows']:.0f} rows with {d['programs']} programs: {d['ms']:.3f} ms -> "
            f"{hw.copy_gbps_per_program:.1f} GB/s per program")
    if samples.get("tiles"):
        _fit_tiles(hw, samples, log)
        measured.append("tiles")
    if samples.get("grouped_mm"):
        hw.grouped_mm_efficiency_by_rows = _grouped_mm_rows_table(hw, samples["grouped_mm"], log)
        measured.append("grouped_mm by rows")
    if "nvlink_gbps" in samples:
        hw.nvlink_gbps, hw.exchange_us = samples["nvlink_gbps"], samples["exchange_us"]
        log(f"NVLink: {hw.nvlink_gbps:.0f} GB/s per GPU and direction; counts exchange {hw.exchange_us:.1f} us")
        measured.append("nvlink+exchange")
        ep = f"measured over {samples['world']} GPUs"
    else:
        ep = "NVLink and the counts exchange not measured (one GPU: run under torchrun for them)"
    hw.source = f"calibrated on {samples.get('gpu', hw.name)} ({', '.join(measured)}; {ep})"
    return hw


def _fit_tiles(hw: HardwareConstants, samples: dict, log=print) -> None:
    """Per tile configuration sample and GEMM launch, the efficiency with
    which the model (sequential schedule, at the clock of the samples' load)
    reproduces the launch's time, per tile key the median over the samples
    that ran it (a grid sample varies one stage: the others rerun the base
    tiles); the base configuration's weight gradients give
    ``grouped_mm_efficiency``. Logs each sample's times and the figures."""
    layer = samples["tile_layer"]
    shape = LayerShape(**layer["shape"])
    stats = RoutingStats(shape.top_k, *(np.asarray(layer["routing"][n], dtype=float)
                                        for n in ("tokens", "expert_rows", "send_rows", "send_copies")))
    fields = {f.name for f in dataclasses.fields(LayerParams)}
    kept = [sample for sample in samples["tiles"] if set(sample["overrides"]) <= fields]
    for sample in samples["tiles"]:
        if sample not in kept:  # a configuration of a field since removed: no key of today's model
            log(f"tiles {sample['overrides']}: skipped (fields {sorted(set(sample['overrides']) - fields)} are gone)")
    solved: dict[str, list[float]] = {}
    for sample in kept:
        params = LayerParams().replace(**sample["overrides"])
        for kernel, ms in sample["stages"].items():
            direction = "forward" if kernel in ("fc1", "fc2") else "backward"
            key = _params_tile_key(kernel, params, shape.hidden)
            probe = dataclasses.replace(hw, gemm_efficiency={})  # every other key at the formula's figure

            def stage_ms(eff, kernel=kernel, key=key, probe=probe, direction=direction, params=params):
                probe.gemm_efficiency[key] = eff
                pred = predict(shape, stats, 1, params, probe, schedule="sequential",
                               busy_calls=SAMPLE_BUSY_CALLS)
                return getattr(pred, direction)[kernel] - hw.launch_us * 1e-3

            solved.setdefault(key, []).append(_solve_efficiency(ms, stage_ms))
        if "wgrad" in sample:
            probe = dataclasses.replace(hw)

            def wgrad_ms(eff, probe=probe, params=params):
                probe.grouped_mm_efficiency = eff
                return predict(shape, stats, 1, params, probe, schedule="sequential",
                               busy_calls=SAMPLE_BUSY_CALLS).backward["wgrad"]

            hw.grouped_mm_efficiency = round(_solve_efficiency(sample["wgrad"], wgrad_ms), 4)
    hw.gemm_efficiency = {key: round(float(np.median(effs)), 4) for key, effs in solved.items()}
    for sample in kept:
        params = LayerParams().replace(**sample["overrides"])
        log(", ".join(f"{_params_tile_key(k, params, shape.hidden)}: {ms:.3f} ms"
                      for k, ms in sample["stages"].items()))
    for key, eff in sorted(hw.gemm_efficiency.items()):
        log(f"{key}: efficiency {eff:.3f}")
    log(f"grouped_mm weight gradients: efficiency {hw.grouped_mm_efficiency:.3f}")


def _grouped_mm_experts(dim: int, hidden: int, num_experts: int, rows: int) -> int:
    """Experts in one timed weight-gradient call: the shape's, at most 2^28
    weight elements (1.5 GiB of bf16 gradients) and 2^18 rows, which keeps
    every call at a few ms and still thousands of output tiles."""
    return max(1, min(num_experts, (1 << 28) // (dim * hidden), (1 << 18) // rows))


def _wgrad_operands(dim: int, hidden: int, capacity: int, dev, gen) -> tuple:
    """Random bf16 weight-gradient operands ``(xs, dys, h, dh1, dh3)`` laid out
    as ``BackwardWorkspace`` holds them: x and dOut rows ``(capacity, D)``, the
    two halves of one ``(2, capacity, D)`` slot-row buffer; h, dh1, dh3
    ``(capacity, H)``."""
    import torch

    def rand(*size):
        return torch.randn(*size, generator=gen, device=dev, dtype=torch.bfloat16)

    slot_rows = rand(2, capacity, dim)
    return slot_rows[0], slot_rows[1], rand(capacity, hidden), rand(capacity, hidden), rand(capacity, hidden)


def _grouped_mm_wgrad(xs, dys, h, dh1, dh3, ends) -> tuple:
    """dW1 ``(G, H, D)``, dW2 ``(G, D, H)``, dW3 ``(G, H, D)`` as
    ``runtime.backward._weight_grads`` computes them with torch._grouped_mm:
    the groups' rows back to back, ``ends`` ``(G,)`` int32 their end offsets
    (rows past the last are not read)."""
    import torch

    return (torch._grouped_mm(dh1.t(), xs, offs=ends), torch._grouped_mm(dys.t(), h, offs=ends),
            torch._grouped_mm(dh3.t(), xs, offs=ends))


def _grouped_mm_samples(dev, log=print) -> list[dict]:
    """The weight gradients' device time (CUDA events, median of 5 after a
    warm-up) at every ``GROUPED_MM_ROWS`` rows per expert for the (D, H) of
    every ``shapes.TUNING_SHAPES`` shape, ``_grouped_mm_experts`` experts:
    records of ``dim``, ``hidden``, ``experts``, ``rows``, ``ms``."""
    import torch

    from ..shapes import SHAPES, TUNING_SHAPES

    gen = torch.Generator(device=dev).manual_seed(11)
    samples = []
    for dim, hidden, num_experts in dict.fromkeys(SHAPES[name][1:4] for name in TUNING_SHAPES):
        experts = {rows: _grouped_mm_experts(dim, hidden, num_experts, rows) for rows in GROUPED_MM_ROWS}
        operands = _wgrad_operands(dim, hidden, max(e * rows for rows, e in experts.items()), dev, gen)
        for rows, count in experts.items():
            ends = torch.arange(1, count + 1, dtype=torch.int32, device=dev) * rows
            ms = _event_ms(lambda ends=ends: _grouped_mm_wgrad(*operands, ends), reps=5)
            tflops = 6 * count * rows * dim * hidden / (ms * 1e-3) / 1e12
            log(f"grouped_mm weight gradients D={dim} H={hidden}, {count} experts x {rows} rows: {ms:.3f} ms "
                f"({tflops:.0f} TFLOP/s)")
            samples.append(dict(dim=dim, hidden=hidden, experts=count, rows=rows, ms=ms))
        operands = None
        torch.cuda.empty_cache()
    return samples


def _grouped_mm_rows_table(hw: HardwareConstants, samples: list[dict], log=print) -> dict[str, float]:
    """``grouped_mm_efficiency_by_rows`` from ``_grouped_mm_samples``' records:
    per record the efficiency with which ``model.grouped_mm_wgrad_time`` plus
    the three launches reproduces its time, per rows the geometric mean over
    the (D, H) pairs, logged with their range (a wide one would ask for a
    D x H key as well)."""
    by_rows: dict[int, list[float]] = {}
    for sample in samples:
        expert_rows = np.full((1, sample["experts"]), float(sample["rows"]))

        clock = float(clock_factor(hw, SAMPLE_BUSY_CALLS * sample["ms"] * 1e-3))

        def wgrad_ms(eff, sample=sample, expert_rows=expert_rows, clock=clock):
            probe = dataclasses.replace(hw, grouped_mm_efficiency_by_rows={str(sample["rows"]): eff})
            seconds = grouped_mm_wgrad_time(probe, expert_rows, sample["dim"], sample["hidden"], 2, clock=clock)[0]
            return 1e3 * seconds + 3 * hw.launch_us * 1e-3

        by_rows.setdefault(sample["rows"], []).append(_solve_efficiency(sample["ms"], wgrad_ms))
    table = {}
    for rows, effs in sorted(by_rows.items()):
        table[str(rows)] = round(float(np.exp(np.mean(np.log(effs)))), 4)
        log(f"grouped_mm at {rows} rows per expert: efficiency {table[str(rows)]:.3f} "
            f"(over {len(effs)} D x H: {min(effs):.3f}-{max(effs):.3f})")
    return table


def _params_tile_key(kernel: str, p: LayerParams, hidden: int) -> str:
    """``tile_key`` of the tile configuration ``p`` gives ``kernel`` (as the model reads it)."""
    if kernel == "fc1":
        return tile_key("fc1_one" if p.fc1_one_dot else "fc1", p.block_m, 2 * p.fc1_block_n, p.fc1_block_k,
                        p.fc1_num_warps, p.fc1_num_stages, 1)
    if kernel == "fc2":
        name = "fc2" + ("_flat" if p.fc2_flat_loop else "") + ("_tma" if p.fc2_tma and hidden % 8 == 0 else "")
        return tile_key(name, p.block_m, p.fc2_block_n,
                        p.fc2_block_k, p.fc2_num_warps, p.fc2_num_stages, p.fc2_programs_per_sm)
    if kernel == "dh":
        return tile_key("dh", p.block_m, p.dh_block_n, p.dh_block_k, p.dh_num_warps, p.dh_num_stages,
                        p.dh_programs_per_sm)
    return tile_key("da_tma" if p.da_tma and hidden % p.da_block_k == 0 else "da", p.block_m, p.da_block_n,
                    p.da_block_k, p.da_num_warps, p.da_num_stages, p.da_programs_per_sm)


def _event_ms(fn, reps: int) -> float:
    import torch

    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[reps // 2]


def _nvlink_gbps(dev) -> float:
    """Every rank copies 256 MiB into the next rank's symmetric buffer at once: bytes over time, slowest rank."""
    import torch
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    group = dist.group.WORLD
    rank, world = dist.get_rank(), dist.get_world_size()
    size = 256 << 20
    buf = symm_mem.empty(size, dtype=torch.uint8, device=dev)
    handle = symm_mem.rendezvous(buf, group)
    peer = handle.get_buffer((rank + 1) % world, (size,), torch.uint8)
    src = torch.randint(0, 255, (size,), dtype=torch.uint8, device=dev)
    dist.barrier()
    ms = _event_ms(lambda: peer.copy_(src), reps=10)
    slowest = torch.tensor([ms], device=dev)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return size / (float(slowest.item()) * 1e-3) / 1e9


def _exchange_us(dev) -> float:
    """The counts exchange kernel's device time in a tiny real-EP forward (it includes the wait for peers)."""
    import torch
    import torch.distributed as dist

    from ..runtime import Workspace, moe_forward

    world = dist.get_world_size()
    tokens, dim, hidden, experts, top_k = 64, 256, 256, 2 * world, 2
    ws = Workspace.for_group(dist.group.WORLD, num_tokens=tokens, dim=dim, hidden=hidden, num_experts=experts,
                             top_k=top_k, dtype=torch.bfloat16, device=dev)
    gen = torch.Generator(device=dev).manual_seed(dist.get_rank())
    x = torch.randn(tokens, dim, generator=gen, device=dev).to(torch.bfloat16)
    probs = torch.softmax(torch.randn(tokens, experts, generator=gen, device=dev), 1)
    scores, indices = probs.topk(top_k, dim=1)
    w1 = torch.randn(experts // world, hidden, dim, generator=gen, device=dev).to(torch.bfloat16) * 0.05
    w3 = torch.randn(experts // world, hidden, dim, generator=gen, device=dev).to(torch.bfloat16) * 0.05
    w2 = torch.randn(experts // world, dim, hidden, generator=gen, device=dev).to(torch.bfloat16) * 0.05

    def call():
        dist.barrier()
        moe_forward(x, scores, indices, w1, w2, w3, workspace=ws, schedule="fused", score_before_experts=False)

    times = _named(_kernel_times(call), "exchange_counts")
    return 1e3 * (times[0] if times else float("nan"))


# ---- command line ----------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv.pop(0) if argv and argv[0] in ("measure", "refit", "fit", "check") else "measure"
    ap = argparse.ArgumentParser(prog=f"python -m titan_uniep.tuning.calibrate {command}",
                                 description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    if command == "measure":
        ap.add_argument("--out", required=True, help="JSON file for the constants")
        ap.add_argument("--tiles", choices=("defaults", "grid"), default="defaults",
                        help="tile configurations to measure (grid: every one of space.GRID_STAGES; slower)")
        ap.add_argument("--tokens", type=int, default=8192, help="tokens of the dense calibration layer")
    elif command == "refit":
        ap.add_argument("--constants", required=True, help="constants JSON written by measure (with its samples)")
        ap.add_argument("--out", required=True, help="JSON file for the constants fitted again")
    else:
        ap.add_argument("--constants", help="constants JSON (default: the uncalibrated H200 constants)")
        ap.add_argument("--measurements", required=True, help="JSON list of measurement records")
        if command == "fit":
            ap.add_argument("--out", required=True, help="JSON file for the fitted constants")
        else:
            ap.add_argument("--tolerance", type=float, default=0.15, help="largest relative error of a total")
    args = ap.parse_args(argv)

    if command == "measure":
        import torch
        import torch.distributed as dist

        if not torch.cuda.is_available():
            ap.error("measure needs a CUDA GPU (fit and check run anywhere)")
        if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group("nccl")
        rank = dist.get_rank() if dist.is_initialized() else 0
        hw = measure(tiles=args.tiles, tokens=args.tokens, log=print if rank == 0 else (lambda *a: None))
        if rank == 0:
            save_constants(hw, args.out)
            print(f"wrote {args.out}: {hw.source}")
        if dist.is_initialized():
            dist.destroy_process_group()
        return 0
    if command == "refit":
        hw = load_constants(args.constants)
        if not hw.calibration_samples:
            ap.error(f"{args.constants} holds no calibration samples (written before they were kept): run measure")
        fitted = fit_samples(hw, hw.calibration_samples)
        save_constants(fitted, args.out)
        print(f"wrote {args.out}: {fitted.source}")
        return 0
    hw = load_constants(args.constants) if args.constants else default_constants("NVIDIA H200")
    records = json.loads(Path(args.measurements).read_text())
    if command == "fit":
        fitted = fit(hw, records)
        save_constants(fitted, args.out)
        table, _ = check(fitted, records)
        print(table)
        print(f"wrote {args.out}: stage_scale {fitted.stage_scale}, dispatch_overlap {fitted.dispatch_overlap}, "
              f"reduce_tail {fitted.reduce_tail}")
        return 0
    table, ok = check(hw, records, args.tolerance)
    print(table)
    print(f"{'every' if ok else 'NOT every'} total within {args.tolerance:.0%} ({hw.source})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
