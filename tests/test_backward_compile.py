"""The backward megakernels compile for Hopper (sm_90) on a machine without a GPU.

Same approach as test_kernels_compile.py (``sm90_compile``: Triton's wheel
ships ptxas): the whole pipeline runs here for the backward's default
parameters (``params.default_params`` of each shape, every field as
``runtime.backward`` launches it), and the checks are those a GPU-less
machine can make: every GEMM loop (dH, dA, and the Triton weight-gradient
kernel's dW1/dW3 and dW2; dispatch_dh at EP 2 and EP 1) is software-pipelined (async copies or
tensor-descriptor loads into shared memory) and uses wgmma, ptxas' register
spills stay small, shared memory fits an H200 SM, and each kernel fits as
many programs per SM as it is launched with. Runs in a subprocess:
TRITON_INTERPRET must be unset when a kernel is defined for it to be
compilable.
"""

import pytest

from sm90_compile import run_compile_script

# ptxas spill bytes allowed at the default tiles, per kernel: dispatch_dh under
# its 128-register cap spills 4 B with the slot-row copy and scores before the
# experts (D = 2048, H = 768; triton 3.6's ptxas); da_combine and the
# weight-gradient kernel do not spill.
MAX_SPILL_BYTES = {"dispatch_dh": 64, "da_combine": 0, "wgrad": 0}
MAX_SHARED_BYTES = 227 * 1024


