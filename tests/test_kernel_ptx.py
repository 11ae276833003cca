"""The binaries a real rank launches at EP >= 2 order their memory as the
scoreboard says, read in their PTX and SASS (compiled for sm_90 here:
``sm90_compile``; Triton's wheel ships ptxas and nvdisasm).

A real rank (``Workspace.for_group``: NUM_LOCAL 1, WORLD 2, SCOPE "sys")
launches, with the constexprs ``runtime.forward`` / ``backward`` /
``launch`` give them at a qwen3-like layer's defaults
(``params.default_params(2, hidden=768)``: D 2048, H 768, E 128, K 8):
the four megakernels, the counts exchange in one launch (PUBLISH and
COLLECT), and, inlined into all of them, ``scoreboard.fail_world``. In each
binary's PTX (``sm90_compile.ptx_sync_findings``), every release atomic is at
system scope with a barrier after the last global store before it on every
path, and every acquire is at system scope; in its SASS, the system-scope
release fence (``MEMBAR.ALL.SYS``) is there and no GPU-scope one is.
Tiny kernels defined here plant the defects the check must flag (a release
at GPU scope, a release right after a store, an acquire at GPU scope), and
hand-written PTX checks the control flow the check follows.

Compiling runs in a subprocess: TRITON_INTERPRET must be unset when a kernel
is defined for it to be compilable.
"""

import json
import sys

import pytest
import triton
import triton.language as tl

from sm90_compile import ptx_sync_findings, release_sites, releases_follow_a_barrier, run_compile_script, sass_fences
from titan_uniep.kernels import scoreboard


