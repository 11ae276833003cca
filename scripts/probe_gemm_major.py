"""One-GPU probe: what slows the dH tile's G = dOut @ w2 loop? A plain Triton GEMM
C = A @ B (M rows, 128 x 128 x 64 tiles, 8 warps, 3 stages) with:
A rows gathered through an index or contiguous; B N-contiguous (w2 (D, H) as the
dH tile reads it) or K-contiguous (w2 transposed); B by pointer or tensor descriptor.

    python scripts/probe_gemm_major.py
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from probe_common import time_ms as bench


@triton.jit
def gemm_kernel(a_ptr, idx_ptr, b_ptr, c_ptr, M, N: tl.constexpr, K: tl.constexpr, a_stride,
                BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GATHER: tl.constexpr, B_KMAJOR: tl.constexpr,
                TMA_B: tl.constexpr, STAGES: tl.constexpr):
    pid = tl.program_id(0)
    num_n: tl.constexpr = (N + BN - 1) // BN
    pm = pid // num_n
    pn = pid % num_n
    offs_m = pm * BM + tl.arange(0, BM)
    offs_n = pn * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    mask_m = offs_m < M
    if GATHER:
        rows = tl.load(idx_ptr + offs_m, mask=mask_m, other=0).to(tl.int64)
    else:
        rows = offs_m.to(tl.int64)
    a_ptrs = a_ptr + rows[:, None] * a_stride + offs_k[None, :]
    if TMA_B:
        if B_KMAJOR:
            desc = tl.make_tensor_descriptor(b_ptr, shape=[N, K], strides=[K, 1], block_shape=[BN, BK])
        else:
            desc = tl.make_tensor_descriptor(b_ptr, shape=[K, N], strides=[N, 1], block_shape=[BK, BN])
    if B_KMAJOR:  # B stored (N, K): element (k, n) at n * K + k
        b_ptrs = b_ptr + offs_n[None, :].to(tl.int64) * K + offs_k[:, None]
    else:  # B stored (K, N)
        b_ptrs = b_ptr + offs_k[:, None].to(tl.int64) * N + offs_n[None, :]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in tl.range(0, K // BK, num_stages=STAGES):
        a = tl.load(a_ptrs, mask=mask_m[:, None], other=0.0)
        if TMA_B:
            if B_KMAJOR:
                b = tl.trans(desc.load([pn * BN, k * BK]))
            else:
                b = desc.load([k * BK, pn * BN])
        else:
            b = tl.load(b_ptrs)
        acc = tl.dot(a, b, acc)
        a_ptrs += BK
        if B_KMAJOR:
            b_ptrs += BK
        else:
            b_ptrs += BK * N
    c = c_ptr + offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
    tl.store(c, acc.to(tl.bfloat16), mask=mask_m[:, None])


def main():
    dev = torch.device("cuda")
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device=dev))
    for name, m, n, k in (("mixtral", 16384, 14336, 4096), ("qwen3", 65536, 768, 2048)):
        a_rows = torch.randn(m // 2, 2 * k, device=dev).to(torch.bfloat16)  # token rows [x | dOut]
        idx = torch.randint(0, m // 2, (m,), device=dev, dtype=torch.int32)
        a_dense = a_rows[idx.long(), k:].contiguous()
        w_kn = (torch.randn(k, n, device=dev) * k ** -0.5).to(torch.bfloat16)  # (D, H) as w2
        w_nk = w_kn.t().contiguous()
        ref = (a_dense.float() @ w_kn.float())
        c = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
        grid = (triton.cdiv(m, 128) * triton.cdiv(n, 128),)
        flop = 2 * m * n * k
        for gather in (True, False):
            for kmajor in (False, True):
                for tma in (False, True):
                    a_src = a_rows[:, k:] if gather else a_dense
                    a_stride = 2 * k if gather else k

                    def go():
                        gemm_kernel[grid](a_src, idx, w_nk if kmajor else w_kn, c, m, N=n, K=k, a_stride=a_stride,
                                          BM=128, BN=128, BK=64, GATHER=gather, B_KMAJOR=kmajor, TMA_B=tma, STAGES=3,
                                          num_warps=8, num_stages=3)
                    try:
                        c.fill_(float("nan"))
                        go()
                        torch.cuda.synchronize()
                        err = ((c.float() - ref).abs().max() / ref.abs().max()).item()
                        ms = bench(go)
                        print(f"{name:8s} gather={gather!s:5s} B {'K-major' if kmajor else 'N-major'} "
                              f"{'tma' if tma else 'ptr'}: {ms:7.3f} ms {flop / ms / 1e9:5.0f} TF/s err {err:.1e}",
                              flush=True)
                    except Exception as exc:  # noqa: BLE001
                        print(f"{name} gather={gather} kmajor={kmajor} tma={tma} FAILED {str(exc)[:200]}", flush=True)
        ms = bench(lambda: torch.mm(a_dense, w_kn))
        print(f"{name:8s} torch.mm dense: {ms:7.3f} ms {flop / ms / 1e9:5.0f} TF/s", flush=True)


if __name__ == "__main__":
    main()
