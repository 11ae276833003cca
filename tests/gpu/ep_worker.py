"""Real-EP checks of UniEP's forward (one process per GPU, symmetric memory).

Launched by ``test_gpu_ep.py`` as
``torchrun --standalone --nproc_per_node N tests/gpu/ep_worker.py``. Each check
raises on failure; rank 0 prints ``EP WORKER OK`` at the end.

1. fused == sequential bitwise, and both close to the float64 reference, for
   score before/after, skewed routing and a rank with no tokens, on one
   workspace reused by every call;
2. no device-to-host sync on the fused path (sync debug mode "error");
3. CUDA graph: capture once, replay with new inputs and routing, bitwise equal
   to eager;
4. a rank that never sends, with the fused path's lazy error check: no call
   syncs, every rank stops once the first wait runs out (abort word), the
   end-of-step check raises on every rank with the same root cause (rank,
   task, counter) within seconds (TorchTitan's NCCL watchdog is 120 s in the
   shipped configs), later calls on the failed workspace do not wait, and
   NCCL still works afterwards.
"""

import os
import re
import sys
import time

import torch
import torch.distributed as dist

from titan_uniep.oracle import float64_moe_oracle
from titan_uniep.params import default_params
from titan_uniep.runtime import Workspace, moe_forward

DIM, HIDDEN, EXPERTS, TOP_K, TOKENS = 1024, 512, 16, 4, 1000
# Schedule variants checked in part 1 (UNIEP_EP_VARIANTS="direct" keeps a short device run short).
# (fc2_defer_release, fc2_flat_loop, local_first)
_ALL_VARIANTS = {"direct": (False, False, False), "deferred": (True, False, False), "flat_loop": (False, True, False),
                 "local_first": (False, False, True)}
VARIANT_NAMES = os.environ.get("UNIEP_EP_VARIANTS", ",".join(_ALL_VARIANTS)).split(",")
VARIANTS = [_ALL_VARIANTS[c] for c in VARIANT_NAMES]


def log(msg):
    if dist.get_rank() == 0:
        print(msg, flush=True)


def global_weights(dev):
    gen = torch.Generator(device=dev).manual_seed(1234)  # same on every rank
    w1 = (torch.randn(EXPERTS, HIDDEN, DIM, generator=gen, device=dev) * DIM**-0.5).bfloat16()
    w3 = (torch.randn(EXPERTS, HIDDEN, DIM, generator=gen, device=dev) * DIM**-0.5).bfloat16()
    w2 = (torch.randn(EXPERTS, DIM, HIDDEN, generator=gen, device=dev) * HIDDEN**-0.5).bfloat16()
    return w1, w2, w3


def routed_inputs(seed, num_tokens, dev, *, force=None):
    gen = torch.Generator(device=dev).manual_seed(seed * 100 + dist.get_rank())
    x = torch.randn(num_tokens, DIM, generator=gen, device=dev).bfloat16()
    scores = torch.rand(num_tokens, TOP_K, generator=gen, device=dev)
    idx = torch.rand(num_tokens, EXPERTS, generator=gen, device=dev).argsort(1)[:, :TOP_K]
    if force is not None:
        lacks = (idx != force).all(1)
        idx[lacks, -1] = force
    return x, scores, idx.contiguous()


def local(w, rank, world):
    el = EXPERTS // world
    return w[rank * el:(rank + 1) * el].contiguous()


def check_close(out, x, scores, idx, weights, score_before, what):
    if x.shape[0] == 0:
        return
    exact = float64_moe_oracle(x, scores, idx, *weights, score_before_experts=score_before)
    scale = exact.abs().max().item()
    err = (out.double() - exact).abs().max().item()
    if err > 3e-2 * scale:
        raise AssertionError(f"rank {dist.get_rank()} {what}: max error {err:.3g} vs scale {scale:.3g}")


