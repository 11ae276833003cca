"""GPU time of one profiled training step, by kernel and by kind, from a torch profiler trace.

    python scripts/profile_summary.py OUT/profile_traces/iteration_10/rank0_trace.json [--top 30]

TorchTitan writes the trace with ``--profiling.enable_profiling`` (Chrome
trace JSON, often hundreds of MB). This prints what a reader needs to see
where a step's time goes: the GPU's busy time, the kernels with the most
time (calls, total and mean microseconds, share of busy time), and the time
by kind (UniEP's megakernels, GEMMs, attention, the optimizer, copies and
casts, the rest), matched on kernel names.
"""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict

# (kind, pattern on the kernel name), first match wins.
KINDS = (
    ("uniep megakernels", r"dispatch_fc1|fc2_combine|dispatch_dh|da_combine|swiglu_backward|route_|exchange_counts|"
                          r"gather_slot_rows|wgrad_kernel"),
    ("grouped GEMM", r"grouped|Grouped|cutlass.*group"),
    ("attention", r"flash|fmha|attention|sdpa"),
    ("optimizer", r"adam|Adam|multi_tensor|foreach"),
    ("GEMM", r"gemm|Gemm|sm90_xmma|nvjet|cutlass|wgmma"),
    ("copies and casts", r"copy|Copy|cast|Cast|convert|to_copy|fill|Fill|memcpy|memset"),
    ("reductions and norms", r"reduce|Reduce|norm|Norm"),
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args()
    with open(args.trace) as f:
        events = json.load(f)["traceEvents"]
    kernels = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not kernels:
        raise SystemExit(f"{args.trace}: no GPU kernels in the trace")
    start = min(e["ts"] for e in kernels)
    end = max(e["ts"] + e["dur"] for e in kernels)
    # Busy time: the union of kernel intervals (streams may overlap).
    busy, last = 0.0, start
    for e in sorted(kernels, key=lambda e: e["ts"]):
        lo, hi = max(e["ts"], last), e["ts"] + e["dur"]
        if hi > lo:
            busy += hi - lo
            last = hi
    by_name = defaultdict(lambda: [0, 0.0])
    by_kind = defaultdict(float)
    for e in kernels:
        name = e["name"]
        by_name[name][0] += 1
        by_name[name][1] += e["dur"]
        kind = next((k for k, pattern in KINDS if re.search(pattern, name)), "other")
        by_kind[kind] += e["dur"]
    total = sum(d for _, d in by_name.values())
    print(f"{args.trace}: {len(kernels)} GPU events over {(end - start) / 1e3:.2f} ms, busy {busy / 1e3:.2f} ms, "
          f"kernel time {total / 1e3:.2f} ms")
    print("\n| kind | ms | share |\n|---|---|---|")
    for kind, dur in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        print(f"| {kind} | {dur / 1e3:.2f} | {dur / total:.1%} |")
    print(f"\n| kernel (top {args.top}) | calls | total us | mean us | share |\n|---|---|---|---|---|")
    for name, (calls, dur) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[: args.top]:
        print(f"| {name[:110]} | {calls} | {dur:.0f} | {dur / calls:.1f} | {dur / total:.1%} |")


if __name__ == "__main__":
    main()
