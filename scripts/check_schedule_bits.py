"""Which LayerParams fields change bits: one field at a time, every output.

    python scripts/check_schedule_bits.py --device cpu                          # interpreter, fp32, tiny shape
    python scripts/check_schedule_bits.py --device cuda --values all --workers 12 \\
        --json bits.json --table bits.md                                        # one GPU, bf16, three shapes
    python scripts/check_schedule_bits.py --device cpu --fields fc1_block_n,dh_num_warps --json out.json

For each field of ``titan_uniep.tuning.space.FIELDS`` that is not "fixed",
every other value of its range (``--values all``; or the first N valid
ones), valid for the shape and feasible on the GPU, this runs a simulated
world's fused forward (h1 | h3 saved) and the backward on the saved h1 | h3,
in both score modes, and compares the digests of every output and gradient
(forward output, the used h1 | h3 rows, dx, dscores, dw1, dw2, dw3 of every
rank) with the base point's (``interpreter_params()`` on CPU,
``default_params(W, hidden=H)`` on the GPU; for the Triton weight-gradient
kernel's fields ``wgrad_w13_*`` / ``wgrad_w2_*`` the base with
``wgrad_backend = "triton"``, since ``torch._grouped_mm`` runs otherwise).

Cases: on CPU one tiny shape (W = 2); on the GPU three shapes whose dims are
no powers of two, whose token counts fill no tile, one with an empty rank,
at simulated W = 1 and 2 (``CASES``). ``--workers N`` spreads the
(case, score mode, field) units over N processes (the GPU's host compiles
Triton kernels on its cores; the kernels are small).

A line per variant: the field's kind in the space, the tensors that
changed, and a verdict: ``ok`` (a schedule field, no bit changed, or a
numerics field that changed some), ``SCHEDULE FIELD CHANGED BITS`` (the
table or a kernel is wrong) or ``numerics, no change seen here`` (kept
numerics: another shape or device may show it). ``--table`` writes one
Markdown row per field and case. Exit 1 on a schedule field that changed bits.

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
    "cpu": [dict(name="cpu_w2", W=2, E=4, K=3, T=[5, 9], D=32, H=24, routing="random", seed=301, dtype="float32")],
    "cuda": [
        # H > 1024 class, one rank; E not a multiple of any row tile's experts; T fills no tile
        dict(name="w1_d1000_h1440_e12", W=1, E=12, K=3, T=[301], D=1000, H=1440, routing="skewed", seed=302),
        # H <= 1024 class, two ranks, one of them without tokens
        dict(name="w2_d576_h744_e10", W=2, E=10, K=4, T=[257, 0], D=576, H=744, routing="random", seed=303),
        # H > 2048 class, two ranks
        dict(name="w2_d2880_h2560_e6", W=2, E=6, K=2, T=[199, 301], D=2880, H=2560, routing="random", seed=304),
    ],
}
for _case in CASES["cuda"]:
    _case["dtype"] = "bfloat16"

# num_programs is None (one program per SM) in the space; explicit grids tried here.
EXTRA_VALUES = {"num_programs": (3, 37, 131)}
WGRAD_TILE_PREFIXES = ("wgrad_w13_", "wgrad_w2_")


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


def field_base(name: str, base):
    """The base point a field is varied from: the Triton weight-gradient kernel's tiles from the base with
    that kernel on (it runs only where torch._grouped_mm does not)."""
    if name.startswith(WGRAD_TILE_PREFIXES) and base.wgrad_backend != "triton":
        return base.replace(wgrad_backend="triton")
    return base


def run_unit(device: str, case: dict, score_before: bool, names: list[str], max_values: int | None,
             repeat: int = 1) -> list[dict]:
    """One case, one score mode, some fields: every variant's result (one worker's share).
    ``repeat``: every variant runs that many times (a difference in any run counts), and the
    base point's own runs after the first are checked against it (``field`` "(base point)")."""
    case = dict(case, kind=device, params={})
    inputs = golden.make_inputs(case, "cuda" if device == "cuda" else "cpu")
    world = case["W"]
    shape = space.LayerShape(max(case["T"]), case["D"], case["H"], case["E"], case["K"], world,
                             2 if case["dtype"] != "float32" else 4, score_before)
    base = interpreter_params() if device == "cpu" else default_params(world, hidden=case["H"])
    hw = None if device == "cpu" else default_constants("NVIDIA H200")
    mode = "before" if score_before else "after"
    refs: dict = {}
    results = []
    for again in range(1, repeat):
        refs.setdefault(base, digests(base, inputs, score_before))
        diff = changed(digests(base, inputs, score_before), refs[base])
        verdict = "BASE POINT NOT REPRODUCIBLE" if diff else "ok"
        print(f"  [{case['name']} {mode}] base point, run {again + 1}: {verdict}; changed: {diff or 'nothing'}",
              flush=True)
        results.append(dict(case=case["name"], world=world, scores=mode, field="(base point)", value=again + 1,
                            kind="schedule", keeps_bits_by_table=True, changed=diff, verdict=verdict))
    for name in names:
        field = space.FIELDS[name]
        start = field_base(name, base)
        current = getattr(start, name)
        tried = 0
        for value in (*field.values, *EXTRA_VALUES.get(name, ())):
            if value == current or (max_values is not None and tried >= max_values):
                continue
            try:
                point = start.replace(**{name: value})
            except ValueError as err:
                print(f"  [{case['name']} {mode}] {name}={value!r}: not a valid point ({err})", flush=True)
                continue
            if space.feasible(point, shape, hw) is not None:
                continue
            tried += 1
            t0 = time.time()
            try:
                if start not in refs:
                    refs[start] = digests(start, inputs, score_before)
                diff = sorted({t for _ in range(repeat) for t in changed(digests(point, inputs, score_before),
                                                                        refs[start])})
            except ValueError as err:  # a choice this device cannot run (grouped_mm without a GPU)
                print(f"  [{case['name']} {mode}] {name}={value!r}: cannot run here ({err})", flush=True)
                continue
            keeps = field.kind == "schedule" or (field.kind == "mixed" and
                                                 field.order_key(value) == field.order_key(current))
            if keeps and diff:
                verdict = "SCHEDULE FIELD CHANGED BITS"
            elif keeps or diff:
                verdict = "ok"
            else:
                verdict = "numerics, no change seen here"
            print(f"  [{case['name']} {mode}] {name}={value!r} ({field.kind}): {verdict}; changed: "
                  f"{diff or 'nothing'} ({time.time() - t0:.1f} s)", flush=True)
            results.append(dict(case=case["name"], world=world, scores=mode, field=name, value=value,
                                kind=field.kind, keeps_bits_by_table=keeps, changed=diff, verdict=verdict))
    return results


