"""Compare the loss curves of two training runs, step by step.

    python3 -m titan_uniep.tools.compare_loss RUN_A RUN_B [--assert-bitwise]
        [--rtol X] [--atol X] [--max-step N] [--window N] [--plot out.png] [--labels A B]

A run is a dump folder (its ``loss.jsonl``, written by ``titan_uniep.torchtitan.train``:
exact float losses) or a file: a ``loss.jsonl`` or a TorchTitan log, whose
``step: N  loss: X.XXXXX`` lines carry only 5 decimals, so from a log only
"equal to 5 decimals" can be claimed, never bitwise equality.

Prints a per-step table, the largest absolute and relative differences, the
direction (at how many steps RUN_B is below RUN_A, and the mean signed relative
difference: whether one run's loss is lower on the whole), with
``--window N`` the largest relative difference of the two runs' N-step means
(consecutive blocks of N common steps, the last one possibly shorter), and a
verdict, and writes a plot of both curves and their difference with the
verdict in its title (default: ``loss_<A>_vs_<B>.png`` in RUN_B's folder,
A and B the runs' folder names or ``--labels``; ``--plot``/``--out`` names
another file). Exit status: 0 when the runs agree as
asked, 1 when they differ beyond ``--assert-bitwise`` / ``--rtol`` /
``--atol``, 2 when they cannot be compared (no losses, different steps, or
``--assert-bitwise`` on a log). ``--max-step N`` compares steps 1..N only
(e.g. a short run against the start of a longer one).

A NaN loss is a difference: it equals nothing, not even a NaN at the same
step of the other run, so two diverged runs are never "bitwise equal" or
within a tolerance. Runs with different steps get no verdict at all.

A run that records a step more than once (a loss.jsonl of a run resumed into
the same dump folder, written before it kept one record per step) is compared
on the last record of each, the resumed run's, and a note names those steps.
A loss.jsonl line that is not a record (the last one of a run killed while
writing it) stops the comparison with the file and the line (exit 2).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

LOSS_FILE = "loss.jsonl"

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# Training lines only: "validate step: N  loss: X" (metrics.py:505) is another curve.
_LOG_LINE = re.compile(r"(?<!validate )\bstep:\s*(\d+)\s+loss:\s*([-+]?(?:nan|inf|[0-9.]+(?:e[-+]?\d+)?))", re.IGNORECASE)


@dataclass
class Run:
    losses: dict[int, float]
    """step -> loss; a step logged twice keeps its last value (see ``repeated``)."""
    exact: bool
    """True when the losses are the exact floats (loss.jsonl), False for 5-decimal log text."""
    source: Path
    repeated: list[int] = field(default_factory=list)
    """Steps the source logs more than once, ascending: a run resumed into the same dump
    folder before ``loss.jsonl`` kept one record per step appended the steps it trained
    again. The last record, the resumed run's, is the one kept."""


@dataclass
class Comparison:
    steps: list[int]
    """Steps present in both runs, ascending."""
    only_a: list[int]
    only_b: list[int]
    max_abs: float
    """NaN when a common step has a NaN loss in either run."""
    max_rel: float
    mean_rel: float
    """Mean of the per-step relative differences (NaN as ``max_rel``; 0.0 without common steps)."""
    mean_signed_rel: float
    """Mean of ``(b - a) / |a|`` per step: negative when RUN_B's loss is lower on the whole."""
    below: int
    """Common steps where RUN_B's loss is below RUN_A's."""
    nan_steps: list[int]
    """Common steps where either run's loss is NaN (never equal)."""
    bitwise: bool
    """Every common step has the same float (the 5-decimal text when either run is a log)."""
    exact: bool
    """Both runs carry exact floats, so ``bitwise`` is a bitwise claim."""


