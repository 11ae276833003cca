"""Everything titan_uniep and its scripts import at run time is a declared dependency
(of the package, or of a TorchTitan stack's extra), so a fresh install of a stack has
the progress bar and the plots the README shows."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]


def _top_level_imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def _declared() -> set[str]:
    """The base dependencies and those of the extras: the TorchTitan stacks (TorchTitan
    itself comes with its stack: ``pip install -e ".[torchtitan-0-2,test]"``) and the
    benches' optional peers (``peers``)."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    stacks = [spec for name, specs in project["optional-dependencies"].items()
              if name.startswith("torchtitan-") or name == "peers" for spec in specs]
    return {re.split(r"[\s<>=!~;\[]", spec, maxsplit=1)[0].lower().replace("_", "-")
            for spec in [*project["dependencies"], *stacks]}


def test_every_third_party_import_of_the_package_and_scripts_is_declared():
    sources = [*(REPO / "titan_uniep").rglob("*.py"), *(REPO / "scripts").glob("*.py")]
    # Modules of this repository: the package, the scripts' helpers from tests/ (sys.path entries).
    local = {"titan_uniep"} | {p.stem for p in (REPO / "tests").rglob("*.py")} | {p.stem for p in sources}
    distributions = importlib.metadata.packages_distributions()
    missing = {}
    for path in sources:
        for module in _top_level_imports(path) - set(sys.stdlib_module_names) - local - {"tomllib"}:
            names = {d.lower().replace("_", "-") for d in distributions.get(module, [module])}
            if not names & _declared():
                missing.setdefault(module, []).append(str(path.relative_to(REPO)))
    assert not missing, f"imported but not in pyproject.toml's dependencies: {missing}"
