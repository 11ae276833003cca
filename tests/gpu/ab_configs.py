"""A/B of forward kernel configurations on 2 GPUs (no TorchTitan, no GEMM-only):
times ``moe_forward`` (fused and sequential) per shape for a few
``KernelConfig`` variants on one workspace built for the presum combine (it
serves every combine mode), same inputs as ``titan_uniep.bench``.

    torchrun --nproc_per_node 2 tests/gpu/ab_configs.py [--shapes qwen3,deepseek,mixtral] [--reps 10]
"""

import argparse
import json
import os

import torch
import torch.distributed as dist

from titan_uniep.bench import SHAPES, make_routing, time_ms
from titan_uniep.fused import moe_forward
from titan_uniep.kernels.tuning import default_config
from titan_uniep.symm import Workspace

VARIANTS = {
    "presum": dict(combine="presum"),
    "direct": dict(combine="direct"),
    "presum_comm132": dict(combine="presum", num_comm_sms=132),
    "direct_comm132": dict(combine="direct", num_comm_sms=132),
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="qwen3,deepseek,mixtral")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args()
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", device_id=dev)
    group, rank, world = dist.group.WORLD, dist.get_rank(), dist.get_world_size()
    base = default_config(world)
    for name in args.shapes.split(","):
        t, d, h, e, k = SHAPES[name]
        el = e // world
        wgen = torch.Generator(device=dev).manual_seed(0)
        w1 = (torch.randn(el, h, d, generator=wgen, device=dev) * d**-0.5).to(torch.bfloat16)
        w3 = (torch.randn(el, h, d, generator=wgen, device=dev) * d**-0.5).to(torch.bfloat16)
        w2 = (torch.randn(el, d, h, generator=wgen, device=dev) * h**-0.5).to(torch.bfloat16)
        gen = torch.Generator(device=dev).manual_seed(rank)
        x = torch.randn(t, d, generator=gen, device=dev).to(torch.bfloat16)
        scores, indices = make_routing("balanced", t, e, k, gen, dev)
        ws = Workspace.for_group(group, num_tokens=t, dim=d, hidden=h, num_experts=e, top_k=k, dtype=torch.bfloat16,
                                 device=dev, config=base.replace(combine="presum"))
        record = {"shape": name}
        with torch.no_grad():
            for variant in args.variants.split(","):
                cfg = base.replace(**VARIANTS[variant])
                for schedule in ("fused", "sequential"):
                    if schedule == "sequential" and "comm132" in variant:
                        continue  # num_comm_sms only matters to the fused schedule
                    ms = torch.tensor([time_ms(
                        lambda: moe_forward(x, scores, indices, w1, w2, w3, workspace=ws, schedule=schedule,
                                            score_before_experts=False, config=cfg, error_check="lazy"),
                        args.warmup, args.reps)], device=dev)
                    dist.all_reduce(ms, op=dist.ReduceOp.MAX)
                    record[f"{variant}_{schedule}_ms"] = round(ms.item(), 4)
            ws.check_errors()
        if rank == 0:
            print("AB " + json.dumps(record), flush=True)
        del ws
        torch.cuda.empty_cache()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