def _jsonl_losses(path: Path, text: str) -> list[tuple[int, float]]:
    """``(step, loss)`` of every record of a loss.jsonl, in file order; a line that is
    not a record raises ValueError naming the file and the line."""
    lines = text.splitlines()
    last = max((n for n, line in enumerate(lines, 1) if line.strip()), default=0)
    records = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            records.append((int(record["step"]), float(record["loss"])))
        except json.JSONDecodeError as err:
            cut = ("the file ends in the middle of it: it looks truncated (a run killed while writing it)"
                   if n == last and not text.endswith("\n") else
                   "it looks cut short (a run killed while writing it, then resumed into the same folder)")
            raise ValueError(f"{path}, line {n}: not a JSON record ({err.msg}: column {err.colno}); {cut}. "
                             f"Delete line {n} to compare the other steps") from None
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{path}, line {n}: not a loss record (it needs \"step\" and \"loss\"): "
                             f"{line[:80]}") from None
    return records


def load_run(path: str | Path) -> Run:
    """Read a dump folder, a loss.jsonl or a TorchTitan log (colour codes allowed).

    Raises FileNotFoundError without the file, and ValueError, naming the file and
    the line, for a loss.jsonl line that is not a loss record (e.g. the last one of
    a run killed while writing it)."""
    path = Path(path)
    if path.is_dir():
        path = path / LOSS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file; pass a dump folder with {LOSS_FILE}, a {LOSS_FILE} or a log")
    text = path.read_text(encoding="utf-8", errors="replace")
    exact = text.lstrip()[:1] == "{"
    if exact:
        records = _jsonl_losses(path, text)
    else:
        records = [(int(m.group(1)), float(m.group(2))) for m in _LOG_LINE.finditer(_ANSI.sub("", text))]
    losses, repeated = {}, set()
    for step, loss in records:
        if step in losses:
            repeated.add(step)
        losses[step] = loss
    return Run(losses, exact=exact, source=path, repeated=sorted(repeated))


def _steps_text(steps: list[int]) -> str:
    """``3-5, 9``: ascending steps as ranges."""
    ranges, start = [], None
    for i, step in enumerate(steps):
        start = step if start is None else start
        if i + 1 == len(steps) or steps[i + 1] != step + 1:
            ranges.append(f"{start}" if start == step else f"{start}-{step}")
            start = None
    return ", ".join(ranges)


def repeated_steps_note(run: Run) -> str:
    """What ``compare`` makes of a run that logs some steps more than once ("" if none)."""
    if not run.repeated:
        return ""
    why = ("a run resumed into the same folder, written before titan_uniep kept one record per step"
           if run.exact else "the log of a run and of its resume, one after the other")
    return (f"note: {run.source} has more than one record of step{'s' if len(run.repeated) > 1 else ''} "
            f"{_steps_text(run.repeated)} ({why}); comparing the last record of each, the resumed run's")


def _same(a: float, b: float) -> bool:
    # A NaN loss means the run diverged; two diverged runs do not agree.
    return a == b


def _abs(a: float, b: float) -> float:
    return 0.0 if _same(a, b) else abs(b - a)  # NaN if either is NaN


def _rel(a: float, b: float) -> float:
    if _same(a, b):
        return 0.0
    if math.isnan(a) or math.isnan(b):
        return math.nan
    return abs(b - a) / abs(a) if a != 0 else math.inf


def _signed_rel(a: float, b: float) -> float:
    return 0.0 if _same(a, b) else (b - a) / abs(a) if a != 0 else math.copysign(math.inf, b - a)


def _max(values) -> float:
    values = list(values)
    return math.nan if any(math.isnan(v) for v in values) else max(values, default=0.0)


def compare(a: Run, b: Run) -> Comparison:
    steps = sorted(a.losses.keys() & b.losses.keys())
    exact = a.exact and b.exact
    pairs = [(a.losses[s], b.losses[s]) for s in steps]
    if not exact:  # a log has 5 decimals: compare what both actually say
        pairs = [(round(x, 5), round(y, 5)) for x, y in pairs]
    rel = [_rel(x, y) for x, y in pairs]
    return Comparison(
        steps=steps,
        only_a=sorted(a.losses.keys() - b.losses.keys()),
        only_b=sorted(b.losses.keys() - a.losses.keys()),
        max_abs=_max(_abs(x, y) for x, y in pairs),
        max_rel=_max(rel),
        mean_rel=math.fsum(rel) / len(rel) if rel else 0.0,
        mean_signed_rel=math.fsum(_signed_rel(x, y) for x, y in pairs) / len(pairs) if pairs else 0.0,
        below=sum(y < x for x, y in pairs),
        nan_steps=[s for s, (x, y) in zip(steps, pairs) if math.isnan(x) or math.isnan(y)],
        bitwise=all(_same(x, y) for x, y in pairs),
        exact=exact,
    )


