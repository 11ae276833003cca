"""The README keeps its promises about the repository: every train config pair is in its
table, and its commands call python3 (a machine may have no ``python``)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()


def test_config_table_lists_every_pair_in_train_configs():
    rows = [line for line in README.splitlines() if line.startswith("| ") and ".toml` |" in line]
    pairs = {tuple(re.findall(r"`([\w.]+\.toml)`", row)) for row in rows}
    for config in sorted((REPO / "train_configs").glob("*_baseline.toml")):
        uniep = config.name.replace("_baseline.toml", "_uniep.toml")
        assert (REPO / "train_configs" / uniep).is_file(), f"{config.name} has no UniEP twin"
        assert (config.name, uniep) in pairs, f"README's config table lacks the {config.name} / {uniep} row"
    assert not [c for c in (REPO / "train_configs").glob("*.toml")
                if not c.name.endswith(("_baseline.toml", "_uniep.toml"))], "a config outside a pair"


def test_readme_commands_call_python3():
    stale = [line for line in README.splitlines() if re.search(r"(^|[`\s])python (-m|scripts/|-c)", line)]
    assert not stale, stale


def _named_modules(text: str) -> set[str]:
    return set(re.findall(r"-m (titan_uniep(?:\.\w+)+)", text))


def test_every_module_a_command_runs_exists():
    # After a move, a README, docs or script command that names the old module fails for its reader.
    sources = [REPO / "README.md", *(REPO / "docs").glob("*.md"), *(REPO / "scripts").glob("*"),
               *(REPO / "train_configs").rglob("*.toml"), REPO / "run_train.sh"]
    missing = {}
    for source in sources:
        for module in _named_modules(source.read_text()):
            path = REPO.joinpath(*module.split("."))
            if not (path.with_suffix(".py").is_file() or (path / "__main__.py").is_file()):
                missing.setdefault(module, []).append(str(source.relative_to(REPO)))
    assert _named_modules(README), "the README names no module to run"
    assert not missing, f"commands run modules that do not exist: {missing}"