def compile_all() -> None:
    import torch
    import triton

    import sm90_compile
    from sm90_compile import arena_types, loops, programs_per_sm, ptxas_usage, route_types
    from titan_uniep.kernels.da_combine import da_combine_kernel
    from titan_uniep.kernels.dispatch_dh import dispatch_dh_kernel, swiglu_backward_kernel
    from titan_uniep.kernels.wgrad import gather_slot_rows_kernel, wgrad_kernel
    from titan_uniep.params import default_params
    from titan_uniep.runtime.backward import da_reduce_dim, dh_max_registers
    from titan_uniep.runtime.workspace import backward_returned_row

    def check(kernel, what, gemm_loops, even, tma=False):
        ttgir = kernel.asm["ttgir"]
        assert "warp_group_dot" in ttgir, f"{what}: no wgmma"
        regs, spills = ptxas_usage(kernel.asm["ptx"])
        shared = kernel.metadata.shared
        print(f"{what}: {regs} registers, {spills} B spilled, {shared} B shared memory")
        assert spills <= MAX_SPILL_BYTES[what.split(" ")[0]], f"{what}: ptxas spills {spills} bytes"
        assert shared <= MAX_SHARED_BYTES, f"{what}: {shared} B of shared memory"
        if even:
            load = "async_tma_copy_global_to_local" if tma else "async_copy_global_to_local"
            pipelined = [b for b in loops(ttgir) if "warp_group_dot " in b and load in b]
            assert len(pipelined) >= gemm_loops, f"{what}: {len(pipelined)} of {gemm_loops} GEMM loops pipelined"

    bf, i32, i64, f32 = torch.bfloat16, torch.int32, torch.int64, torch.float32
    packed = dict(arena=arena_types(bf), route=route_types())
    dh = dict(**packed, x_ptr=bf, g_ptr=bf, scores_ptr=f32, w2_ptr=bf, g32_ptr=f32, slot_rows_ptr=bf, control_ptr=i64)
    da = dict(**packed, dh1_ptr=bf, dh3_ptr=bf, w1_ptr=bf, w3_ptr=bf, ds_parts_ptr=f32, scores_ptr=f32, x_ptr=bf,
              dx_ptr=bf, ds_ptr=f32, control_ptr=i64)
    wg = dict(a1_ptr=bf, a2_ptr=bf, b_ptr=bf, tables_ptr=i32, out1_ptr=bf, out2_ptr=bf)
    gs = dict(arena=arena_types(bf), out_ptr=bf, tables_ptr=i32, x_ptr=bf, g_ptr=bf)
    sw = dict(arena=arena_types(bf), g32_ptr=f32, h13_ptr=bf, h_ptr=bf, dh1_ptr=bf, dh3_ptr=bf, ds_parts_ptr=f32,
              tables_ptr=i32)
    for score_before in (False, True):
        shapes = ((2048, 768, True), (96, 80, False)) + (((7168, 2048, True), (4096, 14336, True))
                                                               if not score_before else ())
        for dim, hidden, even in shapes:
            p = default_params(2, hidden=hidden)  # the parameters as launched for this H (params.DEFAULTS)
            shape = dict(DIM=dim, HIDDEN=hidden, TOP_K=8, SCORE_BEFORE=score_before, PRECISION="tf32",
                         USE_TIMER=True, GROUP_M=p.group_m, BM=p.block_m, KP=8)
            what = f"D={dim} H={hidden} scores {'before' if score_before else 'after'}"
            # The dH tile (G = dOut @ w2); its tasks may also copy the weight
            # gradients' slot rows (dh_copies_rows).
            # (WORLD 1: the tiles gather x and dOut in place, scoreboard.token_rows_of)
            for copy, world in ((False, 2), (True, 2), (True, 1)):
                kernel = sm90_compile.build(dispatch_dh_kernel, dh, dict(
                    NUM_LOCAL=1, WORLD=world, BN=p.dh_block_n, BK=p.dh_block_k, BT=p.dispatch_block_tokens,
                    BD=p.dispatch_block_dim, COPY_ROWS=copy, BDC=min(64, triton.next_power_of_2(dim)), **shape),
                    num_warps=p.dh_num_warps, num_stages=p.dh_num_stages, max_registers=dh_max_registers(p))
                name = f"dispatch_dh (dispatch + dH{', copies rows' if copy else ''}, EP {world}) {what}"
                check(kernel, name, 1, even)
                fit = programs_per_sm(kernel, p.dh_num_warps)
                assert fit >= p.dh_programs_per_sm, f"{name}: {fit} programs fit an SM, launched " \
                    f"with {p.dh_programs_per_sm}"
            nhb = -(-hidden // p.dh_block_n)
            ret_row = backward_returned_row(dim, torch.bfloat16)
            tma = p.da_tma and hidden % p.da_block_k == 0  # as runtime.backward launches it (bf16)
            opts = dict(num_warps=p.da_num_warps, num_stages=p.da_num_stages, max_registers=p.da_max_registers)
            kernel = sm90_compile.build(da_combine_kernel, da, dict(
                NUM_LOCAL=1, WORLD=2, NHB=nhb, NHBP=triton.next_power_of_2(nhb), BN=p.da_block_n, BK=p.da_block_k,
                BT=p.reduce_block_tokens, BD=da_reduce_dim(p, score_before), RET_ROW=ret_row, RET_ROW_F32=ret_row // 2,
                PARTS_AT_F32=dim // 2,
                TMA=tma, **shape), **opts)
            check(kernel, f"da_combine (dA + reduce{', TMA' if tma else ''}) {what}", 1, even, tma=tma)
            fit = programs_per_sm(kernel, p.da_num_warps)
            assert fit >= p.da_programs_per_sm, f"da_combine {what}: {fit} programs fit an SM, launched with " \
                f"{p.da_programs_per_sm}"
            # The SwiGLU backward pass after the dH tiles (no GEMM: no spills).
            kernel = sm90_compile.build(swiglu_backward_kernel, sw, dict(
                HIDDEN=hidden, NUM_EXPERTS_LOCAL=64, NUM_EXPERTS=128, SCORE_BEFORE=score_before, BS=32,
                BN=p.dh_block_n), num_warps=4, num_stages=1)
            regs, spills = ptxas_usage(kernel.asm["ptx"])
            print(f"SwiGLU backward pass {what}: {regs} registers, {spills} B spilled")
            assert spills == 0, f"SwiGLU backward pass {what}: ptxas spills {spills} bytes"
            if score_before:
                continue
            # The gather of the weight gradients' slot rows (when the dH tasks do not copy them).
            for world in (1, 2):
                kernel = sm90_compile.build(gather_slot_rows_kernel, gs, dict(
                    WORLD=world, DIM=dim, TOP_K=8, NUM_EXPERTS_LOCAL=64, NUM_EXPERTS=128, SCORE_BEFORE=False, BS=16,
                    BD=min(512, triton.next_power_of_2(dim))), num_warps=4, num_stages=1)
                regs, spills = ptxas_usage(kernel.asm["ptx"])
                print(f"slot-row gather EP {world} {what}: {regs} registers, {spills} B spilled")
                assert spills == 0, f"slot-row gather EP {world} {what}: ptxas spills {spills} bytes"
            # The Triton weight-gradient kernel (the GPU's fallback where torch._grouped_mm
            # does not run), with tensor descriptors as runtime.backward launches it for bf16.
            for kind, (m, n), two in (("w13", (hidden, dim), True), ("w2", (dim, hidden), False)):
                bm, bn, bk, warps, stages = (getattr(p, f"wgrad_{kind}_{field}") for field in (
                    "block_m", "block_n", "block_k", "num_warps", "num_stages"))
                kernel = sm90_compile.build(wgrad_kernel, wg, dict(
                    M=m, N=n, NUM_EXPERTS_LOCAL=64, NUM_EXPERTS=128, BM=bm, BN=bn, BK=bk, GROUP=8, TWO_A=two,
                    TMA=True, STAGES=stages, PRECISION="tf32", INTERPRET=False), num_warps=warps, num_stages=stages)
                check(kernel, f"wgrad (dW{kind[1:]}) D={dim} H={hidden}", 1, even, tma=True)
    print("COMPILED OK")


def test_backward_megakernels_compile_for_hopper():
    pytest.importorskip("triton.backends.nvidia")
    proc = run_compile_script(__file__)
    assert proc.returncode == 0 and "COMPILED OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-4000:]


if __name__ == "__main__":
    compile_all()
