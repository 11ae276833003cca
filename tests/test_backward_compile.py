"""The backward megakernels compile for Hopper (sm_90) on a machine without a GPU.

Same approach as test_kernels_compile.py (``sm90_compile``: Triton's wheel
ships ptxas): the whole pipeline runs here for the backward's default tiles
(``fused_backward.backward_block_sizes`` of the default KernelConfig), and
the checks are those a GPU-less machine can make: every GEMM loop (dH, dA,
and the Triton weight-gradient kernel's dW1/dW3 and dW2) is software-pipelined
(async copies or tensor-descriptor loads into shared memory) and uses wgmma,
ptxas' register spills stay small, shared memory fits an H200 SM. Runs in a
subprocess: TRITON_INTERPRET must be unset when a kernel is defined for it
to be compilable.
"""

import pytest

from sm90_compile import run_compile_script

# ptxas spill bytes allowed at the default tiles, per megakernel: the
# two-pass dH tile (BA) spills ~0.5 KB at 128 columns and was measured faster
# than the spill-free 64-column tile (fused_backward.BACKWARD_TILES); BB and
# the weight-gradient kernel do not spill.
MAX_SPILL_BYTES = {"BA": 1024, "BB": 0, "WG": 0}
MAX_SHARED_BYTES = 227 * 1024


