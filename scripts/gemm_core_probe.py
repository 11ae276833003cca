"""Candidate GEMM cores for UniEP's expert tiles, alone, on one GPU: which one
Triton 3.6 runs fastest on sm_90 at the layer's shapes, before a core moves
into the megakernels.

    python3 scripts/gemm_core_probe.py --shape qwen3_1gpu --shape deepseek_1gpu
    python3 scripts/gemm_core_probe.py --shape qwen3_1gpu --variants '[{"loop": "ws", "b_tma": true}]'
    python3 scripts/gemm_core_probe.py --compile-only     # no GPU: compile every variant for sm_90, report

Each core is a persistent grouped GEMM over the slot layout UniEP's tiles
see: every expert's rows contiguous (padded to 8 rows, as the GEMM-only
reference pads them), ``BM``-row tiles of one expert each (the last one
partial), a tile table on the device.

- ``fc1``: ``h = silu(x[rows] @ w1[e]^T) * (x[rows] @ w3[e]^T)`` with
  TorchTitan's roundings (each product rounded to bf16, the SiLU in fp32,
  rounded, times h3); A is gathered (``rows``: each slot's token row), as
  the dispatched token rows are.
- ``fc2``: ``y = h @ w2[e]^T`` on the slots' contiguous h rows.

Variant knobs (a JSON dict each, over the default core):

- ``loop``: ``"claim"`` (tiles in program order, a plain persistent loop),
  ``"flat"`` (``tl.range(..., flatten=True)``: Triton pipelines the next
  tile's loads across this tile's epilogue), ``"ws"`` (``tl.range(...,
  warp_specialize=True)``: producer and consumer warps);
- ``b_tma``: the weight tiles through device-made tensor descriptors;
  ``a_tma`` (fc2 only): the h rows too;
- ``bm``, ``bn``, ``bk``, ``warps``, ``stages``, ``group_m``.

Each variant's output is compared with ``torch._grouped_mm`` on the same
rows (max relative difference; bf16 rounding apart, the cores sum in fp32
like it), then timed against it in alternating rounds
(``titan_uniep.timing.time_alternating``), with the TF/s and the share of a
bf16 peak measured in the same run (``titan_uniep.tools.peers``).
``--compile-only`` needs no GPU: it compiles every variant for sm_90 and
prints whether its inner loop issues wgmma, the registers, spills and
shared memory ptxas reports, and whether Triton split it into warp groups.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from titan_uniep.shapes import add_shape_argument  # noqa: E402

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
DEFAULT = dict(loop="claim", b_tma=False, a_tma=False, bm=128, bn=128, bk=64, warps=8, stages=3, group_m=8)
VARIANTS = {
    "fc1": [{}, {"loop": "flat"}, {"loop": "flat", "b_tma": True}, {"loop": "ws", "b_tma": True},
            {"bn": 64, "warps": 4, "loop": "flat", "b_tma": True}],
    "fc2": [{"bn": 256}, {"bn": 256, "loop": "flat"}, {"bn": 256, "loop": "flat", "a_tma": True, "b_tma": True},
            {"bn": 256, "loop": "ws", "a_tma": True, "b_tma": True}, {"loop": "flat", "a_tma": True, "b_tma": True}],
}


@triton.jit
def _task_tile(task, tile_expert, tile_start, tile_end, num_tiles, N: tl.constexpr, BM: tl.constexpr,
               BN: tl.constexpr, GROUP_M: tl.constexpr):
    """A task's expert, first slot, slot offsets and mask, and first column: ``GROUP_M``
    row tiles walked together per column block."""
    per_group = GROUP_M * tl.cdiv(N, BN)
    first = (task // per_group) * GROUP_M
    rows_in_group = tl.minimum(num_tiles - first, GROUP_M)
    tile = first + (task % per_group) % rows_in_group
    expert = tl.load(tile_expert + tile)
    m0 = tl.load(tile_start + tile)
    offs_m = m0 + tl.arange(0, BM)
    return expert, m0, offs_m, offs_m < tl.load(tile_end + tile), (task % per_group) // rows_in_group * BN


@triton.jit
def _fc1_task(task, x, rows, tile_expert, tile_start, tile_end, num_tiles, w1, w3, h, w1_desc, w3_desc,
              DIM: tl.constexpr, HIDDEN: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
              GROUP_M: tl.constexpr, B_TMA: tl.constexpr):
    expert, m0, offs_m, mask_m, n0 = _task_tile(task, tile_expert, tile_start, tile_end, num_tiles, HIDDEN, BM, BN,
                                                GROUP_M)
    token = tl.load(rows + offs_m, mask=mask_m, other=0).to(tl.int64)
    offs_n = n0 + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    w_rows = (expert * HIDDEN + offs_n).to(tl.int64)
    acc1 = tl.zeros((BM, BN), dtype=tl.float32)
    acc3 = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(0, DIM, BK):
        a = tl.load(x + token[:, None] * DIM + (k + offs_k)[None, :], mask=mask_m[:, None])
        if B_TMA:
            b1 = w1_desc.load([expert * HIDDEN + n0, k])
            b3 = w3_desc.load([expert * HIDDEN + n0, k])
        else:
            b1 = tl.load(w1 + w_rows[:, None] * DIM + (k + offs_k)[None, :], mask=(offs_n < HIDDEN)[:, None])
            b3 = tl.load(w3 + w_rows[:, None] * DIM + (k + offs_k)[None, :], mask=(offs_n < HIDDEN)[:, None])
        acc1 = tl.dot(a, tl.trans(b1), acc1)
        acc3 = tl.dot(a, tl.trans(b3), acc3)
    out_ty = h.dtype.element_ty
    gate = acc1.to(out_ty).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ty).to(tl.float32)
    y = (act * acc3.to(out_ty).to(tl.float32)).to(out_ty)
    tl.store(h + offs_m[:, None].to(tl.int64) * HIDDEN + offs_n[None, :], y,
             mask=mask_m[:, None] & (offs_n < HIDDEN)[None, :])


@triton.jit
def fc1_core(x, rows, tile_expert, tile_start, tile_end, num_tiles, w1, w3, h,
             DIM: tl.constexpr, HIDDEN: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
             GROUP_M: tl.constexpr, LOOP: tl.constexpr, B_TMA: tl.constexpr, E: tl.constexpr,
             INTERPRET: tl.constexpr = False):
    total = num_tiles * tl.cdiv(HIDDEN, BN)
    w1_desc = w1
    w3_desc = w3
    if B_TMA:
        w1_desc = tl.make_tensor_descriptor(w1, shape=[E * HIDDEN, DIM], strides=[DIM, 1], block_shape=[BN, BK])
        w3_desc = tl.make_tensor_descriptor(w3, shape=[E * HIDDEN, DIM], strides=[DIM, 1], block_shape=[BN, BK])
    if INTERPRET:  # the interpreter takes no tensor loop bounds
        task = tl.program_id(0)
        while task < total:
            _fc1_task(task, x, rows, tile_expert, tile_start, tile_end, num_tiles, w1, w3, h, w1_desc, w3_desc,
                      DIM, HIDDEN, BM, BN, BK, GROUP_M, B_TMA)
            task += tl.num_programs(0)
    else:
        for task in tl.range(tl.program_id(0), total, tl.num_programs(0), flatten=LOOP == "flat",
                             warp_specialize=LOOP == "ws"):
            _fc1_task(task, x, rows, tile_expert, tile_start, tile_end, num_tiles, w1, w3, h, w1_desc, w3_desc,
                      DIM, HIDDEN, BM, BN, BK, GROUP_M, B_TMA)


@triton.jit
def _fc2_task(task, h, tile_expert, tile_start, tile_end, num_tiles, w2, y, h_desc, w2_desc,
              DIM: tl.constexpr, HIDDEN: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
              GROUP_M: tl.constexpr, A_TMA: tl.constexpr, B_TMA: tl.constexpr):
    expert, m0, offs_m, mask_m, n0 = _task_tile(task, tile_expert, tile_start, tile_end, num_tiles, DIM, BM, BN,
                                                GROUP_M)
    offs_n = n0 + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    w_rows = (expert * DIM + offs_n).to(tl.int64)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(0, HIDDEN, BK):
        if A_TMA:
            a = h_desc.load([m0, k])  # rows past the tile (the next expert's) reach masked outputs only
        else:
            a = tl.load(h + offs_m[:, None].to(tl.int64) * HIDDEN + (k + offs_k)[None, :], mask=mask_m[:, None])
        if B_TMA:
            b = w2_desc.load([expert * DIM + n0, k])
        else:
            b = tl.load(w2 + w_rows[:, None] * HIDDEN + (k + offs_k)[None, :], mask=(offs_n < DIM)[:, None])
        acc = tl.dot(a, tl.trans(b), acc)
    tl.store(y + offs_m[:, None].to(tl.int64) * DIM + offs_n[None, :], acc.to(y.dtype.element_ty),
             mask=mask_m[:, None] & (offs_n < DIM)[None, :])


@triton.jit
def fc2_core(h, tile_expert, tile_start, tile_end, num_tiles, w2, y, slots,
             DIM: tl.constexpr, HIDDEN: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
             GROUP_M: tl.constexpr, LOOP: tl.constexpr, A_TMA: tl.constexpr, B_TMA: tl.constexpr, E: tl.constexpr,
             INTERPRET: tl.constexpr = False):
    total = num_tiles * tl.cdiv(DIM, BN)
    h_desc = h
    w2_desc = w2
    if A_TMA:
        h_desc = tl.make_tensor_descriptor(h, shape=[slots, HIDDEN], strides=[HIDDEN, 1], block_shape=[BM, BK])
    if B_TMA:
        w2_desc = tl.make_tensor_descriptor(w2, shape=[E * DIM, HIDDEN], strides=[HIDDEN, 1], block_shape=[BN, BK])
    if INTERPRET:  # the interpreter takes no tensor loop bounds
        task = tl.program_id(0)
        while task < total:
            _fc2_task(task, h, tile_expert, tile_start, tile_end, num_tiles, w2, y, h_desc, w2_desc,
                      DIM, HIDDEN, BM, BN, BK, GROUP_M, A_TMA, B_TMA)
            task += tl.num_programs(0)
    else:
        for task in tl.range(tl.program_id(0), total, tl.num_programs(0), flatten=LOOP == "flat",
                             warp_specialize=LOOP == "ws"):
            _fc2_task(task, h, tile_expert, tile_start, tile_end, num_tiles, w2, y, h_desc, w2_desc,
                      DIM, HIDDEN, BM, BN, BK, GROUP_M, A_TMA, B_TMA)


def slot_layout(counts: torch.Tensor, bm: int, device) -> dict[str, torch.Tensor]:
    """Every expert's rows contiguous, each group padded to 8 rows; tiles of
    ``bm`` rows of one expert (the tile table) and the group offsets."""
    sizes = (counts + 7) // 8 * 8
    starts = torch.cumsum(sizes, 0) - sizes
    expert, start, end = [], [], []
    for e, (s, n) in enumerate(zip(starts.tolist(), sizes.tolist())):
        for m0 in range(s, s + n, bm):
            expert.append(e), start.append(m0), end.append(min(m0 + bm, s + n))
    as_i32 = lambda v: torch.tensor(v or [0], dtype=torch.int32, device=device)  # noqa: E731
    return dict(sizes=sizes, offsets=torch.cumsum(sizes, 0).to(torch.int32).to(device), tile_expert=as_i32(expert),
                tile_start=as_i32(start), tile_end=as_i32(end),
                num_tiles=len(expert))


def layer_rows(shape, device, seed: int = 0, dtype: torch.dtype = torch.bfloat16, skew: bool = False):
    """The rows of one layer at EP = 1: x, each slot's token row (balanced
    top-k routing of random logits; ``skew``: expert 0 in nearly every
    token's choice, expert 3 in none), weights, the slot counts per expert."""
    tokens, dim, hidden, experts, top_k = shape
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(tokens, dim, generator=gen, device=device).to(dtype)
    w1, w3 = ((torch.randn(experts, hidden, dim, generator=gen, device=device) * dim**-0.5).to(dtype)
              for _ in range(2))
    w2 = (torch.randn(experts, dim, hidden, generator=gen, device=device) * hidden**-0.5).to(dtype)
    logits = torch.randn(tokens, experts, generator=gen, device=device)
    if skew:
        logits[:, 0] += 3.0
        logits[:, 3] = float("-inf")
    chosen = logits.topk(top_k, dim=1).indices.flatten()
    counts = torch.bincount(chosen, minlength=experts)
    order = torch.argsort(chosen, stable=True)
    token_of_copy = order // top_k
    sizes = (counts + 7) // 8 * 8
    rows = torch.zeros(int(sizes.sum()), dtype=torch.int32, device=device)  # padding rows: token 0
    starts = torch.cumsum(sizes, 0) - sizes
    seen = torch.cumsum(counts, 0) - counts
    slot = torch.repeat_interleave(starts - seen, counts) + torch.arange(len(order), device=device)
    rows[slot] = token_of_copy.to(torch.int32)
    return x, rows, w1, w2, w3, counts


