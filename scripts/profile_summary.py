"""GPU time of one profiled training step, by kernel and by kind, from a torch profiler trace.

    python scripts/profile_summary.py OUT/profile_traces/iteration_10/rank0_trace.json [--top 30]

TorchTitan writes the trace with ``--profiling.enable_profiling`` (Chrome
trace JSON, often hundreds of MB). This prints what a reader needs to see
where a step's time goes: the GPU's busy time, the kernels with the most
time (calls, total and mean microseconds, share of busy time), and the time
by kind (UniEP's megakernels, GEMMs, attention, the optimizer, copies and
casts, the rest), matched on kernel names; and where the GPU waits for the
host: the profiled step's host time, the GPU's idle time between its first
and last event, and its longest idle gaps with the kernels around them and
the CPU op running meanwhile.
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
    ap.add_argument("--gap-us", type=float, default=20.0, help="idle gaps of the GPU shorter than this are not listed")
    ap.add_argument("--top-gaps", type=int, default=10)
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
    print_idle(events, kernels, args.gap_us, args.top_gaps)
    print("\n| kind | ms | share |\n|---|---|---|")
    for kind, dur in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        print(f"| {kind} | {dur / 1e3:.2f} | {dur / total:.1%} |")
    print(f"\n| kernel (top {args.top}) | calls | total us | mean us | share |\n|---|---|---|---|---|")
    for name, (calls, dur) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[: args.top]:
        print(f"| {name[:110]} | {calls} | {dur:.0f} | {dur / calls:.1f} | {dur / total:.1%} |")


def idle_gaps(kernels: list[dict]) -> list[tuple[float, float, dict, dict]]:
    """Intervals where no GPU event runs, between the first and the last:
    ``(start us, length us, the event before, the event after)``."""
    gaps = []
    ordered = sorted(kernels, key=lambda e: e["ts"])
    last_end, last = ordered[0]["ts"] + ordered[0]["dur"], ordered[0]
    for e in ordered[1:]:
        if e["ts"] > last_end:
            gaps.append((last_end, e["ts"] - last_end, last, e))
        if e["ts"] + e["dur"] >= last_end:
            last_end, last = e["ts"] + e["dur"], e
    return gaps


def print_idle(events: list[dict], kernels: list[dict], gap_us: float, top: int) -> None:
    """The profiled step's wall time against the GPU's busy time, and where the GPU waits:
    the longest idle gaps, the kernels around each and the innermost CPU op running at its middle."""
    steps = [e for e in events if e.get("ph") == "X" and str(e.get("name", "")).startswith("ProfilerStep#")]
    gaps = idle_gaps(kernels)
    idle = sum(length for _, length, _, _ in gaps)
    if steps:
        step = steps[-1]
        print(f"{step['name']}: {step['dur'] / 1e3:.2f} ms on the host")
    long_gaps = [g for g in gaps if g[1] >= gap_us]
    print(f"GPU idle between its first and last event: {idle / 1e3:.2f} ms in {len(gaps)} gaps, "
          f"{sum(g[1] for g in long_gaps) / 1e3:.2f} ms of it in {len(long_gaps)} gaps of {gap_us:g} us or more")
    cpu_ops = [e for e in events if e.get("ph") == "X" and e.get("cat") == "cpu_op"]
    if not long_gaps:
        return
    print(f"\n| idle us | after kernel | before kernel | CPU op at its middle |\n|---|---|---|---|")
    for start, length, before, after in sorted(long_gaps, key=lambda g: -g[1])[:top]:
        middle = start + length / 2
        covering = [e for e in cpu_ops if e["ts"] <= middle <= e["ts"] + e["dur"]]
        op = min(covering, key=lambda e: e["dur"])["name"] if covering else "-"
        print(f"| {length:.0f} | {before['name'][:50]} | {after['name'][:50]} | {op[:50]} |")


if __name__ == "__main__":
    main()
