"""Time the default point's fused forward and backward of this tree's kernels against
another commit's, side by side in one process, on one GPU (a simulated world of one rank).

    python scripts/speed_against_commit.py --base 0fbe63e^                       # the five tuning shapes
    python scripts/speed_against_commit.py --base HEAD~3 --shape qwen3_1gpu --score-before
    python scripts/speed_against_commit.py --base old/      # a folder holding the base's titan_uniep/

The base commit's ``titan_uniep`` (``git archive``, or copied from a folder: a checkout
without the commit, as on a machine the tree was copied to) goes into a temporary
folder and is imported under another name, so both versions' kernels run in turn in one
process (``timing.time_alternating``: alternating order, medians over rounds; each
timing builds its version's workspaces and drops them after, and the bitwise
comparison keeps the results on the host, so one version's buffers are on the GPU
at a time: DeepSeek-like shapes fit 80 GB). For each
shape: the fused forward (h1 | h3 saved) and the fused backward on the saved h1 | h3,
milliseconds; whether the forward output and each gradient are bitwise equal between the
two versions. One JSON line per shape, then a Markdown table.
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from titan_uniep.shapes import TUNING_SHAPES, add_shape_argument  # noqa: E402
from titan_uniep.timing import time_alternating  # noqa: E402

BASE_NAME = "titan_uniep_base"


def import_base(rev: str, into: Path):
    """``titan_uniep`` of commit ``rev`` (or of the folder ``rev``) as the package ``titan_uniep_base``."""
    if Path(rev, "titan_uniep").is_dir():
        shutil.copytree(Path(rev, "titan_uniep"), into / "titan_uniep")
    else:
        archive = subprocess.run(["git", "-C", str(REPO), "archive", rev, "titan_uniep"], check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    package = into / BASE_NAME
    (into / "titan_uniep").rename(package)
    for path in package.rglob("*.py"):
        path.write_text(re.sub(r"\btitan_uniep\b", BASE_NAME, path.read_text()))
    sys.path.insert(0, str(into))
    return importlib.import_module(f"{BASE_NAME}.runtime")


def layer_calls(runtime, shape, inputs, score_before: bool):
    """(forward, backward) callables of one version on ``inputs``, with their own workspaces."""
    from titan_uniep.layout import slot_capacity

    t, d, h, e, k = shape
    sizes = dict(num_tokens=t, dim=d, hidden=h, num_experts=e, top_k=k, dtype=torch.bfloat16, device="cuda")
    ws, bws = runtime.Workspace.simulated(1, **sizes), runtime.BackwardWorkspace.simulated(1, **sizes)
    h13 = torch.empty(1, slot_capacity(1, t, k, e), 2 * h, dtype=torch.bfloat16, device="cuda")
    out = torch.empty(1, t, d, dtype=torch.bfloat16, device="cuda")
    x, g, s, idx, w1, w2, w3 = inputs

    def forward():
        return runtime.simulated_moe_forward(x, s, idx, w1, w2, w3, schedule="fused", score_before_experts=score_before,
                                             workspace=ws, out=out, saved_h13=h13, error_check="lazy")

    def backward():
        return runtime.simulated_moe_backward(g, x, s, idx, w1, w2, w3, schedule="fused",
                                              score_before_experts=score_before, workspace=bws, saved_h13=h13,
                                              error_check="lazy")

    return forward, backward, out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="the commit to compare with: a git revision, or a folder holding its titan_uniep/")
    add_shape_argument(ap, default=TUNING_SHAPES)
    ap.add_argument("--score-before", action="store_true", help="router scores applied before the experts")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("speed_against_commit.py times compiled kernels: it needs a CUDA GPU")
    import titan_uniep.runtime as runtime
    from titan_uniep.shapes import layer_inputs

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        versions = {"base": import_base(args.base, Path(tmp)), "tree": runtime}
        for name, shape in args.shapes:
            i = layer_inputs(shape, 0, 1, torch.device("cuda"))
            inputs = tuple(i[key].unsqueeze(0) for key in ("x", "grad", "scores", "indices", "w1", "w2", "w3"))
            del i
            results = {}
            for tag, rt in versions.items():  # one version's workspaces at a time (DeepSeek-like on 80 GB)
                forward, backward, out = layer_calls(rt, shape, inputs, args.score_before)
                forward()
                grads = backward()[0]
                results[tag] = (out.cpu(), [t.cpu() for t in grads])
                del forward, backward, out, grads
                torch.cuda.empty_cache()

            def build(rt, kind, inputs=inputs):
                forward, backward, _ = layer_calls(rt, shape, inputs, args.score_before)
                if kind == "bwd":
                    forward()  # the saved h1 | h3 the backward reads
                return forward if kind == "fwd" else backward

            times = time_alternating({f"{tag}_{kind}": (lambda rt=rt, kind=kind: build(rt, kind))
                                      for tag, rt in versions.items() for kind in ("fwd", "bwd")},
                                     warmup=args.warmup, reps=args.reps, rounds=args.rounds)
            row = dict(shape=name, score_before=args.score_before, **{k: round(v, 4) for k, v in times.items()},
                       out_bitwise=torch.equal(results["base"][0], results["tree"][0]),
                       grads_bitwise=dict(zip(("dx", "dscores", "dw1", "dw2", "dw3"),
                                              (torch.equal(a, b) for a, b in zip(results["base"][1],
                                                                                 results["tree"][1])))))
            print(json.dumps(row), flush=True)
            rows.append(row)
            del results, inputs
            torch.cuda.empty_cache()
    print(f"\n| shape | forward {args.base} | forward tree | tree / base | backward {args.base} | backward tree | "
          "tree / base |\n|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['shape']} | {r['base_fwd']:.3f} | {r['tree_fwd']:.3f} | {r['tree_fwd'] / r['base_fwd']:.3f} | "
              f"{r['base_bwd']:.3f} | {r['tree_bwd']:.3f} | {r['tree_bwd'] / r['base_bwd']:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
