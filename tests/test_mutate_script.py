"""scripts/mutate.py stays replayable: every mutant still applies to the tree as
it is, and its targets still exist, so that the list cannot go stale unseen.
The mutants themselves are not run here (a minute each at most, several in
all): ``python3 scripts/mutate.py`` runs them."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "mutate.py"


def load_script():
    spec = importlib.util.spec_from_file_location("mutate_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (dataclasses look their module up while the file runs)
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    return module


def load_mutants():
    return load_script().MUTANTS


def test_every_mutant_text_occurs_once_in_its_file_and_changes_it():
    problems = []
    for mutant in load_mutants():
        path = REPO / mutant.path
        count = path.read_text().count(mutant.old) if path.is_file() else 0
        if count != 1:
            problems.append(f"{mutant.name}: its old text occurs {count} times in {mutant.path}")
        if mutant.old == mutant.new:
            problems.append(f"{mutant.name}: old and new are the same text")
    assert not problems, problems


def test_every_mutant_names_existing_tests_and_a_device():
    """A renamed test would make pytest find nothing to run: the replay reports an error, not a kill."""
    mutants = load_mutants()
    names = [m.name for m in mutants]
    assert len(set(names)) == len(names), names
    for mutant in mutants:
        assert mutant.device in ("cpu", "gpu") and mutant.limit_s > 0 and mutant.targets, mutant.name
        for target in mutant.targets:
            path, _, test = target.partition("::")
            assert (REPO / path).is_file(), f"{mutant.name}: {path} does not exist"
            if test:
                assert f"def {test.split('[')[0]}(" in (REPO / path).read_text(), f"{mutant.name}: no {target}"


def test_list_names_every_mutant():
    out = subprocess.run([sys.executable, str(SCRIPT), "--list"], capture_output=True, text=True, check=True).stdout
    listed = [line.split()[0] for line in out.splitlines() if not line.startswith(" ")]
    assert listed == [m.name for m in load_mutants()], out


@pytest.mark.parametrize("status,lines,verdict", [
    (1, ["FAILED tests/x.py::t - assert"], "killed"),
    (-6, ["FAILED tests/x.py::t - CUDA error: an illegal instruction", "terminate called"], "killed"),
    (0, ["1 passed"], "survived"),
    (4, ["ERROR: file or directory not found"], "error"),
    (None, [], "killed"),  # a hang, for a mutant whose timeout kills
])
def test_verdicts_follow_pytests_exit(monkeypatch, status, lines, verdict):
    script = load_script()
    mutant = next(m for m in script.MUTANTS if m.timeout_kills)
    monkeypatch.setattr(script, "pytest_in_copy", lambda *args: (status, 1.0, lines))
    got, _, detail = script.judge(mutant)
    assert got == verdict
    if status == -6:
        assert detail.startswith("pytest died of SIGABRT after FAILED")
