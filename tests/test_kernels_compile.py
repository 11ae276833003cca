"""The megakernels compile for Hopper (sm_90) on a machine without a GPU.

Triton's wheel ships ptxas, so the whole pipeline (TTIR -> TTGIR -> PTX ->
cubin) runs here. Catches compile errors in code the interpreter accepts, and
checks that the GEMM K-loops are software-pipelined (async copies into shared
memory) and use wgmma. Runs in a subprocess: TRITON_INTERPRET must be unset
when a kernel is defined for it to be compilable.
"""

import re

import pytest

from sm90_compile import run_compile_script


def compile_all() -> None:
    import torch

    import sm90_compile
    from sm90_compile import arena_types, route_types

    from titan_uniep.kernels.dispatch_fc1 import dispatch_fc1_kernel, fc1_launch_stages
    from titan_uniep.kernels.fc2_combine import fc2_combine_kernel
    from titan_uniep.kernels.scoreboard import sync_scope
    from titan_uniep.kernels.route import (count_parts, exchange_counts_kernel, route_histogram_kernel,
                                           route_layout_kernel)
    from titan_uniep.params import default_params

    def build(fn, pointers, consts, num_warps=8, num_stages=3):
        return sm90_compile.build(fn, pointers, consts, num_warps=num_warps, num_stages=num_stages).asm["ttgir"]

    bf, i32, i64, f32 = torch.bfloat16, torch.int32, torch.int64, torch.float32
    packed = dict(arena=arena_types(bf), route=route_types())
    a_ptrs = dict(**packed, x_ptr=bf, scores_ptr=f32, w1_ptr=bf, w3_ptr=bf, h_ptr=bf, h13_ptr=bf, control_ptr=i64)
    b_ptrs = dict(**packed, h_ptr=bf, w2_ptr=bf, scores_ptr=f32, out_ptr=bf, control_ptr=i64)
    for score_before in (False, True):
        for dim, hidden, even in ((2048, 768, True), (96, 80, False)):
            shape = dict(DIM=dim, HIDDEN=hidden, TOP_K=8, SCORE_BEFORE=score_before, PRECISION="tf32",
                         USE_TIMER=True, GROUP_M=8, BK=64, BT=16, BM=128)
            # (WORLD 1: the tiles gather x in place, scoreboard.token_rows_of)
            for save_h13, world in ((False, 2), (True, 2), (True, 1)):
                ttgir = build(dispatch_fc1_kernel, a_ptrs, dict(NUM_LOCAL=1, WORLD=world, BN=128, BD=512, KP=8,
                                                                SAVE_H13=save_h13, **shape))
                assert "warp_group_dot" in ttgir, "fc1 does not use wgmma"
                if even:
                    assert "async_copy_global_to_local" in ttgir, "fc1 K-loop is not pipelined"
            for defer in (False, True):
                ttgir = build(fc2_combine_kernel, b_ptrs, dict(NUM_LOCAL=2, BN=256, BD=256, DEFER_RELEASE=defer,
                                                               WORLD=2, **shape))
                assert "warp_group_dot" in ttgir, "fc2 does not use wgmma"
                if even:
                    assert "async_copy_global_to_local" in ttgir, "fc2 K-loop is not pipelined"
    # Scores before the experts: fc1 scales its rows in registers, and Triton then feeds
    # them to wgmma from registers; pipelined, that form left wgmma groups in flight across
    # K steps and gave other results on every call on an H200 (kernels.dispatch_fc1.
    # fc1_launch_stages). As launched there, no wgmma group may be pending past a dot; with
    # scores after (the same stages requested) the loop is pipelined, so the check sees them.
    fc1_shape = dict(NUM_LOCAL=2, WORLD=2, DIM=576, HIDDEN=744, TOP_K=4, KP=4, BM=128, BN=128, BK=64, BD=512,
                     PRECISION="tf32", USE_TIMER=True, SAVE_H13=True, SCOPE="gpu")
    for group_m, block_tokens in ((8, 16), (1, 16), (8, 32)):
        for score_before in (True, False):
            ttgir = build(dispatch_fc1_kernel, a_ptrs, dict(SCORE_BEFORE=score_before, GROUP_M=group_m,
                                                            BT=block_tokens, **fc1_shape),
                          num_stages=fc1_launch_stages(3, score_before))
            pending = {int(n) for n in re.findall(r"warp_group_dot_wait .*pendings = (\d+)", ttgir)}
            if score_before:
                assert pending == {0}, f"fc1, scores before (GROUP_M {group_m}, BT {block_tokens}): wgmma groups " \
                    f"left pending {sorted(pending)}"
            else:
                assert max(pending) > 0, "fc1, scores after: the K-loop's wgmma is not pipelined"
    # The short-K shapes' fc2_combine (params.DEFAULTS row (2, "short"): 128-column
    # tiles, 4 warps, two programs per SM) must fit as many programs per SM as it
    # is launched with; every field as runtime.forward launches it.
    params = default_params(2, hidden=768)
    assert params.fc2_programs_per_sm > 1, "the short-K defaults run fc2_combine at two programs per SM"
    shape = dict(DIM=2048, HIDDEN=768, TOP_K=8, SCORE_BEFORE=False, PRECISION="tf32", USE_TIMER=True,
                 GROUP_M=params.group_m, BK=params.fc2_block_k, BT=params.reduce_block_tokens, BM=params.block_m)
    kernel = sm90_compile.build(fc2_combine_kernel, b_ptrs, dict(
        NUM_LOCAL=1, BN=params.fc2_block_n, BD=params.reduce_block_dim, DEFER_RELEASE=params.fc2_defer_release,
        WORLD=2, TMA=params.fc2_tma, **shape),
        num_warps=params.fc2_num_warps, num_stages=params.fc2_num_stages, max_registers=params.fc2_max_registers)
    fit = sm90_compile.programs_per_sm(kernel, params.fc2_num_warps)
    assert fit >= params.fc2_programs_per_sm, f"fc2_combine (H=768): {fit} programs fit an SM, launched with " \
        f"{params.fc2_programs_per_sm}"
    # The scope of the releases and acquires (scoreboard.sync_scope): GPU scope
    # when the whole world is this launch, system scope with peers on other
    # GPUs. On sm_90 the release after a tile's row stores is a memory barrier
    # of that scope; with one rank only the failure path keeps system-scope ones.
    barriers = {}
    for local, world in ((1, 1), (1, 2)):
        kernel = sm90_compile.build(fc2_combine_kernel, b_ptrs, dict(
            NUM_LOCAL=local, BN=params.fc2_block_n, BD=params.reduce_block_dim, DEFER_RELEASE=False, WORLD=world,
            SCOPE=sync_scope(local, world), **shape),
            num_warps=params.fc2_num_warps, num_stages=params.fc2_num_stages)
        sass = kernel.asm["sass"]
        barriers[world] = (sass.count("MEMBAR.ALL.SYS"), sass.count("MEMBAR.ALL.GPU"))
    assert barriers[1][0] < barriers[2][0] and barriers[1][1] > barriers[2][1], \
        f"fc2_combine's (system, GPU)-scope barriers at one rank / two ranks: {barriers[1]} / {barriers[2]}"
    # LayerParams.fc2_tma: fc2's operands through tensor descriptors, pipelined into wgmma.
    ttgir = build(fc2_combine_kernel, b_ptrs, dict(
        NUM_LOCAL=2, BN=params.fc2_block_n, BD=params.reduce_block_dim, DEFER_RELEASE=False, WORLD=2, TMA=True,
        **shape), num_warps=params.fc2_num_warps)
    assert any("warp_group_dot " in b and "async_tma_copy_global_to_local" in b for b in sm90_compile.loops(ttgir)), \
        "fc2 with tensor descriptors: the K-loop is not a pipelined TMA + wgmma loop"
    # LayerParams.fc2_flat_loop: one loop over the program's tiles and their K steps,
    # software-pipelined (the epilogue's stores and releases inside it), and in the
    # PTX every release atomic comes after a barrier with no row store between them.
    for bn, warps, tma in ((128, 4, False), (128, 4, True), (256, 8, False)):
        kernel = sm90_compile.build(fc2_combine_kernel, b_ptrs, dict(
            NUM_LOCAL=1, BN=bn, BD=params.reduce_block_dim, WORLD=1, SCOPE="gpu", TMA=tma, FLAT=True, **shape),
            num_warps=warps, num_stages=3)
        body = [b for b in sm90_compile.loops(kernel.asm["ttgir"]) if "warp_group_dot " in b]
        assert len(body) == 1 and "atomic_rmw" in body[0] and "tt.store" in body[0], \
            f"fc2 flat loop ({bn}, TMA {tma}): the tiles' epilogue is not inside the one K-loop"
        assert "async_copy_global_to_local" in body[0] or "async_tma_copy_global_to_local" in body[0], \
            f"fc2 flat loop ({bn}, TMA {tma}): the loop is not software-pipelined"
        assert sm90_compile.releases_follow_a_barrier(kernel.asm["ptx"]), \
            f"fc2 flat loop ({bn}, TMA {tma}): a release atomic is not separated from the row stores by a barrier"
    layout = dict(num_tokens_ptr=i32, block_counts_ptr=i32, route_tables_ptr=i32)
    for experts, local_pow2, route_block in ((128, 64, 128), (256, 128, 64), (8, 4, 128)):
        build(exchange_counts_kernel, dict(**packed, block_counts_ptr=i32, counts_all_ptr=i64, control_ptr=i64),
              dict(WORLD=2, NUM_EXPERTS=experts, TILE_CAPACITY=1088, TOKEN_CAPACITY=8192, PUBLISH=True, COLLECT=True,
                   BLOCK=1024, USE_TIMER=True, TOP_K=8, EP=experts, ELP=local_pow2, BM=128, ROUTE_BLOCK=route_block,
                   PARTS=count_parts(experts), SB=max(1, 8192 * count_parts(experts) // experts), CB=256,
                   TILE_ORDER=experts != 8), num_warps=4)
        build(route_histogram_kernel, dict(indices_ptr=i64, num_tokens_ptr=i32, block_counts_ptr=i32),
              dict(NUM_EXPERTS=experts, EP=experts, TOP_K=8, BLOCK=route_block, TOKENS_FROM_HOST=True), num_warps=4)
        build(route_layout_kernel, dict(indices_ptr=i64, **layout, dest_rank_ptr=i32, dest_slot_ptr=i32,
                                        dest_tile_ptr=i32, tile_expert_ptr=i32, tile_start_ptr=i32, tile_end_ptr=i32),
              dict(NUM_EXPERTS=experts, WORLD=2, TOP_K=8, BM=128, BLOCK=route_block, ELP=local_pow2,
                   TILE_CAPACITY=1088, CB=256, WRITE_TILES=experts != 8), num_warps=4)
    print("COMPILED OK")


def test_sync_scope_is_gpu_scope_only_when_no_peer_is_on_another_gpu():
    from titan_uniep.kernels.scoreboard import sync_scope

    assert sync_scope(1, 1) == "gpu"  # one rank
    assert sync_scope(4, 4) == "gpu"  # a simulated world: every rank in this launch
    assert sync_scope(1, 2) == "sys"  # one rank per GPU, a peer over NVLink
    assert sync_scope(2, 4) == "sys"


def test_megakernels_compile_for_hopper():
    pytest.importorskip("triton.backends.nvidia")
    proc = run_compile_script(__file__)
    assert proc.returncode == 0 and "COMPILED OK" in proc.stdout, proc.stderr[-4000:]


if __name__ == "__main__":
    compile_all()
