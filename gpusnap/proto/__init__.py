"""containerd's runtime v2 wire types for the shim, compiled on first use.

`load()` returns the generated modules (building them into the cache the first
time, see build.py). PyPI's `containerd` package (1.5.3) is unfit: it has containerd's client services but not the runtime v2 task
service a shim serves, and its protobuf-3 generated code fails to import with
protobuf >= 4.
"""

from __future__ import annotations

import functools
import importlib
import sys
from types import SimpleNamespace


@functools.cache
def load() -> SimpleNamespace:
    """The generated modules, one attribute per name in build.PROTOS (shim side and client side)."""
    from gpusnap.proto import build  # start-up: proto.wire (CRIU images, `SHIM delete`) needs no build

    path = str(build.build())
    if path not in sys.path:
        sys.path.append(path)
    return SimpleNamespace(
        **{name: importlib.import_module(f"{build.PACKAGE}.{name}_pb2") for name in build.PROTOS})