def real_rank_binaries() -> dict:
    """Name -> compiled kernel of each binary a real rank of EP 2 launches that
    releases or acquires (scores after the experts, h1 | h3 saved for the
    backward), plus the fc2 variants the tuner may pick that move its
    releases (``fc2_defer_release``, ``fc2_flat_loop``)."""
    import torch

    import sm90_compile
    from sm90_compile import arena_types, route_types
    from titan_uniep.kernels.da_combine import da_combine_kernel
    from titan_uniep.kernels.dispatch_dh import dispatch_dh_kernel
    from titan_uniep.kernels.dispatch_fc1 import dispatch_fc1_kernel, fc1_launch_stages
    from titan_uniep.kernels.fc2_combine import fc2_combine_kernel
    from titan_uniep.kernels.route import count_parts, exchange_counts_kernel, route_block
    from titan_uniep.kernels.scoreboard import sync_scope
    from titan_uniep.params import default_params
    from titan_uniep.runtime.backward import da_reduce_dim, dh_max_registers
    from titan_uniep.runtime.launch import TILE_CB
    from titan_uniep.runtime.workspace import WorkspaceShape, backward_returned_row

    world, dim, hidden, experts, top_k, tokens = 2, 2048, 768, 128, 8, 8192
    bf, i32, i64, f32 = torch.bfloat16, torch.int32, torch.int64, torch.float32
    p = default_params(world, hidden=hidden)
    fwd = WorkspaceShape(world, tokens, dim, hidden, experts, top_k, bf, p.block_m)
    bwd = WorkspaceShape(world, tokens, 2 * dim, hidden, experts, top_k, bf, p.block_m,
                         returned_row=backward_returned_row(dim, bf))
    packed = dict(arena=arena_types(bf), route=route_types())
    # runtime.forward.launch_forward / runtime.backward.launch_backward's shape_meta
    meta = dict(NUM_LOCAL=1, WORLD=world, DIM=dim, HIDDEN=hidden, TOP_K=top_k, SCORE_BEFORE=False,
                GROUP_M=p.group_m, PRECISION="tf32", USE_TIMER=True, RACE=False, SLACK=0,
                SCOPE=sync_scope(1, world))
    assert meta["SCOPE"] == "sys"
    kp = triton.next_power_of_2(top_k)
    built = {}
    built["dispatch_fc1"] = sm90_compile.build(
        dispatch_fc1_kernel,
        dict(**packed, x_ptr=bf, scores_ptr=f32, w1_ptr=bf, w3_ptr=bf, h_ptr=bf, h13_ptr=bf, control_ptr=i64),
        dict(BM=p.block_m, BN=p.fc1_block_n, BK=p.fc1_block_k, BT=p.dispatch_block_tokens, BD=p.dispatch_block_dim,
             KP=kp, SAVE_H13=True, ONE_DOT=p.fc1_one_dot, **meta),
        num_warps=p.fc1_num_warps, num_stages=fc1_launch_stages(p.fc1_num_stages, False))
    b_ptrs = dict(**packed, h_ptr=bf, w2_ptr=bf, scores_ptr=f32, out_ptr=bf, control_ptr=i64)
    b_meta = dict(BM=p.block_m, BN=p.fc2_block_n, BK=p.fc2_block_k, BT=p.reduce_block_tokens, BD=p.reduce_block_dim,
                  INTERPRET=False, **meta)
    for name, variant in (("fc2_combine", {}), ("fc2_combine (defer_release)", dict(DEFER_RELEASE=True)),
                          ("fc2_combine (flat_loop)", dict(FLAT=True))):
        consts = dict(DEFER_RELEASE=p.fc2_defer_release, TMA=p.fc2_tma, FLAT=p.fc2_flat_loop)
        if name != "fc2_combine" and consts == {**consts, **variant}:
            continue  # the default already
        built[name] = sm90_compile.build(fc2_combine_kernel, b_ptrs, {**b_meta, **consts, **variant},
                                         num_warps=p.fc2_num_warps, num_stages=p.fc2_num_stages,
                                         max_registers=p.fc2_max_registers)
    built["dispatch_dh"] = sm90_compile.build(
        dispatch_dh_kernel,
        dict(**packed, x_ptr=bf, g_ptr=bf, scores_ptr=f32, w2_ptr=bf, g32_ptr=f32, slot_rows_ptr=bf,
             control_ptr=i64),
        dict(KP=kp, BM=p.block_m, BN=p.dh_block_n, BK=p.dh_block_k, BD=p.dispatch_block_dim,
             COPY_ROWS=p.dh_copies_rows, BDC=min(64, triton.next_power_of_2(dim)),
             **{**meta, "BT": p.dispatch_block_tokens}),
        num_warps=p.dh_num_warps, num_stages=p.dh_num_stages, max_registers=dh_max_registers(p))
    nhb = triton.cdiv(hidden, p.dh_block_n)
    elem = bwd.elem_size
    built["da_combine"] = sm90_compile.build(
        da_combine_kernel,
        dict(**packed, dh1_ptr=bf, dh3_ptr=bf, w1_ptr=bf, w3_ptr=bf, ds_parts_ptr=f32, scores_ptr=f32, x_ptr=bf,
             dx_ptr=bf, ds_ptr=f32, control_ptr=i64),
        dict(KP=kp, BT=p.reduce_block_tokens, BM=p.block_m, BN=p.da_block_n, BK=p.da_block_k, NHB=nhb,
             NHBP=triton.next_power_of_2(nhb), BD=da_reduce_dim(p, False), RET_ROW=bwd.returned_row_elems,
             RET_ROW_F32=bwd.returned_row_elems * elem // 4, PARTS_AT_F32=dim * elem // 4,
             TMA=p.da_tma and hidden % p.da_block_k == 0, INTERPRET=False, **meta),
        num_warps=p.da_num_warps, num_stages=p.da_num_stages, max_registers=p.da_max_registers)
    # runtime.launch.exchange_counts, one rank: PUBLISH and COLLECT in one launch
    parts, ep = count_parts(experts), triton.next_power_of_2(experts)
    built["exchange_counts"] = sm90_compile.build(
        exchange_counts_kernel, dict(**packed, block_counts_ptr=i32, counts_all_ptr=i64, control_ptr=i64),
        dict(WORLD=world, NUM_EXPERTS=experts, TILE_CAPACITY=fwd.tile_capacity, TOKEN_CAPACITY=fwd.token_capacity,
             PUBLISH=True, COLLECT=True, BLOCK=1024, USE_TIMER=True, TOP_K=top_k, EP=ep,
             ELP=triton.next_power_of_2(fwd.num_local_experts), BM=fwd.block_m, ROUTE_BLOCK=route_block(experts),
             PARTS=parts, SB=max(1, 8192 * parts // ep), CB=TILE_CB, TILE_ORDER=p.local_first,
             EPOCH_STORE_DELAY_US=p.debug_epoch_store_delay_us),
        num_warps=4, num_stages=3)
    return built


def fail_world_lines() -> range:
    """Source lines of ``scoreboard.fail_world`` (its releases, found in the PTX by ``.loc``)."""
    import inspect

    from titan_uniep.kernels.scoreboard import fail_world

    lines, first = inspect.getsourcelines(fail_world.fn)
    return range(first, first + len(lines))


def check_binary(name: str, kernel) -> list[str]:
    """What is wrong with one real rank binary's ordering (empty: nothing);
    ``fail_world`` must be in it (its releases, by their source lines)."""
    ptx = kernel.asm["ptx"]
    problems = [f"{name}: {f}" for f in ptx_sync_findings(ptx, "sys")]
    releases = release_sites(ptx)
    if not releases:
        problems.append(f"{name}: no release atomic in its PTX")
    failing = {f"scoreboard.py:{n}" for n in fail_world_lines()}
    if not releases & failing:
        problems.append(f"{name}: none of fail_world's releases in its PTX (releases at {sorted(releases)})")
    fences = sass_fences(kernel.asm["sass"])
    if not fences.get("MEMBAR.ALL.SYS"):
        problems.append(f"{name}: no MEMBAR.ALL.SYS in its SASS (fences: {fences})")
    if fences.get("MEMBAR.ALL.GPU"):
        problems.append(f"{name}: a GPU-scope fence in a system-scope binary (fences: {fences})")
    print(f"{name}: releases at {sorted(releases)}; SASS fences {fences}")
    return problems


# Tiny kernels: three with a planted defect, one right, and fail_world alone
# (a wrapper, as a real rank's WORLD 2 inlines it).


@triton.jit
def release_at_gpu_scope(data, flag, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(data + offs, offs)
    tl.debug_barrier()
    tl.atomic_add(flag, 1, sem="release", scope="gpu")


@triton.jit
def release_right_after_store(data, flag, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(data + offs, offs)
    tl.atomic_add(flag, 1, sem="release", scope="sys")


@triton.jit
def acquire_at_gpu_scope(data, flag, BLOCK: tl.constexpr):
    seen = tl.atomic_add(flag, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()
    tl.store(data + tl.arange(0, BLOCK), seen)


@triton.jit
def release_after_barrier(data, flag, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(data + offs, offs)
    tl.debug_barrier()
    tl.atomic_add(flag, 1, sem="release", scope="sys")


@triton.jit
def fail_world_alone(control, arena, anchor_rank, rank, timeout, WORLD: tl.constexpr):
    scoreboard.fail_world(control, arena, anchor_rank, rank, 7, 2, 3, 4, 5, timeout, WORLD, True)


def planted_binaries() -> dict:
    """The tiny kernels above, compiled."""
    import torch

    import sm90_compile
    from sm90_compile import arena_types

    i32 = torch.int32
    built = {fn.__name__: sm90_compile.build(fn, dict(data=i32, flag=i32), dict(BLOCK=256), num_warps=4,
                                             num_stages=1)
             for fn in (release_at_gpu_scope, release_right_after_store, acquire_at_gpu_scope, release_after_barrier)}
    built["fail_world"] = sm90_compile.build(
        fail_world_alone, dict(control=torch.int64, arena=arena_types(torch.bfloat16)), dict(WORLD=2), num_warps=4,
        num_stages=1)
    return built


def main(part: str) -> None:
    if part == "real":
        problems = [problem for name, kernel in real_rank_binaries().items() for problem in check_binary(name, kernel)]
        print("\n".join(problems) or "CHECKED OK")
        sys.exit(1 if problems else 0)
    report = {name: dict(findings=ptx_sync_findings(kernel.asm["ptx"], "sys"), releases=sorted(release_sites(
        kernel.asm["ptx"])), fences=sass_fences(kernel.asm["sass"])) for name, kernel in planted_binaries().items()}
    print("PLANTED", json.dumps(report))


def test_real_rank_binaries_release_and_acquire_at_system_scope_after_a_barrier():
    pytest.importorskip("triton.backends.nvidia")
    proc = run_compile_script(__file__, "real")
    assert proc.returncode == 0 and "CHECKED OK" in proc.stdout, proc.stdout[-6000:] + proc.stderr[-4000:]


@pytest.fixture(scope="module")
def planted():
    """Each tiny kernel's PTX findings and SASS fences (``main("planted")``)."""
    pytest.importorskip("triton.backends.nvidia")
    proc = run_compile_script(__file__, "planted")
    lines = [line for line in proc.stdout.splitlines() if line.startswith("PLANTED ")]
    assert proc.returncode == 0 and lines, proc.stdout[-4000:] + proc.stderr[-4000:]
    return json.loads(lines[-1].removeprefix("PLANTED "))


def test_the_ptx_check_flags_a_release_at_gpu_scope(planted):
    findings = planted["release_at_gpu_scope"]["findings"]
    assert len(findings) == 1 and "at gpu scope, not sys" in findings[0], findings
    fences = planted["release_at_gpu_scope"]["fences"]
    assert "MEMBAR.ALL.SYS" not in fences and fences.get("MEMBAR.ALL.GPU"), fences


def test_the_ptx_check_flags_a_release_right_after_a_store(planted):
    findings = planted["release_right_after_store"]["findings"]
    assert len(findings) == 1 and "with no barrier between" in findings[0], findings


def test_the_ptx_check_flags_an_acquire_at_gpu_scope(planted):
    findings = planted["acquire_at_gpu_scope"]["findings"]
    assert len(findings) == 1 and "at gpu scope, not sys" in findings[0], findings


def test_the_ptx_check_passes_a_release_after_a_barrier(planted):
    assert planted["release_after_barrier"]["findings"] == [], planted["release_after_barrier"]
    assert planted["release_after_barrier"]["fences"].get("MEMBAR.ALL.SYS"), planted["release_after_barrier"]


def test_fail_world_alone_releases_at_system_scope_after_a_barrier(planted):
    # its one release: the abort words (the claim of the first failure is relaxed: it carries no data)
    assert len(planted["fail_world"]["releases"]) == 1, planted["fail_world"]
    assert planted["fail_world"]["findings"] == [], planted["fail_world"]
    assert planted["fail_world"]["fences"].get("MEMBAR.ALL.SYS") and \
        not planted["fail_world"]["fences"].get("MEMBAR.ALL.GPU"), planted["fail_world"]


# ---- the control flow the PTX check follows (hand-written listings) ----

LOOP_RELEASE_AT_THE_TOP = """
$L__BB0_1:
    @%p1 atom.global.sys.release.add.u32 %r1, [%rd1+0], %r2;
    st.global.b32 [%rd2+0], %r3;
    @%p2 bra $L__BB0_1;
    ret;
"""

BRANCH_AROUND_THE_STORE = """
    @%p1 bra $L__BB0_2;
    st.global.b32 [%rd2+0], %r3;
    bar.sync 0;
$L__BB0_2:
    { .reg .pred %a; setp.ne.s32 %a, %r1, 0; bar.red.or.pred %a, 0, %a; }
    atom.global.release.sys.add.u32 %r1, [%rd1+0], %r2;
    ret;
"""

STORE_ON_ONE_PATH = """
    @%p1 bra $L__BB0_2;
    bar.sync 0;
    bra.uni $L__BB0_3;
$L__BB0_2:
    @%p3 st.global.v4.b32 [%rd2+0], {%r3, %r4, %r5, %r6};
$L__BB0_3:
    red.release.sys.global.add.u32 [%rd1+0], %r2;
    ret;
"""


def test_the_ptx_check_follows_a_loop_back_to_its_top():
    # A linear walk back from the release sees no store before it; the previous iteration's does.
    findings = ptx_sync_findings(LOOP_RELEASE_AT_THE_TOP)
    assert len(findings) == 1 and "st.global.b32" in findings[0], findings


def test_the_ptx_check_takes_bar_red_as_a_barrier_on_every_path():
    assert ptx_sync_findings(BRANCH_AROUND_THE_STORE) == []
    assert releases_follow_a_barrier(BRANCH_AROUND_THE_STORE)


def test_the_ptx_check_flags_a_store_on_one_path_only():
    findings = ptx_sync_findings(STORE_ON_ONE_PATH)
    assert len(findings) == 1 and "st.global.v4.b32" in findings[0], findings
    assert not releases_follow_a_barrier(STORE_ON_ONE_PATH)


if __name__ == "__main__":
    main(sys.argv[1])
