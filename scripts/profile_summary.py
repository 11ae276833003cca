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
    ap.add_argument("--top-host", type=int, default=15, help="rows of each host-time table")
    args = ap.parse_args()
    with open(args.trace) as f:
        events = json.load(f)["traceEvents"]
    kernels = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not kernels:
        raise SystemExit(f"{args.trace}: no GPU kernels in the trace")
    kernels, scope = step_kernels(events, kernels)
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
    print(f"{args.trace}: {len(kernels)} GPU events {scope} over {(end - start) / 1e3:.2f} ms, "
          f"busy {busy / 1e3:.2f} ms, kernel time {total / 1e3:.2f} ms")
    print_idle(events, kernels, args.gap_us, args.top_gaps)
    print_host(events, args.top_host)
    print("\n| kind | ms | share |\n|---|---|---|")
    for kind, dur in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        print(f"| {kind} | {dur / 1e3:.2f} | {dur / total:.1%} |")
    print(f"\n| kernel (top {args.top}) | calls | total us | mean us | share |\n|---|---|---|---|---|")
    for name, (calls, dur) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[: args.top]:
        print(f"| {name[:110]} | {calls} | {dur:.0f} | {dur / calls:.1f} | {dur / total:.1%} |")


def step_kernels(events: list[dict], kernels: list[dict]) -> tuple[list[dict], str]:
    """The GPU events the profiled step launched: those whose launch (a CUDA
    runtime or driver call, matched on ``args.correlation``) lies within the
    last ``ProfilerStep#`` on the host. A trace also holds work of the step
    before that still ran on the GPU (its optimizer, say); without step
    annotations or correlation ids every event is kept."""
    steps = [e for e in events if e.get("ph") == "X" and str(e.get("name", "")).startswith("ProfilerStep#")]
    if not steps:
        return kernels, "(the whole trace)"
    lo, hi = steps[-1]["ts"], steps[-1]["ts"] + steps[-1]["dur"]
    launched = {e["args"]["correlation"] for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and lo <= e.get("ts", -1) < hi
                and "correlation" in e.get("args", {})}
    mine = [e for e in kernels if e.get("args", {}).get("correlation") in launched]
    if not mine:
        return kernels, "(the whole trace: no launch matched to the step)"
    return mine, f"launched in {steps[-1]['name']} ({len(kernels) - len(mine)} others left out)"


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


HOST_CATS = ("cpu_op", "user_annotation", "cuda_runtime", "cuda_driver", "python_function")


def host_times(events: list[dict], lo: float, hi: float):
    """Host events starting in ``[lo, hi)``: per thread the busy time (the
    union of its events), and per op name ``[calls, inclusive us, self us]``
    (self: the time not covered by an event nested in it on its thread)."""
    by_thread = defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in HOST_CATS and lo <= e["ts"] < hi and "dur" in e:
            by_thread[(e.get("pid"), e.get("tid"))].append(e)
    busy, ops = {}, defaultdict(lambda: [0, 0.0, 0.0])
    for thread, evs in by_thread.items():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[dict] = []
        covered = 0.0
        for e in evs:
            while stack and e["ts"] >= stack[-1]["ts"] + stack[-1]["dur"]:
                stack.pop()
            if stack:
                ops[stack[-1]["name"]][2] -= min(e["dur"], stack[-1]["ts"] + stack[-1]["dur"] - e["ts"])
            else:
                covered += e["dur"]
            row = ops[e["name"]]
            row[0] += 1
            row[1] += e["dur"]
            row[2] += e["dur"]
            stack.append(e)
        busy[thread] = covered
    return busy, ops


def print_host(events: list[dict], top: int) -> None:
    """Where the profiled step's host time goes (see the module docstring)."""
    steps = [e for e in events if e.get("ph") == "X" and str(e.get("name", "")).startswith("ProfilerStep#")]
    if not steps:
        return
    step = steps[-1]
    lo, hi = step["ts"], step["ts"] + step["dur"]
    busy, ops = host_times(events, lo, hi)
    outside = ops.pop(step["name"], [0, 0.0, 0.0])[2]
    print(f"\nHost threads busy in {step['name']} ({step['dur'] / 1e3:.2f} ms, {outside / 1e3:.2f} ms of it in no op): "
          + ", ".join(f"tid {t[1]} {b / 1e3:.2f} ms" for t, b in sorted(busy.items(), key=lambda kv: -kv[1])))
    print(f"\n| host op (top {top} by own time) | calls | own us | with callees us |\n|---|---|---|---|")
    for name, (calls, incl, own) in sorted(ops.items(), key=lambda kv: -kv[1][2])[:top]:
        print(f"| {name[:80]} | {calls} | {own:.0f} | {incl:.0f} |")
    framework = {n: r for n, r in ops.items() if not n.startswith(("aten::", "cuda", "cu"))}
    print(f"\n| framework op (top {top} with callees) | calls | with callees us | mean us |\n|---|---|---|---|")
    for name, (calls, incl, _own) in sorted(framework.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"| {name[:80]} | {calls} | {incl:.0f} | {incl / calls:.1f} |")


if __name__ == "__main__":
    main()
