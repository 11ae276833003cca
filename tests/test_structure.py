"""The package's shape: no module imports itself back through another, the
tools sit on top (nothing else imports them), and the reference schedule runs
without loading UniEP's kernels."""

import ast
import os
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "titan_uniep"


def _import_graph(unresolved: list[str] | None = None) -> dict[str, set[str]]:
    """Module -> the package's modules it imports; ``unresolved`` collects
    ``module: target`` for each import of a ``titan_uniep`` module that does not exist."""
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        modules[name.removesuffix(".__init__")] = path
    graph = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                targets = [target] + [f"{target}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                continue
            graph[name].update(t for t in targets if t in modules and t != name)
            if unresolved is not None and targets[0].startswith("titan_uniep") and targets[0] not in modules:
                unresolved.append(f"{name}: {targets[0]}")
    return graph


def test_every_import_of_the_package_names_a_module_that_exists():
    # A module moved without its importers (absolute or relative) fails only when that line runs.
    unresolved = []
    _import_graph(unresolved)
    assert not unresolved, f"imports of modules that do not exist: {unresolved}"


def test_no_circular_imports():
    graph = _import_graph()
    assert "titan_uniep.op" in graph and graph["titan_uniep.schedules.kernel"], "the graph missed the package"
    state, path, cycles = {}, [], []

    def visit(module):
        state[module] = "open"
        path.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == "open":
                cycles.append(path[path.index(target):] + [target])
            elif target not in state:
                visit(target)
        path.pop()
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module)
    assert not cycles, f"import cycles: {cycles}"


def test_the_tools_sit_on_top_no_other_module_imports_them():
    # Imports inside functions count too: the search behind [uniep] tuning = "search" once lived in
    # tools/tune.py, and tuning.selection imported it from there at start-up.
    graph = _import_graph()
    assert "titan_uniep.tools.tune" in graph and "titan_uniep.tuning.search" in graph, "the graph missed the package"
    upward = sorted(f"{module} -> {target}" for module, targets in graph.items()
                    if not module.startswith("titan_uniep.tools") for target in targets
                    if target.startswith("titan_uniep.tools"))
    assert not upward, f"modules below the tools import them: {upward}"


def test_the_shared_start_up_checks_import_no_edge_and_no_hook():
    # Each edge's checks are reached through its own preflight module, by name: the 0.2.2 job
    # checks once came from titan_uniep.parallelize, whose validate is another function on 0.3.0.
    graph = _import_graph()
    shared = graph["titan_uniep.torchtitan.preflight"]
    assert not {t for t in shared if t.startswith(("titan_uniep.torchtitan.v0_", "titan_uniep.parallelize"))}, shared
    assert {"titan_uniep.torchtitan.v0_2.preflight", "titan_uniep.torchtitan.v0_3.preflight"} <= set(graph)


REFERENCE_RUN = """
import os, sys
import torch
import torch.distributed as dist
dist.init_process_group("gloo", init_method=f"file://{sys.argv[1]}", rank=0, world_size=1)
from titan_uniep.schedules import Routing, get_schedule
torch.manual_seed(0)
x = torch.randn(6, 8)
scores, ids = torch.rand(6, 4).softmax(-1).topk(2, dim=-1)
w1, w3, w2 = torch.randn(4, 12, 8), torch.randn(4, 12, 8), torch.randn(4, 8, 12)
out = get_schedule("reference")(x, Routing(scores, ids), w1, w2, w3, group=dist.group.WORLD, score_before_experts=False)
assert out.shape == (6, 8) and torch.isfinite(out).all()
loaded = sorted(m for m in sys.modules if m.startswith(("titan_uniep.kernels", "titan_uniep.runtime", "titan_uniep.op")))
print("LOADED", loaded, "TRITON_INTERPRET", os.environ.get("TRITON_INTERPRET"))
dist.destroy_process_group()
"""


def test_reference_schedule_loads_no_kernels(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(PACKAGE.parent), env.get("PYTHONPATH", "")])
    # A file store, not a port: parallel test workers and other jobs on the machine cannot collide.
    proc = subprocess.run([sys.executable, "-c", REFERENCE_RUN, str(tmp_path / "store")], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "LOADED [] TRITON_INTERPRET None" in proc.stdout, proc.stdout[-2000:]


CORE_IMPORT = """
import sys
import titan_uniep, titan_uniep.config, titan_uniep.torchtitan, titan_uniep.layout, titan_uniep.schedules
print("LOADED", sorted({m.split(".")[0] for m in sys.modules} & {"torchtitan", "triton"}))
"""


def test_the_core_imports_no_torchtitan():
    # The core is usable without TorchTitan; run_train.sh's preflight imports titan_uniep.torchtitan too.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(PACKAGE.parent), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", CORE_IMPORT], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "LOADED []" in proc.stdout, proc.stdout


def test_an_unsupported_torchtitan_is_named_with_the_supported_ones():
    import pytest

    from titan_uniep.torchtitan import EDGES, edge_module

    assert edge_module("0.2.2+cpu") == EDGES["0.2.2"] == "titan_uniep.torchtitan.v0_2"
    assert edge_module("0.3.0") == "titan_uniep.torchtitan.v0_3"
    with pytest.raises(RuntimeError, match=r"TorchTitan 0\.4\.0 is installed, but UniEP supports torchtitan==0\.2\.2 "
                                           r"or torchtitan==0\.3\.0\. Install a supported release"):
        edge_module("0.4.0")
