"""Real 2-GPU check of the UniEP backward (run with torchrun, one process per GPU):
fused == sequential bitwise for every gradient and run to run, close to float64,
and the fused backward never synchronises with the host (a call under
``torch.cuda.set_sync_debug_mode("error")``, after one warm call).

    torchrun --standalone --nproc_per_node 2 tests/gpu/ep_backward_worker.py
"""

import os

import torch
import torch.distributed as dist

from titan_uniep.oracle import float64_moe_oracle
from titan_uniep.params import default_params
from titan_uniep.runtime import BackwardWorkspace, Workspace, moe_backward, moe_forward

NAMES = ("dx", "dscores", "dw1", "dw2", "dw3")


def main() -> None:
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dev = torch.device("cuda", local_rank)
    dist.init_process_group("nccl", device_id=dev)
    rank, world = dist.get_rank(), dist.get_world_size()
    failures = 0
    for case, (tokens, dim, hidden, experts, top_k, score_before) in enumerate([
        ([1000, 777], 512, 768, 16, 4, False),
        ([513, 0], 256, 384, 8, 3, True),
        ([2048, 2048], 1024, 512, 32, 8, False),
    ]):
        gen = torch.Generator(device=dev).manual_seed(100 + case)  # same inputs on every rank
        el = experts // world
        bf = lambda *s, scale=1.0: (torch.randn(*s, generator=gen, device=dev) * scale).to(torch.bfloat16)  # noqa
        w1, w3 = bf(experts, hidden, dim, scale=dim**-0.5), bf(experts, hidden, dim, scale=dim**-0.5)
        w2 = bf(experts, dim, hidden, scale=hidden**-0.5)
        xs = [bf(t, dim) for t in tokens]
        gs = [bf(t, dim) for t in tokens]
        ss = [torch.rand(t, top_k, generator=gen, device=dev) for t in tokens]
        ids = [torch.rand(t, experts, generator=gen, device=dev).argsort(1)[:, :top_k].contiguous() for t in tokens]
        mine = slice(rank * el, (rank + 1) * el)
        ws = BackwardWorkspace.for_group(dist.group.WORLD, num_tokens=max(tokens), dim=dim, hidden=hidden,
                                         num_experts=experts, top_k=top_k, dtype=torch.bfloat16, device=dev)
        # The custom op's path: the forward saves h1 | h3 per slot, the backward reads them.
        fwd_ws = Workspace.for_group(dist.group.WORLD, num_tokens=max(tokens), dim=dim, hidden=hidden,
                                     num_experts=experts, top_k=top_k, dtype=torch.bfloat16, device=dev)
        h13 = torch.full((fwd_ws.shape.slot_capacity, 2 * hidden), float("nan"), dtype=torch.bfloat16, device=dev)
        moe_forward(xs[rank], ss[rank], ids[rank], w1[mine].contiguous(), w2[mine].contiguous(),
                    w3[mine].contiguous(), workspace=fwd_ws, schedule="fused", score_before_experts=score_before,
                    saved_h13=h13, error_check="sync")
        outs = {}
        for schedule in ("sequential", "fused", "fused_again", "local_first"):
            # local_first: dispatch_dh dispatches the rows that stay on this rank first (LayerParams.local_first),
            # then 16 programs send the others while the rest start on own-rows tiles (with the short-K
            # defaults' dispatch_programs every program would send).
            local_first = schedule == "local_first"
            outs[schedule] = moe_backward(
                gs[rank], xs[rank], ss[rank], ids[rank], w1[mine].contiguous(), w2[mine].contiguous(),
                w3[mine].contiguous(), workspace=ws, schedule="sequential" if schedule == "sequential" else "fused",
                score_before_experts=score_before, saved_h13=h13, error_check="sync",
                params=default_params(world, hidden=hidden).replace(
                    local_first=local_first, **(dict(dispatch_programs=16) if local_first else {})))
        # The fused backward (route kernels, megakernels, lazy error poll) never syncs.
        args = (gs[rank], xs[rank], ss[rank], ids[rank], w1[mine].contiguous(), w2[mine].contiguous(),
                w3[mine].contiguous())
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            moe_backward(*args, workspace=ws, schedule="fused", score_before_experts=score_before, saved_h13=h13)
            no_sync = True
        except RuntimeError as exc:
            no_sync = False
            print(f"rank {rank} case {case}: host sync in the fused backward: {exc}", flush=True)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        ws.check_errors()
        failures += not no_sync
        print(f"rank {rank} case {case} no host sync: {'PASS' if no_sync else 'FAIL'}", flush=True)
        # float64: every rank's tokens (weight grads sum over all of them).
        leaves = [t.double().requires_grad_() for t in (w1, w2, w3)]
        ref_x = ref_s = None
        for r in range(world):
            x = xs[r].double().requires_grad_()
            s = ss[r].double().requires_grad_()
            out = float64_moe_oracle(x, s, ids[r], *leaves, score_before_experts=score_before)
            if out.requires_grad:
                (out * gs[r].double()).sum().backward()
            if r == rank:
                ref_x = x.grad if x.grad is not None else torch.zeros_like(x)
                ref_s = s.grad if s.grad is not None else torch.zeros_like(s)
        refs = [ref_x, ref_s] + [leaf.grad[mine] for leaf in leaves]
        for i, name in enumerate(NAMES):
            seq, fus, again, lf = (outs[k][i] for k in ("sequential", "fused", "fused_again", "local_first"))
            ok_bits = torch.equal(seq, fus) and torch.equal(fus, again) and torch.equal(seq, lf)

            def rel(a):
                return ((a.double() - refs[i]).abs().max().item() / max(refs[i].abs().max().item(), 1e-6)
                        if refs[i].numel() else 0.0)

            err = rel(fus)
            ok = ok_bits and err < 3e-2 and not torch.isnan(fus).any()
            failures += not ok
            print(f"rank {rank} case {case} {name}: bitwise={ok_bits} rel_err={err:.3g} {'PASS' if ok else 'FAIL'}",
                  flush=True)
        dist.barrier()
    print(f"rank {rank}: {'ALL PASS' if failures == 0 else f'{failures} FAILURES'}", flush=True)
    dist.destroy_process_group()
    raise SystemExit(1 if failures else 0)


if __name__ == "__main__":
    main()
