"""The benchmarks' ``--report DIR``: one Markdown file and one PNG per shape.

``bench --report DIR`` writes ``DIR/forward.md`` and ``DIR/forward_<shape>.png``;
``bench_backward --report DIR`` writes ``DIR/backward.md`` and
``DIR/backward_<shape>.png``. Each Markdown file has one row per shape with
the measured paths (TorchTitan's EP path, UniEP at the default point, at the
tuned point of the tuning cache, the GEMM-only and, at EP > 1, the
transfer-only bounds) and the model's prediction of the default and the tuned
point, then per shape why the tuned point applied or not and the model's
per-stage breakdown. Each PNG shows the measured and predicted times (left)
and the predicted stages of the default and the tuned point (right).

The records are the benches' JSON lines (``bench.bench_shape``,
``bench_backward.bench_shape``); a record's ``"model"`` holds
``tuning.search.predictions`` (absent: no model row). Plots need matplotlib;
without it the Markdown says so and no PNG is written.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

__all__ = ["ROWS", "write_report"]

# (label, record key) of the measured paths, per direction; the model's rows follow.
ROWS = {
    "forward": (
        ("TorchTitan EP", "titan_ep_ms"),
        ("UniEP default (fused)", "uniep_fused_ms"),
        ("UniEP default (sequential)", "uniep_sequential_ms"),
        ("UniEP tuned (fused)", "uniep_tuned_ms"),
        ("GEMM-only", "gemm_only_ms"),
        ("transfer-only", "transfer_only_ms"),
    ),
    "backward": (
        ("TorchTitan EP, fwd + bwd", "titan_ep"),
        ("UniEP default, fwd + bwd (fused)", "uniep_fused"),
        ("UniEP default, fwd + bwd (sequential)", "uniep_sequential"),
        ("UniEP tuned, fwd + bwd (fused)", "uniep_tuned"),
        ("UniEP default, bwd (fused)", "uniep_fused_bwd"),
        ("UniEP tuned, bwd (fused)", "uniep_tuned_bwd"),
        ("GEMM-only, fwd + bwd", "gemm_only"),
    ),
}


def _model_rows(record: dict, direction: str) -> list[tuple[str, float | None]]:
    """The model's predicted times of the default and the tuned point, in the
    measured rows' terms (the forward alone, or forward + backward)."""
    model = record.get("model") or {}
    rows = []
    for point in ("default", "tuned"):
        pred = model.get(point)
        if not pred:
            continue
        total = pred["forward_total"] if direction == "forward" else pred["forward_total"] + pred["backward_total"]
        rows.append((f"model: UniEP {point}{'' if direction == 'forward' else ', fwd + bwd'}", total))
        if direction == "backward":
            rows.append((f"model: UniEP {point}, bwd", pred["backward_total"]))
    return rows


def measured_rows(record: dict, direction: str) -> list[tuple[str, float | None]]:
    """``(label, ms)`` of one record: its measured paths, then the model's rows.
    Transfer-only only at EP > 1 (one rank sends nothing)."""
    rows = [(name, record.get(key)) for name, key in ROWS[direction]
            if not (key == "transfer_only_ms" and record.get("world", 1) == 1)]
    return rows + _model_rows(record, direction)


def _cell(ms) -> str:
    return "-" if ms is None or (isinstance(ms, float) and math.isnan(ms)) else f"{ms:.3f}"


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)


