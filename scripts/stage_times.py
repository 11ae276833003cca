"""Per-stage device times of UniEP layers on one GPU, as measurement records
for ``python -m titan_uniep.tuning.calibrate check`` (and ``fit``).

    python scripts/stage_times.py --shape qwen3_1gpu --shape 8192,3072,12288,8,2 --out stages.json
    python scripts/stage_times.py --shape mixtral_1gpu --set fc1_num_stages=4 --constants h200.json

Each layer runs as a one-rank simulated world (every expert local; the
shape's seeded inputs, ``shapes.layer_inputs``) at its default point (with
``--set`` overrides). The sequential schedule is profiled (median of
``--reps`` calls, each launch's device time from the torch profiler) and its
launches are mapped to the model's stages (``forward.exchange``: the route
kernels; ``forward.dispatch``, ``forward.fc1``, ``forward.fc2``,
``forward.reduce``; ``backward.dispatch``, ``backward.dh``,
``backward.swiglu``, ``backward.da``, ``backward.wgrad``: the
torch._grouped_mm calls, ``backward.reduce``); the fused schedule's totals
(``forward``, ``backward``) are CUDA-event medians. With ``--constants``
the model's prediction of every key is printed beside it.
"""

from __future__ import annotations

import argparse
import json

import torch

from titan_uniep.params import apply_overrides, default_params
from titan_uniep.runtime import BackwardWorkspace, Workspace, simulated_moe_backward, simulated_moe_forward
from titan_uniep.shapes import add_shape_argument, layer_inputs
from titan_uniep.timing import time_ms
from titan_uniep.tuning.calibrate import _kernel_times, check, measurement_record
from titan_uniep.tuning.model import RoutingStats, load_constants
from titan_uniep.tuning.space import LayerShape

ROUTE_KERNELS = ("route_histogram", "exchange_counts", "route_layout")


def forward_stages(times: list[tuple[str, float]]) -> dict[str, float]:
    """The sequential forward's launches (in order) as the model's stages."""
    out = {"forward.exchange": sum(ms for name, ms in times if name.startswith(ROUTE_KERNELS))}
    a = [ms for name, ms in times if "dispatch_fc1" in name]
    b = [ms for name, ms in times if "fc2_combine" in name]
    out.update({"forward.dispatch": a[0], "forward.fc1": a[1], "forward.fc2": b[0], "forward.reduce": b[-1]})
    return out


def backward_stages(times: list[tuple[str, float]]) -> dict[str, float]:
    """The sequential backward's launches as the model's stages: the kernels
    between dA and the reduce are the weight gradients."""
    out = {"backward.exchange": sum(ms for name, ms in times if name.startswith(ROUTE_KERNELS))}
    dh = [ms for name, ms in times if "dispatch_dh" in name]
    out.update({"backward.dispatch": dh[0], "backward.dh": dh[1]})
    out["backward.swiglu"] = sum(ms for name, ms in times if "swiglu" in name)
    gather = [ms for name, ms in times if "gather_slot_rows" in name]
    if gather:
        out["backward.gather"] = sum(gather)
    da_at = [i for i, (name, _) in enumerate(times) if "da_combine" in name]
    out["backward.da"] = times[da_at[0]][1]
    out["backward.reduce"] = times[da_at[-1]][1]
    out["backward.wgrad"] = sum(ms for name, ms in times[da_at[0] + 1:da_at[-1]] if "gather_slot_rows" not in name)
    return out


def measure_layer(name: str, dims, overrides: list[str], reps: int) -> dict:
    t, d, h, e, k = dims
    dev = torch.device("cuda", torch.cuda.current_device())
    params = apply_overrides(default_params(1, hidden=h), overrides)
    inp = layer_inputs(dims, 0, 1, dev)
    x, grad = inp["x"][None], inp["grad"][None]
    scores, indices = [inp["scores"]], [inp["indices"]]
    w1, w2, w3 = inp["w1"][None], inp["w2"][None], inp["w3"][None]
    sizes = dict(num_tokens=t, dim=d, hidden=h, num_experts=e, top_k=k, dtype=torch.bfloat16, device=dev)
    ws = Workspace.simulated(1, **sizes, params=params)
    bws = BackwardWorkspace.simulated(1, **sizes, params=params)
    h13 = torch.empty(1, ws.shape.slot_capacity, 2 * h, dtype=torch.bfloat16, device=dev)

    def forward(schedule):
        return lambda: simulated_moe_forward(x, scores, indices, w1, w2, w3, schedule=schedule,
                                             score_before_experts=False, params=params, workspace=ws,
                                             saved_h13=h13, error_check="lazy")

    def backward(schedule):
        return lambda: simulated_moe_backward(grad, x, scores, indices, w1, w2, w3, schedule=schedule,
                                              score_before_experts=False, params=params, workspace=bws,
                                              saved_h13=h13, error_check="lazy")

    measured = {"forward": time_ms(forward("fused"), 2, reps), "backward": time_ms(backward("fused"), 2, reps)}
    measured.update(forward_stages(_kernel_times(forward("sequential"), reps)))
    measured.update(backward_stages(_kernel_times(backward("sequential"), reps)))
    ws.check_errors()
    bws.check_errors()
    shape = LayerShape(t, d, h, e, k, 1, 2)
    changes = {f: getattr(params, f) for f in params.__dataclass_fields__
               if getattr(params, f) != getattr(shape.default_params(), f)}
    routing = RoutingStats.from_indices([indices[0].cpu().numpy()], e, 1)
    record = measurement_record(shape, changes, measured, schedule="fused", routing=routing)
    record["name"] = name
    return record


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_argument(ap, required=True)
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="change the default point")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", help="JSON file for the records (a list)")
    ap.add_argument("--constants", help="constants JSON: print the model's prediction beside each figure")
    return ap


def main() -> None:
    args = build_parser().parse_args()
    records = []
    for name, dims in args.shapes:
        record = measure_layer(name, dims, args.set, args.reps)
        records.append(record)
        print(name, json.dumps({k: round(v, 4) for k, v in record["measured"].items()}), flush=True)
        torch.cuda.empty_cache()
        if args.out:
            with open(args.out, "w") as f:
                json.dump(records, f, indent=1)
    if args.constants:
        table, _ = check(load_constants(args.constants), records)
        print(table)


if __name__ == "__main__":
    main()
