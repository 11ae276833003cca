"""Which optional paths the analytic model would pick, per shape: a Markdown table.

    python scripts/variant_report.py                                   # uncalibrated H200 constants
    python scripts/variant_report.py --constants h200.json --worlds 1,2,4 --shape qwen3 --shape deepseek

For every optional path of the layer (``VARIANTS``: descriptor loads in fc2
and dA, deferred releases, fc2's flattened loop, own rows first,
dispatch-first, two programs per SM, the dH tasks' slot-row copy), the best
predicted forward + backward time
over the search grid (``tuning.space.enumerate_points``; with
``numerics=True`` for the paths that change bits) with the path on and with
it off, and the model's verdict. A path the model never picks on any shape
is a candidate for removal once the measured search agrees (docs/design.md,
"What the searches picked").
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from titan_uniep.shapes import add_shape_argument  # noqa: E402
from titan_uniep.tuning.model import RoutingStats, default_constants, load_constants, rank  # noqa: E402
from titan_uniep.tuning.space import LayerShape, enumerate_points  # noqa: E402

# name: (is the path on for a point, needs the numerics grid)
VARIANTS = {
    "fc2 descriptor loads": (lambda p: p.fc2_tma, False),
    "dA descriptor loads": (lambda p: p.da_tma, False),
    "fc2 deferred release": (lambda p: p.fc2_defer_release, False),
    "fc2 flattened loop": (lambda p: p.fc2_flat_loop, False),
    "own rows first": (lambda p: p.local_first, False),
    "dispatch-first (fc1)": (lambda p: p.dispatch_programs >= 1024, False),
    "fc2 two programs per SM": (lambda p: p.fc2_programs_per_sm > 1, False),
    "dA two programs per SM": (lambda p: p.da_programs_per_sm > 1, False),
    "dH tasks copy the slot rows": (lambda p: p.dh_copies_rows, False),
}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--constants", help="calibrated constants (default: uncalibrated H200)")
    add_shape_argument(ap, default=("qwen3", "deepseek", "mixtral"))
    ap.add_argument("--worlds", default="2")
    return ap


def main() -> int:
    args = build_parser().parse_args()
    hw = load_constants(args.constants) if args.constants else default_constants("NVIDIA H200")
    print(f"constants: {hw.source}\n")
    print("| shape | W | path | best with (ms) | best without (ms) | model picks it |")
    print("|---|---|---|---|---|---|")
    for name, (t, d, h, e, k) in args.shapes:
        for world in (int(w) for w in args.worlds.split(",")):
            shape = LayerShape(t, d, h, e, k, world, 2)
            stats = RoutingStats.uniform(t, e, k, world)
            grids = {}
            for numerics in (False, True):
                points = list(enumerate_points(shape, numerics=numerics, hw=hw))
                grids[numerics] = [(p, r.total) for p, r in rank(shape, stats, world, points, hw)]
            for variant, (on, numerics) in VARIANTS.items():
                ranked = grids[numerics]
                with_ = next((ms for p, ms in ranked if on(p)), None)
                without = next((ms for p, ms in ranked if not on(p)), None)
                picks = "n/a" if with_ is None or without is None else ("yes" if with_ < without else "no")
                fmt = lambda v: "infeasible" if v is None else f"{v:.3f}"  # noqa: E731
                print(f"| {name} | {world} | {variant} | {fmt(with_)} | {fmt(without)} | {picks} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
