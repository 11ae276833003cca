"""Every tool that takes a layer shape takes it the same way: ``--shape``, repeatable, a
name of titan_uniep.shapes or ``T,D,H,E,K``, parsed by ``shapes.parse_shape``. Only the
command lines are parsed here; the tools themselves need GPUs."""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path

import pytest

from titan_uniep.shapes import SHAPES

REPO = Path(__file__).resolve().parents[1]


def _script(name: str):
    spec = importlib.util.spec_from_file_location(f"script_{name}", REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TOOLS = {
    "titan_uniep.tools.bench": lambda: importlib.import_module("titan_uniep.tools.bench").build_parser(),
    "titan_uniep.tools.bench_backward": lambda: importlib.import_module("titan_uniep.tools.bench_backward").build_parser(),
    "titan_uniep.tools.tune": lambda: importlib.import_module("titan_uniep.tools.tune").build_parser(),
    "scripts/probe.py": lambda: _script("probe").build_parser(),
    "scripts/stage_times.py": lambda: _script("stage_times").build_parser(),
    "scripts/variant_report.py": lambda: _script("variant_report").build_parser(),
}


@pytest.mark.parametrize("tool", TOOLS)
def test_every_tool_takes_names_and_dims_in_repeated_shape_options(tool):
    args = TOOLS[tool]().parse_args(["--shape", "qwen3", "--shape", "8192,2880,1440,64,4", "--shape", "odd_dim"])
    assert args.shapes == [("qwen3", SHAPES["qwen3"]), ("8192x2880x1440x64x4", (8192, 2880, 1440, 64, 4)),
                           ("odd_dim", SHAPES["odd_dim"])]


@pytest.mark.parametrize("tool", TOOLS)
def test_every_tool_refuses_a_malformed_shape_naming_both_forms(tool, capsys):
    with pytest.raises(SystemExit):
        TOOLS[tool]().parse_args(["--shape", "8192,2048"])
    error = capsys.readouterr().err
    assert "argument --shape: shape '8192,2048': expected one of qwen3, deepseek" in error, error
    assert "or T,D,H,E,K (five positive integers)" in error, error


@pytest.mark.parametrize("tool", TOOLS)
def test_no_tool_keeps_another_shape_syntax(tool):
    options = set(TOOLS[tool]()._option_string_actions)
    assert "--shape" in options
    assert not options & {"--shapes", "--tokens", "--dim", "--hidden", "--experts", "--topk"}, options


def test_a_given_shape_replaces_the_default_shapes():
    parser = TOOLS["titan_uniep.tools.bench_backward"]()
    assert [name for name, _ in parser.parse_args([]).shapes] == ["qwen3", "deepseek"]
    assert [name for name, _ in parser.parse_args(["--shape", "mixtral"]).shapes] == ["mixtral"]


def test_docs_and_scripts_use_the_one_shape_syntax():
    paths = [REPO / "README.md", *(REPO / "docs").glob("*.md"), *(REPO / "scripts").iterdir(),
             *(REPO / "titan_uniep").rglob("*.py")]
    stale = [str(p.relative_to(REPO)) for p in paths if p.is_file() and "--shapes" in p.read_text()]
    assert not stale, f"--shapes (a comma list) is gone; --shape is repeated: {stale}"