def run_fc1(v, x, rows, w1, w3, layout, programs, h=None):
    h = torch.empty(rows.shape[0], w1.shape[1], dtype=x.dtype, device=x.device) if h is None else h

    def call():
        fc1_core[(programs,)](x, rows, layout["tile_expert"], layout["tile_start"], layout["tile_end"],
                              layout["num_tiles"], w1, w3, h, DIM=x.shape[1], HIDDEN=w1.shape[1], BM=v["bm"],
                              BN=v["bn"], BK=v["bk"], GROUP_M=v["group_m"], LOOP=v["loop"], B_TMA=v["b_tma"],
                              E=w1.shape[0], INTERPRET=INTERPRETING, num_warps=v["warps"],
                              num_stages=v["stages"])
        return h
    return call


def run_fc2(v, h, w2, layout, programs, y=None):
    y = torch.empty(h.shape[0], w2.shape[1], dtype=h.dtype, device=h.device) if y is None else y

    def call():
        fc2_core[(programs,)](h, layout["tile_expert"], layout["tile_start"], layout["tile_end"], layout["num_tiles"],
                              w2, y, h.shape[0], DIM=w2.shape[1], HIDDEN=h.shape[1], BM=v["bm"], BN=v["bn"],
                              BK=v["bk"], GROUP_M=v["group_m"], LOOP=v["loop"], A_TMA=v["a_tma"], B_TMA=v["b_tma"],
                              E=w2.shape[0], INTERPRET=INTERPRETING, num_warps=v["warps"],
                              num_stages=v["stages"])
        return y
    return call


