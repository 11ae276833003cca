"""Which TorchTitan release the tests run against: one test command on either stack.

A test module of one release's edge starts with ``requires_torchtitan("0.2.2")``
(before it imports TorchTitan): on another release, or without TorchTitan, the
whole module is skipped, with the reason in pytest's summary. A single test
takes the ``torchtitan_0_2`` mark instead.
"""

from __future__ import annotations

import pytest

from titan_uniep.torchtitan import installed_version

__all__ = ["INSTALLED", "requires_torchtitan", "torchtitan_0_2"]

INSTALLED = (installed_version() or "").split("+", 1)[0] or None
"""The installed TorchTitan release (``"0.2.2"``), None without TorchTitan."""


def _reason(release: str) -> str:
    return f"needs TorchTitan {release}; {'TorchTitan ' + INSTALLED if INSTALLED else 'no TorchTitan'} is installed"


def requires_torchtitan(release: str) -> None:
    """Skip the calling test module unless TorchTitan ``release`` is installed."""
    if INSTALLED != release:
        pytest.skip(_reason(release), allow_module_level=True)


torchtitan_0_2 = pytest.mark.skipif(INSTALLED != "0.2.2", reason=_reason("0.2.2"))
"""Mark for a single test of the TorchTitan 0.2.2 edge in a module that runs on every release."""