def _run_unit_in_worker(args: tuple) -> list[dict]:
    device, case, score_before, names, max_values, blas_dot, repeat = args
    if device == "cpu" and not blas_dot:
        with shape_independent_dot():
            return run_unit(device, case, score_before, names, max_values, repeat)
    return run_unit(device, case, score_before, names, max_values, repeat)


def table(results: list[dict]) -> str:
    """One row per field: its kind, the values tried, and per case and score mode what changed."""
    columns = sorted({(r["case"], r["world"], r["scores"]) for r in results})
    head = "| field | kind | values tried | " + " | ".join(f"{c} (W = {w}), scores {s}" for c, w, s in columns)
    lines = [head + " |", "|" + "---|" * (3 + len(columns))]
    for name in dict.fromkeys(r["field"] for r in results):
        rows = [r for r in results if r["field"] == name]
        values = ", ".join(str(v) for v in dict.fromkeys(r["value"] for r in rows))
        cells = []
        for col in columns:
            mine = [r for r in rows if (r["case"], r["world"], r["scores"]) == col]
            moved = [f"{r['value']}: {', '.join(t.split('.', 1)[1] for t in r['changed'])}" for r in mine
                     if r["changed"]]
            cells.append("; ".join(moved) if moved else (f"no change ({len(mine)})" if mine else "-"))
        lines.append(f"| `{name}` | {rows[0]['kind']} | {values} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--fields", help="comma-separated fields (default: every field that is not fixed)")
    ap.add_argument("--values", default="2", help="other values tried per field: a number, or 'all'")
    ap.add_argument("--scores", choices=("after", "before", "both"), default="both",
                    help="score modes (router scores applied after or before the experts)")
    ap.add_argument("--cases", help="comma-separated case names (default: every case of the device)")
    ap.add_argument("--workers", type=int, default=1, help="processes the (case, score mode, field) units run in")
    ap.add_argument("--repeat", type=int, default=1,
                    help="runs of every variant, and of the base point against its first run (a flaky result "
                    "differs in some run)")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--table", help="write a Markdown table here (one row per field)")
    ap.add_argument("--blas-dot", action="store_true",
                    help="cpu: keep the interpreter's numpy dot, whose rounding depends on the tile shape "
                    "(default: tests/interpreter_dot.py's shape-independent dot)")
    args = ap.parse_args()
    max_values = None if args.values == "all" else int(args.values)
    # Schedule and mixed fields first: the contract is theirs (a run cut short has checked them).
    names = args.fields.split(",") if args.fields else sorted(
        (n for n, f in space.FIELDS.items() if f.kind != "fixed"), key=lambda n: space.FIELDS[n].kind == "numerics")
    unknown = [n for n in names if n not in space.FIELDS]
    if unknown:
        ap.error(f"unknown fields {unknown}")
    cases = CASES[args.device]
    if args.cases:
        wanted = args.cases.split(",")
        cases = [c for c in cases if c["name"] in wanted]
        if len(cases) != len(wanted):
            ap.error(f"--cases: known cases are {[c['name'] for c in CASES[args.device]]}")
    modes = {"after": (False,), "before": (True,), "both": (False, True)}[args.scores]
    # Units small enough to balance the workers: a few fields each.
    per_unit = len(names)
    if args.workers > 1:
        per_unit = max(1, len(names) * len(cases) * len(modes) // (3 * args.workers))
    units = [(args.device, case, sb, names[i:i + per_unit], max_values, args.blas_dot, args.repeat)
             for case in cases for sb in modes for i in range(0, len(names), per_unit)]
    start = time.time()
    results: list[dict] = []
    if args.workers <= 1:
        for unit in units:
            results += _run_unit_in_worker(unit)
    else:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(max_workers=args.workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            for part in pool.map(_run_unit_in_worker, units):
                results += part
    bad = [r for r in results if r["verdict"] in ("SCHEDULE FIELD CHANGED BITS", "BASE POINT NOT REPRODUCIBLE")]
    print(f"{len(results)} variants in {time.time() - start:.0f} s; {len(bad)} schedule variants changed bits")
    for r in bad:
        print(f"  {r['case']} scores {r['scores']}: {r['field']}={r['value']!r} changed {', '.join(r['changed'])}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    if args.table:
        Path(args.table).write_text(table(results))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