def name_of(v: dict) -> str:
    return ",".join(f"{k}={v[k]}" for k in DEFAULT if v[k] != DEFAULT[k]) or "default"


def probe_shape(name, shape, variants, args, peak):
    from titan_uniep.accuracy import rel_diff
    from titan_uniep.timing import time_alternating

    dev = torch.device("cuda")
    x, rows, w1, w2, w3, counts = layer_rows(shape, dev)
    programs = torch.cuda.get_device_properties(dev).multi_processor_count
    offsets = torch.cumsum((counts + 7) // 8 * 8, 0).to(torch.int32)
    a = x[rows.long()]
    w13t = (w1.transpose(-2, -1), w3.transpose(-2, -1))
    ref_h = (torch.nn.functional.silu(torch._grouped_mm(a, w13t[0], offs=offsets).float()).to(x.dtype).float()
             * torch._grouped_mm(a, w13t[1], offs=offsets).float()).to(x.dtype)
    ref_y = torch._grouped_mm(ref_h, w2.transpose(-2, -1), offs=offsets)
    flops = {"fc1": 2 * 2 * a.shape[0] * x.shape[1] * w1.shape[1], "fc2": 2 * a.shape[0] * x.shape[1] * w1.shape[1]}
    paths = {
        "fc1 grouped_mm": lambda: lambda: (torch._grouped_mm(a, w13t[0], offs=offsets),
                                           torch._grouped_mm(a, w13t[1], offs=offsets)),
        "fc2 grouped_mm": lambda: lambda: torch._grouped_mm(ref_h, w2.transpose(-2, -1), offs=offsets),
    }
    errors = {}
    for stage in ("fc1", "fc2"):
        for change in variants[stage]:
            v = {**DEFAULT, **change}
            layout = slot_layout(counts, v["bm"], dev)
            key = f"{stage} {name_of(v)}"
            try:
                call = run_fc1(v, x, rows, w1, w3, layout, programs) if stage == "fc1" else \
                    run_fc2(v, ref_h, w2, layout, programs)
                errors[key] = rel_diff(call(), ref_h if stage == "fc1" else ref_y)
                paths[key] = lambda call=call: call
            except Exception as error:  # noqa: BLE001 - one variant that does not build must not hide the others
                errors[key] = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
    times = time_alternating(paths, warmup=args.warmup, reps=args.reps, rounds=args.rounds)
    print(f"\n{name} {shape}: bf16 peak {peak:.0f} TF/s")
    print("| core | ms | TF/s | share of peak | vs grouped_mm | max rel diff vs grouped_mm |")
    print("|---|---|---|---|---|---|")
    for key, ms in times.items():
        stage = key.split()[0]
        base = times.get(f"{stage} grouped_mm")
        tf = flops[stage] / ms / 1e9 if ms else None
        print(f"| {key} | {ms:.3f} | {tf:.0f} | {tf / peak:.1%} | {base / ms:.3f}x | {errors.get(key, '-')} |"
              if ms else f"| {key} | failed | | | | {errors.get(key, '-')} |")
    for key, err in errors.items():
        if key not in times:
            print(f"| {key} | not built | | | | {err} |")
    return {"shape": name, "times": times, "errors": errors, "peak_tflops": peak}


def interpreter_check() -> int:
    """Every built-in variant's knobs at tiny tiles, in Triton's interpreter
    (fp32: its bf16 ``tl.dot`` is wrong), against float64; skewed routing, an
    expert with no rows, partial tiles, E not a multiple of anything."""
    import triton.runtime.interpreter  # noqa: F401 - TRITON_INTERPRET=1 must be set before this module loaded

    shape = (37, 32, 48, 5, 2)
    x, rows, w1, w2, w3, counts = layer_rows(shape, "cpu", seed=3, dtype=torch.float32, skew=True)
    assert counts[3] == 0 and counts[0] == shape[0], counts
    status = 0
    for stage in ("fc1", "fc2"):
        for change in VARIANTS[stage]:
            v = {**DEFAULT, **change, "bm": 16, "bn": 16, "bk": 16, "stages": 1, "warps": 4}
            layout = slot_layout(counts, v["bm"], "cpu")
            expert = torch.repeat_interleave(torch.arange(len(counts)), layout["sizes"])
            a = x[rows.long()].double()
            h1 = torch.einsum("sd,shd->sh", a, w1.double()[expert])
            h3 = torch.einsum("sd,shd->sh", a, w3.double()[expert])
            want_h = torch.nn.functional.silu(h1) * h3
            poison = torch.full((rows.shape[0], shape[1] if stage == "fc2" else shape[2]), float("nan"))
            if stage == "fc1":
                got, want = run_fc1(v, x, rows, w1, w3, layout, 3, h=poison)(), want_h
            else:
                got, want = run_fc2(v, want_h.float(), w2, layout, 3, y=poison)(), torch.einsum(
                    "sh,sdh->sd", want_h, w2.double()[expert])
            err = ((got.double() - want).abs().max() / want.abs().max()).item()  # NaN (a slot not written) fails
            ok = err < 1e-5
            status |= not ok
            print(f"{stage} {name_of(v)}: max rel diff vs float64 {err:.2e} {'ok' if ok else 'WRONG'}")
    return status


def compile_report(variants) -> int:
    """Compile every variant for sm_90 (no GPU needed) and print what came out."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sys.path.insert(0, str(REPO / "tests"))
    from sm90_compile import ptxas_usage  # the bundled ptxas' registers and spills

    status = 0
    for stage, kernel in (("fc1", fc1_core), ("fc2", fc2_core)):
        for change in variants[stage]:
            v = {**DEFAULT, **change}
            consts = dict(DIM=2048, HIDDEN=768, BM=v["bm"], BN=v["bn"], BK=v["bk"], GROUP_M=v["group_m"],
                          LOOP=v["loop"], B_TMA=v["b_tma"], E=128)
            if stage == "fc2":
                consts["A_TMA"] = v["a_tma"]
            sig = {p.name: ("constexpr" if p.is_constexpr else
                            "*bf16" if p.name in ("x", "w1", "w3", "h", "w2", "y") else
                            "*i32" if p.name in ("rows", "tile_expert", "tile_start", "tile_end")
                            else "i32") for p in kernel.params}
            attrs = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(kernel.params)
                     if sig[p.name].startswith("*")}
            try:
                out = triton.compile(ASTSource(kernel, sig, constexprs=consts, attrs=attrs),
                                     target=GPUTarget("cuda", 90, 32),
                                     options=dict(num_warps=v["warps"], num_stages=v["stages"]))
            except Exception as error:  # noqa: BLE001
                print(f"{stage} {name_of(v)}: does not compile: {str(error).splitlines()[0][:300]}")
                status = 1
                continue
            ptx, ttgir = out.asm["ptx"], out.asm["ttgir"]
            registers, spills = ptxas_usage(ptx)
            print(f"{stage} {name_of(v)}: wgmma {'yes' if 'wgmma.mma_async' in ptx else 'NO'}, "
                  f"tensor copies {ptx.count('cp.async.bulk.tensor')}, "
                  f"warp groups {'yes' if 'ttg.warp_specialize' in ttgir else 'no'}, "
                  f"registers {registers}, spill stores {spills} B, shared {out.metadata.shared} B")
    return status


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_argument(ap, default=("qwen3_1gpu",))
    ap.add_argument("--variants", default=None,
                    help='JSON {"fc1": [...], "fc2": [...]} of variant dicts (default: the built-in list)')
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--compile-only", action="store_true", help="compile every variant for sm_90 and report (no GPU)")
    ap.add_argument("--interpreter-check", action="store_true",
                    help="run the built-in variants on CPU under TRITON_INTERPRET=1 against float64")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args(argv)
    if args.interpreter_check:
        return interpreter_check()
    variants = {**VARIANTS, **(json.loads(args.variants) if args.variants else {})}
    if args.compile_only:
        return compile_report(variants)
    if not torch.cuda.is_available():
        ap.error("timing the cores needs a CUDA GPU (--compile-only runs without one)")
    from titan_uniep.runtime.launch import _tma_allocator
    from titan_uniep.tools.peers import measured_peak_tflops

    triton.set_allocator(_tma_allocator)
    peak = measured_peak_tflops("cuda")
    records = [probe_shape(name, shape, variants, args, peak) for name, shape in args.shapes]
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(records, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
