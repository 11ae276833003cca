"""The TorchTitan stacks: pyproject.toml's extras pin one TorchTitan each with the torch
and triton that go with it, the two cannot be installed together, and the environment
the tests run in is one of them."""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]
#: The extra of pyproject.toml that installs each TorchTitan release series.
EXTRAS = {"0.2": "torchtitan-0-2", "0.3": "torchtitan-0-3"}


def _project() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def _extra(series: str) -> dict[str, SpecifierSet]:
    """The specifiers of a stack's extra, by distribution name."""
    reqs = [Requirement(spec) for spec in _project()["optional-dependencies"][EXTRAS[series]]]
    return {r.name.lower(): r.specifier for r in reqs}


def _versions(specifier: SpecifierSet, candidates: list[str]) -> set[str]:
    return {v for v in candidates if Version(v) in specifier}


TORCH_RELEASES = ["2.10.0", "2.11.0", "2.12.0", "2.13.0", "2.14.0", "2.14.1", "2.15.0"]
# Each torch release's own triton pin in its CUDA wheels for Linux (their PyPI metadata,
# read 2026-12: triton==3.6.0, ==3.7.0, ==3.7.1, ~=3.8.0).
TRITON_OF_TORCH = {"2.11.0": "3.6.0", "2.12.0": "3.7.0", "2.13.0": "3.7.1", "2.14.1": "3.8.0"}


@pytest.mark.parametrize("series, torchtitan, torch_releases", [
    ("0.2", "0.2.2", {"2.11.0", "2.12.0", "2.13.0"}),
    ("0.3", "0.3.0", {"2.14.0", "2.14.1"}),
])
def test_each_extra_pins_its_torchtitan_and_the_torch_releases_it_runs_on(series, torchtitan, torch_releases):
    extra = _extra(series)
    assert _versions(extra["torchtitan"], ["0.2.1", "0.2.2", "0.3.0", "0.3.1"]) == {torchtitan}
    base = {Requirement(s).name.lower(): Requirement(s).specifier for s in _project()["dependencies"]}
    assert "torchtitan" not in base, "TorchTitan comes with a stack's extra, not with the core"
    assert _versions(extra["torch"] & base["torch"], TORCH_RELEASES) == torch_releases


@pytest.mark.parametrize("series", sorted(EXTRAS))
def test_each_extra_admits_the_triton_every_cuda_torch_build_of_its_range_pins(series):
    """No conflicting pins: a CUDA torch build of the stack's range installs beside it."""
    extra = _extra(series)
    for torch_release, triton in TRITON_OF_TORCH.items():
        if Version(torch_release) in extra["torch"]:
            assert Version(triton) in extra["triton"], (series, torch_release, triton)


def test_the_two_stacks_cannot_share_an_environment():
    assert not _versions(_extra("0.2")["torch"] & _extra("0.3")["torch"], TORCH_RELEASES)
    assert not _versions(_extra("0.2")["triton"] & _extra("0.3")["triton"], ["3.6.0", "3.7.0", "3.7.1", "3.8.0"])


def test_the_installed_environment_is_one_stack():
    """torch, triton and TorchTitan as one extra pins them: a pip install that broke a
    pin (or an environment put together by hand) fails here, naming what is off."""
    try:
        version = importlib.metadata.version("torchtitan")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("no TorchTitan installed: the core alone (install a stack to run its edge's tests)")
    series = ".".join(version.split(".")[:2])
    assert series in EXTRAS, f"TorchTitan {version} is not a supported release ({sorted(EXTRAS)})"
    off = {}
    for name, specifier in _extra(series).items():
        installed = Version(re.sub(r"\+.*", "", importlib.metadata.version(name)))  # 2.13.0+cpu: 2.13.0
        if installed not in specifier:
            off[name] = f"{installed} not {specifier}"
    assert not off, f"TorchTitan {version}'s stack ({EXTRAS[series]}) is not what is installed: {off}"