def compile_all() -> None:
    import torch
    import triton

    import sm90_compile
    from sm90_compile import loops, programs_per_sm, ptxas_usage
    from titan_uniep.fused_backward import ba_max_registers, backward_block_sizes, bb_reduce_dim
    from titan_uniep.kernels.backward import (dispatch_grad_hidden_kernel, grad_input_combine_kernel,
                                              swiglu_backward_kernel)
    from titan_uniep.kernels.tuning import KernelConfig
    from titan_uniep.kernels.wgrad import expert_weight_grad_kernel

    cfg = KernelConfig()
    blocks = backward_block_sizes(cfg)

    def build(fn, pointers, consts, num_warps=blocks["warps"], num_stages=blocks["stages"], max_registers=None):
        return sm90_compile.build(fn, pointers, consts, num_warps=num_warps, num_stages=num_stages,
                                  max_registers=max_registers)

    def check(kernel, what, gemm_loops, even, tma=False):
        ttgir = kernel.asm["ttgir"]
        assert "warp_group_dot" in ttgir, f"{what}: no wgmma"
        regs, spills = ptxas_usage(kernel.asm["ptx"])
        shared = kernel.metadata.shared
        print(f"{what}: {regs} registers, {spills} B spilled, {shared} B shared memory")
        assert spills <= MAX_SPILL_BYTES[what[:2]], f"{what}: ptxas spills {spills} bytes"
        assert shared <= MAX_SHARED_BYTES, f"{what}: {shared} B of shared memory"
        if even:
            load = "async_tma_copy_global_to_local" if tma else "async_copy_global_to_local"
            pipelined = [b for b in loops(ttgir) if "warp_group_dot " in b and load in b]
            assert len(pipelined) >= gemm_loops, f"{what}: {len(pipelined)} of {gemm_loops} GEMM loops pipelined"

    bf, i32, i64, f32 = torch.bfloat16, torch.int32, torch.int64, torch.float32
    anchors = dict(act_anchor=bf, i32_anchor=i32, f32_anchor=f32)
    ba = dict(**anchors, x_ptr=bf, g_ptr=bf, scores_ptr=f32, dest_rank_ptr=i32, dest_slot_ptr=i32, dest_tile_ptr=i32,
              num_tokens_ptr=i32, tile_expert_ptr=i32, tile_start_ptr=i32, tile_end_ptr=i32, num_tiles_ptr=i32,
              w1_ptr=bf, w2_ptr=bf, w3_ptr=bf, h_ptr=bf, dh1_ptr=bf, dh3_ptr=bf, ds_parts_ptr=f32, h13_ptr=bf,
              g32_ptr=f32, slot_rows_ptr=bf, tile_order_ptr=i32, control_ptr=i64, arena_ptrs=i64)
    bb = dict(**anchors, dh1_ptr=bf, dh3_ptr=bf, w1_ptr=bf, w3_ptr=bf, tile_expert_ptr=i32, tile_start_ptr=i32,
              tile_end_ptr=i32, num_tiles_ptr=i32, ds_parts_ptr=f32, scores_ptr=f32, num_tokens_ptr=i32, x_ptr=bf,
              dx_ptr=bf, ds_ptr=f32, control_ptr=i64, arena_ptrs=i64)
    wg = dict(a1_ptr=bf, a2_ptr=bf, b_ptr=bf, tables_ptr=i32, out1_ptr=bf, out2_ptr=bf)
    sw = dict(g32_ptr=f32, h13_ptr=bf, h_ptr=bf, dh1_ptr=bf, dh3_ptr=bf, ds_parts_ptr=f32, tables_ptr=i32,
              arena_ptrs=i64, f32_anchor=f32)
    for score_before in (False, True):
        shapes = ((2048, 768, True), (96, 80, False)) + (((7168, 2048, True), (4096, 14336, True))
                                                               if not score_before else ())
        for dim, hidden, even in shapes:
            shape = dict(DIM=dim, HIDDEN=hidden, TOP_K=8, SCORE_BEFORE=score_before, PRECISION="tf32",
                         USE_TIMER=True, GROUP_M=cfg.group_m, BM=cfg.block_m, BK=blocks["bk"], KP=8)
            what = f"D={dim} H={hidden} scores {'before' if score_before else 'after'}"
            # h1 | h3 from the forward (the op's path; its dH tasks may also copy the
            # weight gradients' slot rows, dh_copies_rows), or recomputed.
            for saved, copy in ((True, False), (True, True), (False, False)):
                kernel = build(dispatch_grad_hidden_kernel, ba, dict(
                    NUM_LOCAL=1, WORLD=2, BN=blocks["dh"], BT=16, BD=512, TWO_PASS=bool(blocks["dh_two_pass"]),
                    SAVED_H13=saved, COPY_ROWS=copy, BDC=64, **shape), max_registers=ba_max_registers(blocks, saved))
                loops_ba = 1 if saved else 1 + blocks["dh_two_pass"]
                name = f"BA (dispatch + dH{', saved h1|h3' if saved else ''}{', copies rows' if copy else ''}) {what}"
                check(kernel, name, loops_ba, even)
                if saved:
                    fit = programs_per_sm(kernel, blocks["warps"])
                    assert fit >= blocks["dh_programs_per_sm"], f"{name}: {fit} programs fit an SM, launched " \
                        f"with {blocks['dh_programs_per_sm']}"
            nhb = -(-hidden // blocks["dh"])
            da = backward_block_sizes(cfg, hidden)  # the dA keys as launched for this H
            tma = bool(da["da_tma"]) and hidden % da["da_bk"] == 0  # as fused_backward launches it (bf16)
            for defer in (False, True):
                kernel = build(grad_input_combine_kernel, bb, dict(
                    NUM_LOCAL=1, NHB=nhb, NHBP=triton.next_power_of_2(nhb), BN=da["da"], BT=cfg.reduce_block_tokens,
                    BD=bb_reduce_dim(cfg, score_before),
                    RET_ROW_F32=dim, PARTS_AT_F32=dim // 2, DEFER_RELEASE=defer, TMA=tma,
                    **{**shape, "BK": da["da_bk"]}), num_warps=da["da_warps"], num_stages=da["da_stages"])
                check(kernel, f"BB (dA + reduce{', deferred release' if defer else ''}{', TMA' if tma else ''}) "
                      f"{what}", 1, even, tma=tma)
                fit = programs_per_sm(kernel, da["da_warps"])
                assert fit >= da["da_programs_per_sm"], f"BB {what}: {fit} programs fit an SM, launched with " \
                    f"{da['da_programs_per_sm']}"
            # The SwiGLU backward pass after dH tiles with saved h1 | h3 (no GEMM: no spills).
            kernel = build(swiglu_backward_kernel, sw, dict(HIDDEN=hidden, NUM_EXPERTS_LOCAL=64, NUM_EXPERTS=128,
                                                            SCORE_BEFORE=score_before, BS=32, BN=blocks["dh"]),
                           num_warps=4, num_stages=1)
            regs, spills = ptxas_usage(kernel.asm["ptx"])
            print(f"SwiGLU backward pass {what}: {regs} registers, {spills} B spilled")
            assert spills == 0, f"SwiGLU backward pass {what}: ptxas spills {spills} bytes"
            if score_before:
                continue
            # The Triton weight-gradient kernel (the GPU's fallback where torch._grouped_mm
            # does not run), with tensor descriptors as fused_backward launches it for bf16.
            for kind, (m, n), two in (("wgrad_w13", (hidden, dim), True), ("wgrad_w2", (dim, hidden), False)):
                bm, bn, bk, warps, stages = blocks[kind]
                kernel = build(expert_weight_grad_kernel, wg, dict(
                    M=m, N=n, NUM_EXPERTS_LOCAL=64, NUM_EXPERTS=128, BM=bm, BN=bn, BK=bk, GROUP=8, TWO_A=two,
                    TMA=True, STAGES=stages, PRECISION="tf32", INTERPRET=False), num_warps=warps, num_stages=stages)
                check(kernel, f"WG ({kind}) D={dim} H={hidden}", 1, even, tma=True)
    print("COMPILED OK")


def test_backward_megakernels_compile_for_hopper():
    pytest.importorskip("triton.backends.nvidia")
    proc = run_compile_script(__file__)
    assert proc.returncode == 0 and "COMPILED OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-4000:]


if __name__ == "__main__":
    compile_all()