def write_report(directory: str | Path, records: list[dict], direction: str) -> list[Path]:
    """Write ``<direction>.md`` and one ``<direction>_<shape>.png`` per record
    into ``directory`` (created); returns the paths written."""
    if direction not in ROWS:
        raise ValueError(f"direction must be one of {sorted(ROWS)}, got {direction!r}")
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        plt = None
    written = []
    first = records[0] if records else {}
    lines = [f"# UniEP {direction} benchmark", "",
             f"{first.get('gpu', '?')}, EP {first.get('world', '?')}, {first.get('dtype', 'bf16')}, "
             f"{first.get('date', '')}. Times in ms: median of the slowest rank, paths timed in rounds of "
             "alternating order. Model: the analytic model's prediction "
             f"({(first.get('model') or {}).get('hardware', 'not available')}).", ""]
    labels = [name for name, _ in measured_rows(first, direction)] if records else []
    lines.append("| shape | T | D | H | E | K | " + " | ".join(labels) + " |")
    lines.append("|---" * (6 + len(labels)) + "|")
    for record in records:
        dims = [record.get(k, record.get(alt)) for k, alt in
                (("T", "tokens"), ("D", "dim"), ("H", "hidden"), ("E", "experts"), ("K", "top_k"))]
        cells = dict(measured_rows(record, direction))
        lines.append(f"| {record['shape']} | " + " | ".join(str(d) for d in dims) + " | "
                     + " | ".join(_cell(cells.get(name)) for name in labels) + " |")
    for record in records:
        name = record["shape"]
        lines += ["", f"## {name}", ""]
        for point_dir, info in (record.get("tuned") or {}).items():
            state = "applied" if info.get("applied") else "not applied"
            lines.append(f"- tuned {point_dir} point {state}: {info.get('reason', '')}")
        model = record.get("model") or {}
        if model.get("default"):
            stage_dirs = ("forward",) if direction == "forward" else ("forward", "backward")
            points = [p for p in ("default", "tuned") if model.get(p)]
            lines += ["", "| stage (model) | " + " | ".join(f"{p} (ms)" for p in points) + " |",
                      "|---" * (1 + len(points)) + "|"]
            for stage_dir in stage_dirs:
                for stage in model["default"][stage_dir]:
                    lines.append(f"| {stage_dir}.{stage} | "
                                 + " | ".join(_cell(model[p][stage_dir].get(stage)) for p in points) + " |")
                lines.append(f"| **{stage_dir} (schedule)** | "
                             + " | ".join(f"**{_cell(model[p][f'{stage_dir}_total'])}**" for p in points) + " |")
        for failure in record.get("check_failures", []):
            lines.append(f"- CHECK FAILED: {failure}")
        if plt is not None:
            png = out / f"{direction}_{_slug(name)}.png"
            _plot(plt, record, direction, png)
            written.append(png)
            lines += ["", f"![{name}]({png.name})"]
    if plt is None:
        lines += ["", "(No plots: matplotlib is not installed.)"]
    md = out / f"{direction}.md"
    md.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return [md, *written]


def _plot(plt, record: dict, direction: str, path: Path) -> None:
    rows = [(name, ms) for name, ms in measured_rows(record, direction) if ms is not None]
    model = record.get("model") or {}
    points = [p for p in ("default", "tuned") if model.get(p)]
    fig, axes = plt.subplots(1, 2 if points else 1, figsize=(13 if points else 7, 4.5), squeeze=False)
    ax = axes[0][0]
    names = [name for name, _ in rows][::-1]
    values = [ms for _, ms in rows][::-1]
    colors = ["#bbbbbb" if n.startswith("model") else "#4c72b0" if n.startswith("UniEP") else "#dd8452"
              for n in names]
    ax.barh(names, values, color=colors)
    for y, v in enumerate(values):
        ax.text(v, y, f" {v:.3f}", va="center", fontsize=8)
    ax.set_xlabel("ms")
    ax.set_title(f"{record['shape']}: {direction} (EP {record.get('world', '?')})")
    if points:
        ax = axes[0][1]
        stage_dirs = ("forward",) if direction == "forward" else ("forward", "backward")
        stages = [(d, s) for d in stage_dirs for s in model[points[0]][d]]
        bottoms = [0.0] * len(points)
        cmap = plt.get_cmap("tab20")
        for i, (d, s) in enumerate(stages):
            heights = [model[p][d].get(s, 0.0) for p in points]
            ax.bar(points, heights, bottom=bottoms, label=f"{d}.{s}", color=cmap(i % 20))
            bottoms = [b + h for b, h in zip(bottoms, heights)]
        ax.set_ylabel("ms (stages alone, summed)")
        ax.set_title("model: per-stage breakdown")
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