def window_max_rel(a: Run, b: Run, steps: list[int], window: int) -> float:
    """Largest relative difference of the runs' means over consecutive blocks of ``window``
    common steps (the last block may be shorter): the drift between the curves with the
    step-to-step noise of each averaged out."""
    if window < 1:
        raise ValueError(f"window must be at least 1, got {window}")
    worst = 0.0
    for start in range(0, len(steps), window):
        block = steps[start:start + window]
        mean_a = math.fsum(a.losses[s] for s in block) / len(block)
        mean_b = math.fsum(b.losses[s] for s in block) / len(block)
        rel = _rel(mean_a, mean_b)
        if math.isnan(rel):
            return math.nan
        worst = max(worst, rel)
    return worst


def within(a: Run, b: Run, steps: list[int], rtol: float, atol: float) -> bool:
    """``|b - a| <= atol + rtol * |a|`` on every step (a NaN is never within)."""
    return all(
        _same(a.losses[s], b.losses[s]) or abs(b.losses[s] - a.losses[s]) <= atol + rtol * abs(a.losses[s])
        for s in steps
    )


def format_table(a: Run, b: Run, steps: list[int], labels: tuple[str, str]) -> str:
    digits = ".9g" if a.exact and b.exact else ".5f"  # 9 significant digits round-trip a float32
    rows = [f"{'step':>6}  {labels[0]:>14}  {labels[1]:>14}  {'abs diff':>10}  {'rel diff':>10}"]
    for s in steps:
        x, y = a.losses[s], b.losses[s]
        diff = _abs(x, y)
        rows.append(f"{s:>6}  {x:>14{digits}}  {y:>14{digits}}  {diff:>10.3e}  {_rel(x, y):>10.3e}")
    return "\n".join(rows)


def plot(a: Run, b: Run, steps: list[int], labels: tuple[str, str], out: Path, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only; no display on training machines
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(8, 6), height_ratios=(2, 1))
    for run, label, style in ((a, labels[0], "-"), (b, labels[1], "--")):
        xs = sorted(run.losses)
        top.plot(xs, [run.losses[s] for s in xs], style, label=label)
    top.set_ylabel("loss")
    top.legend()
    top.grid(alpha=0.3)
    if title:
        top.set_title(title, fontsize=10)
    bottom.plot(steps, [b.losses[s] - a.losses[s] for s in steps], color="tab:red")
    bottom.axhline(0.0, color="black", linewidth=0.5)
    bottom.set_xlabel("step")
    bottom.set_ylabel(f"{labels[1]} - {labels[0]}")
    bottom.grid(alpha=0.3)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)


def _label(path: str) -> str:
    """A run's name: its dump folder's (also for its loss.jsonl), else the log file's stem."""
    path = Path(path)
    if path.is_dir() or path.name == LOSS_FILE:
        return (path if path.is_dir() else path.parent).resolve().name or "run"
    return path.stem


