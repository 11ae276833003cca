"""Which LayerParams fields change bits: one field at a time, every output.

    python scripts/check_schedule_bits.py --device cpu                # interpreter, fp32, tiny shapes
    python scripts/check_schedule_bits.py --device cuda               # one GPU, bf16, default_params base
    python scripts/check_schedule_bits.py --device cpu --fields fc1_block_n,dh_num_warps --json out.json

For each field of ``titan_uniep.tuning.space.FIELDS`` that is not "fixed",
up to ``--values`` other values (valid for the shape; feasible on the GPU),
this runs a simulated world's fused forward (h1 | h3 saved) and the
backward on the saved h1 | h3, in both score modes, and compares the digests
of every output and gradient (forward output, the used h1 | h3 rows, dx,
dscores, dw1, dw2, dw3 of every rank) with the base point's (``interpreter_params()`` on CPU, ``default_params(W, hidden=H)``
on the GPU). A line per variant: the field's kind in the space, the tensors
that changed, and a verdict: ``ok`` (a schedule field, no bit changed, or a
numerics field that changed some), ``SCHEDULE FIELD CHANGED BITS`` (the
table is wrong) or ``numerics, no change seen here`` (kept numerics: another
shape or device may show it). Exit 1 on a schedule field that changed bits.

On CPU the interpreter's ``tl.dot`` is made shape-independent
(``tests/interpreter_dot.py``: numpy's BLAS rounds by the matrices' shapes,
tensor cores do not); ``--blas-dot`` keeps numpy's, under which every GEMM
tile width changes bits.

Inputs and digests come from ``tests/golden/make_golden.py`` (its
``make_inputs``, ``run_forward``, ``run_backward``, ``digest``).
"""

from __future__ import annotations

import os
import sys

_DEVICE = "cuda" if "--device" in sys.argv and sys.argv[sys.argv.index("--device") + 1] == "cuda" else "cpu"
if _DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests" / "golden"), str(REPO / "tests")]

import make_golden as golden  # noqa: E402
from interpreter_dot import shape_independent_dot  # noqa: E402

from titan_uniep.params import default_params, interpreter_params  # noqa: E402
from titan_uniep.tuning import space  # noqa: E402
from titan_uniep.tuning.hardware import default_constants  # noqa: E402

CASES = {
    "cpu": dict(W=2, E=4, K=3, T=[5, 9], D=32, H=24, routing="random", seed=301, dtype="float32"),
    "cuda": dict(W=2, E=8, K=4, T=[301, 257], D=512, H=768, routing="random", seed=302, dtype="bfloat16"),
}


def digests(params, inputs, score_before: bool) -> dict[str, str]:
    outs, h13 = golden.run_forward(params, inputs, schedule="fused", score_before=score_before)
    result = {}
    for r, out in enumerate(outs):
        result[f"fwd.out.r{r}"] = golden.digest(out)
        result[f"fwd.h13.r{r}"] = golden.digest(h13[r, : inputs["used_slots"][r]])
    grads = golden.run_backward(params, inputs, schedule="fused", score_before=score_before, saved_h13=h13)
    for r, per_rank in enumerate(grads):
        for name, g in zip(golden.GRAD_NAMES, per_rank):
            result[f"bwd_saved.{name}.r{r}"] = golden.digest(g)
    return result


def changed(a: dict[str, str], b: dict[str, str]) -> list[str]:
    """Names that differ, with the rank suffix folded (``bwd_saved.dscores``)."""
    return sorted({k.rsplit(".", 1)[0] for k in a if a[k] != b.get(k)})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--fields", help="comma-separated fields (default: every field that is not fixed)")
    ap.add_argument("--values", type=int, default=2, help="other values tried per field")
    ap.add_argument("--scores", choices=("after", "before", "both"), default="both",
                    help="score modes (router scores applied after or before the experts)")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--blas-dot", action="store_true",
                    help="cpu: keep the interpreter's numpy dot, whose rounding depends on the tile shape "
                    "(default: tests/interpreter_dot.py's shape-independent dot)")
    args = ap.parse_args()
    if args.device == "cpu" and not args.blas_dot:
        with shape_independent_dot():
            return run(args)
    return run(args)


def run(args) -> int:

    case = dict(CASES[args.device], name="check_schedule_bits", kind=args.device, params={})
    inputs = golden.make_inputs(case, args.device)
    shape = space.LayerShape(max(case["T"]), case["D"], case["H"], case["E"], case["K"], case["W"],
                             2 if case["dtype"] != "float32" else 4)
    base = interpreter_params() if args.device == "cpu" else default_params(case["W"], hidden=case["H"])
    hw = None if args.device == "cpu" else default_constants("NVIDIA H200")
    names = args.fields.split(",") if args.fields else [n for n, f in space.FIELDS.items() if f.kind != "fixed"]
    results, bad = [], 0
    for score_before in {"after": (False,), "before": (True,), "both": (False, True)}[args.scores]:
        mode = "before" if score_before else "after"
        t0 = time.time()
        ref = digests(base, inputs, score_before)
        print(f"[scores {mode}] base point ({time.time() - t0:.1f} s)", flush=True)
        for name in names:
            field = space.FIELDS[name]
            current = getattr(base, name)
            tried = 0
            for value in field.values:
                if value == current or tried >= args.values:
                    continue
                try:
                    point = base.replace(**{name: value})
                except ValueError as err:
                    print(f"  {name}={value!r}: not a valid point ({err})")
                    continue
                why = space.feasible(point, shape, hw)
                if why is not None:
                    continue
                tried += 1
                t0 = time.time()
                try:
                    diff = changed(digests(point, inputs, score_before), ref)
                except ValueError as err:  # a choice this device cannot run (grouped_mm without a GPU)
                    print(f"  [{mode}] {name}={value!r}: cannot run here ({err})")
                    continue
                keeps = field.kind == "schedule" or (field.kind == "mixed" and
                                                     field.order_key(value) == field.order_key(current))
                if keeps and diff:
                    verdict, bad = "SCHEDULE FIELD CHANGED BITS", bad + 1
                elif keeps or diff:
                    verdict = "ok"
                else:
                    verdict = "numerics, no change seen here"
                print(f"  [{mode}] {name}={value!r} ({field.kind}): {verdict}; changed: {diff or 'nothing'} "
                      f"({time.time() - t0:.1f} s)", flush=True)
                results.append(dict(scores=mode, field=name, value=value, kind=field.kind, changed=diff,
                                    verdict=verdict))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    print(f"{bad} schedule variants changed bits")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
