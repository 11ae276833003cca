"""One-GPU probe: expert weight-gradient kernel variants against torch's grouped GEMM.

The kernel (``kernels.wgrad.expert_weight_grad_kernel``) reads dense slot rows
(tensor descriptors or pointer loads); the first version of this probe (the
"Backward, run 9" table of docs/performance.md) also timed a variant that
gathered the x / dOut rows through ``slot_copy``, which was slower and is not
kept.

Per rank of EP=2 (rows per local expert balanced, each expert's slot range
padded to 128 rows; the padding and unused rows hold NaN, so a kernel that
reads past an expert's rows fails the check). Prints, per shape and variant,
the median time, TFLOP/s and the relative error against fp32 torch.

    python scripts/probe_wgrad.py [--shapes qwen3,deepseek,mixtral] [--quick]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import triton

from titan_uniep.kernels.route import ROUTE_TABLE_ROWS, ROW_EXPERT_BASE, ROW_ROWS
from titan_uniep.kernels.wgrad import expert_weight_grad_kernel

from probe_common import SHAPES, time_ms as bench

def setup(name, dev):
    t, d, h, e, k = SHAPES[name]
    el = e // 2
    rows_total = 2 * t * k // 2  # rows received by one rank (balanced)
    g = torch.Generator().manual_seed(0)
    rows = torch.full((el,), rows_total // el, dtype=torch.int64)
    noise = torch.randint(-(rows_total // el) // 8, (rows_total // el) // 8 + 1, (el,), generator=g)
    rows = (rows + noise).clamp(min=0)
    rows[0] = 0 if el > 2 else rows[0]  # one empty expert where there are several
    lo = torch.zeros(el, dtype=torch.int64)
    acc = 0
    for i in range(el):
        lo[i] = acc
        acc += (int(rows[i]) + 127) // 128 * 128
    s = acc + 128
    n_tok = 2 * t  # token rows in the receive buffer (per source rank x tokens)
    tokens = torch.randn(n_tok, 2 * d, device=dev).to(torch.bfloat16)
    slot_copy = torch.full((s,), -1, dtype=torch.int32)
    for i in range(el):
        r = int(rows[i])
        slot_copy[lo[i]:lo[i] + r] = torch.randint(0, n_tok * k, (r,), generator=g, dtype=torch.int32)
    slot_copy = slot_copy.to(dev)
    nan = float("nan")
    dh1 = torch.full((s, h), nan, device=dev, dtype=torch.bfloat16)
    dh3 = torch.full((s, h), nan, device=dev, dtype=torch.bfloat16)
    hh = torch.full((s, h), nan, device=dev, dtype=torch.bfloat16)
    for i in range(el):
        r = int(rows[i])
        for buf in (dh1, dh3, hh):
            buf[lo[i]:lo[i] + r] = torch.randn(r, h, device=dev).to(torch.bfloat16)
    tables = torch.zeros(1, ROUTE_TABLE_ROWS, e, dtype=torch.int32)
    tables[0, ROW_EXPERT_BASE, :el] = lo.to(torch.int32)
    tables[0, ROW_ROWS, :el] = rows.to(torch.int32)
    return dict(t=t, d=d, h=h, e=e, k=k, el=el, s=s, rows=rows, lo=lo, tokens=tokens, slot_copy=slot_copy,
                dh1=dh1, dh3=dh3, hh=hh, tables=tables.to(dev))


def reference(p):
    """fp32 dW1, dW3 (El, H, D) and dW2 (El, D, H) on a sample of experts."""
    out = {}
    for i in range(p["el"]):
        lo, r = int(p["lo"][i]), int(p["rows"][i])
        sl = slice(lo, lo + r)
        tok = (p["slot_copy"][sl].long() // p["k"])
        x = p["tokens"][tok, :p["d"]].float()
        dy = p["tokens"][tok, p["d"]:].float()
        out[i] = (p["dh1"][sl].float().T @ x, p["dh3"][sl].float().T @ x, dy.T @ p["hh"][sl].float())
    return out


def run_kernel(p, kind, cfg, dense):
    """kind: 'w13' or 'w2'; cfg: (BM, BN, BK, warps, stages, tma); dense: the x (w13) or dOut (w2) rows (S, D)."""
    bm, bn, bk, warps, stages, tma = cfg
    d, h, el, e = p["d"], p["h"], p["el"], p["e"]
    if kind == "w13":
        m, n = h, d
        out1 = torch.empty(el, h, d, device=p["dh1"].device, dtype=torch.bfloat16)
        out2 = torch.empty_like(out1)
        a1, a2, b, two = p["dh1"], p["dh3"], dense, True
    else:
        m, n = d, h
        out1 = torch.empty(el, d, h, device=p["dh1"].device, dtype=torch.bfloat16)
        out2 = out1
        a1, a2, b, two = dense, dense, p["hh"], False
    grid = (el * triton.cdiv(m, bm) * triton.cdiv(n, bn), 1)

    def go():
        expert_weight_grad_kernel[grid](
            a1, a2, a1.stride(0), 0, b, b.stride(0), 0, p["tables"], out1, out2, 0,
            M=m, N=n, NUM_EXPERTS_LOCAL=el, NUM_EXPERTS=e, BM=bm, BN=bn, BK=bk, GROUP=8, TWO_A=two, TMA=tma,
            STAGES=stages, PRECISION="tf32", INTERPRET=False, num_warps=warps, num_stages=stages,
        )
    return go, (out1, out2)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="qwen3,deepseek,mixtral")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    dev = torch.device("cuda")
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device=dev))
    w13_cfgs = [(128, 128, 64, 8, 3, True), (128, 128, 64, 8, 4, True), (128, 128, 64, 8, 3, False),
                (64, 256, 64, 8, 3, True), (128, 128, 32, 8, 5, True)]
    w2_cfgs = [(128, 256, 64, 8, 3, True), (128, 128, 64, 8, 4, True), (128, 128, 64, 4, 4, True),
               (128, 256, 64, 8, 3, False), (256, 128, 64, 8, 3, True)]
    if args.quick:
        w13_cfgs, w2_cfgs = w13_cfgs[:2], w2_cfgs[:2]
    for name in args.shapes.split(","):
        t0 = time.time()
        p = setup(name, dev)
        ref = reference(p)
        d, h, el = p["d"], p["h"], p["el"]
        nrows = int(p["rows"].sum())
        flop13 = 2 * 2 * nrows * d * h
        flop2 = 2 * nrows * d * h
        res = dict(shape=name, rows=nrows)

        def err(outs, kind):
            worst = 0.0
            for i, (r1, r3, r2) in ref.items():
                pairs = [(outs[0][i], r1), (outs[1][i], r3)] if kind == "w13" else [(outs[0][i], r2)]
                for got, want in pairs:
                    scale = want.abs().max().clamp(min=1e-6)
                    worst = max(worst, float((got.float() - want).abs().max() / scale))
            return worst

        # Dense slot rows for the dense-B / dense-A variants, and the cost of making them.
        tok_idx = (p["slot_copy"].clamp(min=0).long() // p["k"])
        xs = p["tokens"][tok_idx, :d].contiguous()
        dys = p["tokens"][tok_idx, d:].contiguous()
        res["gather_ms"] = bench(lambda: (p["tokens"][tok_idx]))
        for kind, cfgs, flop in (("w13", w13_cfgs, flop13), ("w2", w2_cfgs, flop2)):
            for cfg in cfgs:
                for dense in (xs if kind == "w13" else dys,):
                    label = f"{kind} {cfg} {'tma' if cfg[5] else 'pointer loads'}"
                    try:
                        go, outs = run_kernel(p, kind, cfg, dense)
                        for o in outs:
                            o.fill_(float("nan"))
                        go()
                        torch.cuda.synchronize()
                        e_ = err(outs, kind)
                        ms = bench(go)
                        print(f"{name:9s} {label:48s} {ms:8.3f} ms {flop / ms / 1e9:6.0f} TF/s err {e_:.2e}",
                              flush=True)
                        res[label] = (round(ms, 3), round(e_, 5))
                    except Exception as exc:  # noqa: BLE001 - a probe reports and goes on
                        print(f"{name:9s} {label:48s} FAILED {type(exc).__name__}: {str(exc)[:300]}", flush=True)
        # torch's grouped GEMM on dense rows (what TorchTitan's backward runs); expert groups
        # must be contiguous there: compact the rows.
        try:
            keep = torch.cat([torch.arange(int(p["lo"][i]), int(p["lo"][i]) + int(p["rows"][i])) for i in range(el)])
            keep = keep.to(dev)
            offs = torch.cumsum(p["rows"], 0).to(torch.int32).to(dev)
            xc, dyc = xs[keep], dys[keep]
            d1c, d3c, hc = p["dh1"][keep], p["dh3"][keep], p["hh"][keep]

            def gm13():
                torch._grouped_mm(d1c.t(), xc, offs=offs, out_dtype=torch.bfloat16)
                torch._grouped_mm(d3c.t(), xc, offs=offs, out_dtype=torch.bfloat16)

            def gm2():
                torch._grouped_mm(dyc.t(), hc, offs=offs, out_dtype=torch.bfloat16)
            ms13, ms2 = bench(gm13), bench(gm2)
            print(f"{name:9s} {'torch._grouped_mm w13':48s} {ms13:8.3f} ms {flop13 / ms13 / 1e9:6.0f} TF/s", flush=True)
            print(f"{name:9s} {'torch._grouped_mm w2':48s} {ms2:8.3f} ms {flop2 / ms2 / 1e9:6.0f} TF/s", flush=True)
            res["grouped_mm"] = (round(ms13, 3), round(ms2, 3))
        except Exception as exc:  # noqa: BLE001
            print(f"{name:9s} grouped_mm FAILED {type(exc).__name__}: {str(exc)[:300]}", flush=True)
        print("JSON", json.dumps(res), flush=True)
        print(f"{name}: {time.time() - t0:.0f} s", flush=True)
        del p, xs, dys
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
