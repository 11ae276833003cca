"""Check that a training run's GPU memory stays flat (no state leaks between steps).

    python -m titan_uniep.tools.memory_flat RUN_DIR [--skip 5] [--tolerance-mib 0]

Reads ``RUN_DIR/loss.jsonl`` (written by ``titan_uniep.torchtitan.train`` on a GPU: rank
0's allocated bytes after each step and the step's peak) and compares every
step after the first ``--skip`` (warm-up: optimizer states, workspaces and
compiled kernels appear there) with the first of them. Prints the spread of
both and exits non-zero if either grows by more than ``--tolerance-mib``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

MIB = 2**20


def spread(run: Path, skip: int) -> dict[str, tuple[int, int, int]]:
    """``{field: (first, min, max)}`` over the steps after ``skip``."""
    lines = [json.loads(line) for line in (run / "loss.jsonl").read_text().splitlines() if line.strip()]
    steps = [line for line in lines if line["step"] > skip]
    if not steps or "mem_allocated" not in steps[0]:
        raise SystemExit(f"{run}: no memory figures after step {skip} (a GPU run of titan_uniep.torchtitan.train writes them)")
    out = {}
    for field in ("mem_allocated", "mem_peak"):
        values = [line[field] for line in steps]
        out[field] = (values[0], min(values), max(values))
    out["steps"] = (steps[0]["step"], steps[-1]["step"], len(steps))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m titan_uniep.tools.memory_flat",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("run", type=Path)
    parser.add_argument("--skip", type=int, default=5)
    parser.add_argument("--tolerance-mib", type=float, default=0.0)
    args = parser.parse_args(argv)
    result = spread(args.run, args.skip)
    first_step, last_step, count = result.pop("steps")
    ok = True
    for field, (first, low, high) in result.items():
        grew = (high - first) / MIB
        print(f"{args.run.name} {field}: steps {first_step}-{last_step} ({count}): first {first / MIB:.1f} MiB, "
              f"min {low / MIB:.1f}, max {high / MIB:.1f}, growth {grew:.2f} MiB")
        ok &= grew <= args.tolerance_mib
    print("FLAT" if ok else "NOT FLAT")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