def default_plot_path(run_b: str, labels: tuple[str, str]) -> Path:
    """``loss_<A>_vs_<B>.png`` in RUN_B's dump folder (next to it if it is a file):
    named after both runs, so comparing RUN_B with another run writes another file."""
    name = "loss_{}_vs_{}.png".format(*(re.sub(r"[^\w.-]+", "_", label) for label in labels))
    path = Path(run_b)
    return path / name if path.is_dir() else path.with_name(name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python3 -m titan_uniep.tools.compare_loss", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("run_a", help="reference run: dump folder, loss.jsonl or TorchTitan log")
    parser.add_argument("run_b", help="run to check against it, same forms")
    parser.add_argument("--assert-bitwise", action="store_true", help="exit 1 unless every common step has the same float")
    parser.add_argument("--rtol", type=float, help="exit 1 unless |b - a| <= atol + rtol * |a| on every step")
    parser.add_argument("--atol", type=float, help="absolute part of that bound (default 0)")
    parser.add_argument("--plot", "--out", dest="plot", type=Path,
                        help="PNG to write (default: loss_<A>_vs_<B>.png in RUN_B's folder)")
    parser.add_argument("--labels", nargs=2, metavar=("A", "B"), help="names for the two runs (default: their folders)")
    parser.add_argument("--max-step", type=int, help="compare steps up to this one only")
    parser.add_argument("--window", type=int, metavar="N",
                        help="also print the largest relative difference of the runs' N-step means")
    args = parser.parse_args(argv)
    if args.window is not None and args.window < 1:
        parser.error(f"--window must be at least 1, got {args.window}")

    try:
        a, b = load_run(args.run_a), load_run(args.run_b)
    except (OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for run in (a, b):
        if run.repeated:
            print(repeated_steps_note(run), file=sys.stderr)
    if args.max_step is not None:
        for run in (a, b):
            run.losses = {step: loss for step, loss in run.losses.items() if step <= args.max_step}
    labels = tuple(args.labels) if args.labels else (_label(args.run_a), _label(args.run_b))
    result = compare(a, b)
    if not result.steps:
        print(f"error: no common steps ({a.source}: {len(a.losses)} losses, {b.source}: {len(b.losses)})", file=sys.stderr)
        return 2

    print(format_table(a, b, result.steps, labels))
    spread = (f"max abs diff {result.max_abs:.3e}, max rel diff {result.max_rel:.3e}, "
              f"mean rel diff {result.mean_rel:.3e}")
    print(f"{spread} over {len(result.steps)} steps")
    print(f"{labels[1]} below {labels[0]} at {result.below} of {len(result.steps)} steps "
          f"({100 * result.below / len(result.steps):.0f}%), mean signed rel diff {result.mean_signed_rel:.3e}")
    if args.window is not None:
        print(f"max rel diff of {args.window}-step means {window_max_rel(a, b, result.steps, args.window):.3e}")
    if result.nan_steps:
        print(f"NaN loss at steps {result.nan_steps}: a NaN equals nothing, not even another NaN")

    status, verdicts = 0, []
    if result.only_a or result.only_b:
        print(f"error: different steps: only in {labels[0]}: {result.only_a}, only in {labels[1]}: {result.only_b}; "
              "no verdict (--max-step N compares steps 1..N of both)", file=sys.stderr)
        status, verdicts = 2, ["no verdict: different steps"]
    else:
        if result.exact:
            verdicts.append("bitwise equal" if result.bitwise else "NOT bitwise equal")
            print(f"verdict: {verdicts[-1]}")
        else:
            verdicts.append(f"{'equal' if result.bitwise else 'NOT equal'} to 5 decimals")
            print(f"verdict: {verdicts[-1]} (a log carries 5 decimals: bitwise equality needs loss.jsonl from both runs)")
        if args.assert_bitwise:
            if not result.exact:
                print("error: --assert-bitwise needs exact losses; pass dump folders (loss.jsonl), not logs",
                      file=sys.stderr)
                status = 2
            elif not result.bitwise:
                status = 1
        if status != 2 and (args.rtol is not None or args.atol is not None):
            rtol, atol = args.rtol or 0.0, args.atol or 0.0
            ok = within(a, b, result.steps, rtol, atol)
            verdicts.append(f"rtol={rtol:g} atol={atol:g}: {'within' if ok else 'EXCEEDED'}")
            print(f"tolerance {verdicts[-1]}")
            if not ok:
                status = max(status, 1)

    out = args.plot or default_plot_path(args.run_b, labels)
    title = f"{labels[0]} vs {labels[1]}: {'; '.join(verdicts)}\n{spread} over {len(result.steps)} steps"
    plot(a, b, result.steps, labels, out, title)
    print(f"plot: {out}")
    return status


if __name__ == "__main__":
    sys.exit(main())