def main():
    local_rank = int(os.environ["LOCAL_RANK"])
    dev = torch.device("cuda", local_rank)
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", device_id=dev)
    group = dist.group.WORLD
    rank, world = dist.get_rank(), dist.get_world_size()
    w1, w2, w3 = global_weights(dev)
    mine = [local(w, rank, world) for w in (w1, w2, w3)]
    shipped = default_params(world, hidden=HIDDEN)  # the defaults of this EP size and shape (params.DEFAULTS)
    ws = Workspace.for_group(group, num_tokens=TOKENS, dim=DIM, hidden=HIDDEN, num_experts=EXPERTS, top_k=TOP_K,
                             dtype=torch.bfloat16, device=dev, params=shipped)
    log(f"workspace bytes per rank: {ws.memory_bytes()}")

    # 1. correctness, bitwise schedules, several routings, one workspace
    cases = [("balanced", TOKENS, None), ("skewed", TOKENS, 3), ("rank1_no_tokens", 0 if rank == 1 else 777, None)]
    for seed, (name, num_tokens, force) in enumerate(cases):
        x, scores, idx = routed_inputs(seed, num_tokens, dev, force=force)
        for score_before in (False, True):
            outs = {}
            for defer, flat, local_first in VARIANTS:
                for schedule in ("sequential", "fused"):
                    ws.poison()
                    outs[schedule, defer, flat, local_first] = moe_forward(
                        x, scores, idx, *mine, workspace=ws, schedule=schedule, score_before_experts=score_before,
                        # local_first overlaps anything only with dispatch_programs below the grid
                        # (the short-K defaults let every program dispatch first): 16, as before.
                        params=shipped.replace(fc2_defer_release=defer, fc2_flat_loop=flat, local_first=local_first,
                                               **(dict(dispatch_programs=16) if local_first else {})),
                        error_check="sync",
                    )
            ref = next(iter(outs))
            for key, out in outs.items():
                if not torch.equal(outs[ref], out):
                    raise AssertionError(f"rank {rank} {name}: {key} differs from {ref}")
            check_close(outs[ref], x, scores, idx, (w1, w2, w3), score_before, name)
        log(f"PASS real EP {name}: fused == sequential bitwise across the variants {', '.join(VARIANT_NAMES)}, "
            "close to float64")

    def fused_forward(x, scores, idx):
        return moe_forward(x, scores, idx, *mine, workspace=ws, schedule="fused", score_before_experts=False,
                           params=shipped)

    # 2. no host sync on the fused path
    x, scores, idx = routed_inputs(7, TOKENS, dev)
    fused_forward(x, scores, idx)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            out = fused_forward(x, scores, idx)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    ws.check_errors()
    check_close(out, x, scores, idx, (w1, w2, w3), False, "no-sync run")
    log("PASS no device-to-host sync on the fused path")

    # 3. CUDA graph: capture once, replay with new inputs and routing
    sx, ss, si = routed_inputs(8, TOKENS, dev)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fused_forward(sx, ss, si)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    dist.barrier()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = fused_forward(sx, ss, si)
    for step in range(3):
        x, scores, idx = routed_inputs(20 + step, TOKENS, dev, force=5 if step == 1 else None)
        sx.copy_(x), ss.copy_(scores), si.copy_(idx)
        graph.replay()
        eager = fused_forward(x, scores, idx)
        torch.cuda.synchronize()
        ws.check_errors()
        if not torch.equal(static_out, eager):
            raise AssertionError(f"rank {rank}: graph replay {step} differs from eager")
        check_close(static_out, x, scores, idx, (w1, w2, w3), False, f"graph replay {step}")
    del graph
    log("PASS CUDA graph capture + replay with new routing == eager, bitwise")

    # 4. a silent rank, lazy error checks: every rank ends with the root cause, long before NCCL's watchdog
    dist.barrier()
    silent = shipped.replace(debug_silent_rank=world - 1, timeout_s=0.5)
    broken = Workspace.for_group(group, num_tokens=TOKENS, dim=DIM, hidden=HIDDEN, num_experts=EXPERTS, top_k=TOP_K,
                                 dtype=torch.bfloat16, device=dev, params=silent)
    x, scores, idx = routed_inputs(9, TOKENS, dev)
    torch.cuda.synchronize()
    dist.barrier()
    start = time.monotonic()
    polled = None
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(4):  # a step's MoE layers: the host runs ahead of the spinning kernels
            moe_forward(x, scores, idx, *mine, workspace=broken, schedule="fused", score_before_experts=False)
    except RuntimeError as err:  # a later call's poll saw an earlier call's copy land
        polled = err
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()  # TorchTitan's loss-log sync at the end of the step
    try:
        broken.check_errors()  # the per-step check (titan_uniep.op.raise_pending_errors, per workspace)
    except RuntimeError as err:
        message = str(err)
    else:
        raise AssertionError(f"rank {rank}: no error although rank {world - 1} never sent")
    elapsed = time.monotonic() - start
    print(f"rank {rank} got the expected error after {elapsed:.2f} s "
          f"({'also from a lazy poll' if polled else 'from the step check'}): {message}", flush=True)
    if polled is not None and str(polled) != message:
        raise AssertionError(f"rank {rank}: the lazy poll and the step check disagree:\n{polled}\n{message}")
    root = re.search(r"EP rank (\d+) failed first \(call epoch (\d+), task (-?\d+)\): .*?(\w+\[\d+\])", message)
    own = re.search(r"UniEP forward failed on EP rank (\d+) \(call epoch (\d+), task (-?\d+)\): .*?(\w+\[\d+\])"
                    r".*It failed first", message)
    cause = (root or own).groups() if (root or own) else None
    if cause is None or f"EP rank {rank}" not in message:
        raise AssertionError(f"rank {rank}: the error names no root cause (rank, task, counter) or not this rank: "
                             f"{message}")
    causes = [None] * world
    dist.all_gather_object(causes, cause)  # NCCL still works after the failure
    if len(set(causes)) != 1:
        raise AssertionError(f"rank {rank}: the ranks name different root causes: {causes}")
    if elapsed > 20:
        raise AssertionError(f"rank {rank}: {elapsed:.1f} s to the error (NCCL's watchdog would be near)")
    # A later call on the failed workspace: every wait gives up at once (no full timeout per missing peer).
    start = time.monotonic()
    try:
        moe_forward(x, scores, idx, *mine, workspace=broken, schedule="fused", score_before_experts=False,
                    error_check="sync")
    except RuntimeError:
        pass
    else:
        raise AssertionError(f"rank {rank}: a call on the failed workspace did not raise")
    later = time.monotonic() - start
    if later > silent.timeout_s:
        raise AssertionError(f"rank {rank}: a call on the failed workspace took {later:.2f} s (a wait spun)")
    torch.cuda.synchronize()
    dist.barrier()
    log(f"PASS silent rank, lazy checks -> every rank stops with the root cause {causes[0]} (rank, epoch, task, "
        f"counter) in {elapsed:.2f} s; later calls fail at once; NCCL healthy")
    log("EP WORKER OK")
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
