"""Which TorchTitan release this environment has, and skips for the tests written
against one release (the TorchTitan edges); the core's tests run on every stack.

(The branch issue-30-edges has the same in tests/torchtitan_release.py; this module
lets the TorchTitan 0.2.2 edge's tests skip on the 0.3.0 stack before that lands.)

Each stack is its own environment (README, "Install"): ``pip install -e
".[torchtitan-0-2,test]"`` or ``".[torchtitan-0-3,test]"``. A test of one edge
skips, naming the release it needs, the one installed and the install command,
where another release is installed (or none):

    from stacks import requires_torchtitan, skip_module_unless_torchtitan

    # A module that imports that release's API (or the edge built on it) at the top:
    # first, before those imports, so the module is reported as skipped instead of
    # failing to import.
    skip_module_unless_torchtitan("0.2")

    # A module whose imports work on every stack: all its tests, or one of them.
    pytestmark = requires_torchtitan("0.3")

    @requires_torchtitan("0.2")
    def test_toml_config(): ...
"""

from __future__ import annotations

import importlib.metadata

import pytest

#: How every skip reason of these helpers starts.
SKIP_PREFIX = "needs TorchTitan "

#: The extra of pyproject.toml that installs each release series.
EXTRAS = {"0.2": "torchtitan-0-2", "0.3": "torchtitan-0-3"}


def torchtitan_version() -> str | None:
    """The installed TorchTitan's version ("0.2.2", "0.3.0"), None without one."""
    try:
        return importlib.metadata.version("torchtitan")
    except importlib.metadata.PackageNotFoundError:
        return None


def has_torchtitan(series: str) -> bool:
    """Whether the installed TorchTitan belongs to ``series`` ("0.2", "0.3")."""
    if series not in EXTRAS:
        raise ValueError(f"unknown TorchTitan series {series!r}; one of {sorted(EXTRAS)}")
    version = torchtitan_version()
    return version is not None and version.split(".")[:2] == series.split(".")


def skip_reason(series: str) -> str:
    installed = torchtitan_version()
    return (f"{SKIP_PREFIX}{series} (installed: {'TorchTitan ' + installed if installed else 'none'}); "
            f"that stack installs with pip install -e \".[{EXTRAS[series]},test]\"")


def requires_torchtitan(series: str) -> pytest.MarkDecorator:
    """A skip mark for a test, a class or a whole module (``pytestmark``)."""
    return pytest.mark.skipif(not has_torchtitan(series), reason=skip_reason(series))


def skip_module_unless_torchtitan(series: str) -> None:
    """Skip the calling test module (call it at the top, before the imports that need
    ``series``) unless that TorchTitan release is installed."""
    if not has_torchtitan(series):
        pytest.skip(skip_reason(series), allow_module_level=True)
