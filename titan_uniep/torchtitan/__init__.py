"""UniEP's TorchTitan edges: one package per supported TorchTitan release, and what they share.

The core of titan_uniep knows nothing of TorchTitan. Each edge plugs it into one
release through that release's own seams; ``edge_module()`` names the one for the
installed TorchTitan. Shared by every edge: the bundled dataset and tokenizer
(``data``), the start-up checks (``preflight``), ``run_train.sh``'s launcher
(``torchrun``) and its training entry (``train``).

This module reads the installed version from the package metadata: it imports
neither torch nor TorchTitan (``run_train.sh`` asks it before torchrun starts).
"""

from __future__ import annotations

import importlib.metadata

__all__ = ["EDGES", "edge_module", "installed_version"]

EDGES = {
    "0.2.2": "titan_uniep.torchtitan.v0_2",
    "0.3.0": "titan_uniep.torchtitan.v0_3",
}
"""Supported TorchTitan release -> the edge package that plugs UniEP into it."""


def installed_version() -> str | None:
    """The installed TorchTitan's version (``"0.2.2"``), or None where it is not installed."""
    try:
        return importlib.metadata.version("torchtitan")
    except importlib.metadata.PackageNotFoundError:
        return None


def edge_module(version: str | None = None) -> str:
    """The edge package for TorchTitan ``version`` (default: the installed one).

    Raises:
        RuntimeError: TorchTitan is not installed, or its release has no edge;
            the message names the installed version and the supported ones.
    """
    if version is None:
        version = installed_version()
    supported = " or ".join(f"torchtitan=={v}" for v in EDGES)
    if version is None:
        raise RuntimeError(f"TorchTitan is not installed; UniEP trains on {supported}. "
                           f"Install one of them (pip install torchtitan=={list(EDGES)[-1]}).")
    # A local build tag ("0.2.2+cpu") does not change the release.
    release = version.split("+", 1)[0]
    if release not in EDGES:
        raise RuntimeError(f"TorchTitan {version} is installed, but UniEP supports {supported}. "
                           f"Install a supported release (pip install torchtitan=={list(EDGES)[-1]}).")
    return EDGES[release]
