"""Imports that only the registry commands need.

A GPU host may have no package index: checkpoint and restore must work there
without these packages, so they are imported on first use and their absence
is one clear line.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from gpusnap.errors import GpusnapError


def need(module: str, package: str | None = None) -> ModuleType:
    try:
        return importlib.import_module(module)
    except ImportError:
        pkg = package or module
        raise GpusnapError(f"registry transfers need the Python package {pkg!r}, which is "
                           "not installed here",
                           f"/opt/gpusnap/venv/bin/pip install {pkg} (or `make install`); "
                           "without it, move the archive and use `gpusnap restore FILE`") from None
