"""Compile the shim's .proto files (src/gpusnap_pb/) into Python modules.

Generated code is tied to the protobuf runtime it was made for, so it is not
kept in the source tree: it goes into a cache directory keyed by the .proto
sources and the protobuf runtime's version, built on first import
(`gpusnap.proto.load`) or ahead of time with `python -m gpusnap.proto.build`.
Only message modules are generated (--python_out): the gRPC service tables
are built from the descriptors (`gpusnap.proto.rpc`), which avoids the
version pin that grpcio-tools writes into *_pb2_grpc.py files.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
import tempfile
from pathlib import Path

import google.protobuf

SRC = Path(__file__).resolve().parent / "src"
PACKAGE = "gpusnap_pb"
PROTOS = ("mount", "task_types", "shim", "task_events", "events_service", "runc_options", "runtimeoptions",
          "ttrpc",
          # the metrics a shim's Stats answers (ctr task metrics, nerdctl stats, CRI): gpusnap.shim.stats
          "cgroups_v1", "cgroups_v2",
          # containerd's client API (checkpoint clients: tests, gpusnap.ops.containerd_api)
          "descriptor", "containers", "tasks", "content", "images", "leases", "snapshots", "diff",
          # Kubernetes' CRI (runtime.v1), the kubelet's calls: gpusnap.runtime.cri
          "cri")


class ProtoBuildError(RuntimeError):
    """The protos could not be compiled (grpcio-tools missing or protoc failed)."""


def _runtime_version() -> str:
    # Generated code must not be newer than the runtime that loads it; keying
    # on the runtime rebuilds after a protobuf upgrade or downgrade.
    return google.protobuf.__version__


def cache_key() -> str:
    h = hashlib.sha256(_runtime_version().encode())
    for name in PROTOS:
        h.update((SRC / PACKAGE / f"{name}.proto").read_bytes())
    return h.hexdigest()[:20]


def cache_root() -> Path:
    env = os.environ.get("GPUSNAP_PROTO_CACHE")
    if env:
        return Path(env)
    if os.geteuid() == 0:
        return Path("/var/cache/gpusnap/proto")
    base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return Path(base) / "gpusnap" / "proto"


def built_dir() -> Path:
    """Directory that holds (or will hold) the gpusnap_pb package for this build."""
    return cache_root() / cache_key()


def build(out: Path | None = None) -> Path:
    """Generate the modules into OUT (default: the cache) and return it.

    Written to a temporary sibling and renamed, so concurrent first imports
    (two shims starting at once) never see a half-written package.
    """
    out = out or built_dir()
    if (out / PACKAGE / "__init__.py").exists():
        return out
    try:  # optional: grpcio-tools, only a first build needs it
        from grpc_tools import protoc
    except ImportError as e:
        raise ProtoBuildError(
            "grpcio-tools is not installed: pip install grpcio-tools, "
            "or build elsewhere with `python -m gpusnap.proto.build` and set GPUSNAP_PROTO_CACHE"
        ) from e
    import importlib.resources  # start-up: only a first build (the shim loads this module)

    well_known = str(importlib.resources.files("grpc_tools") / "_proto")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=out.parent))
    try:
        args = ["protoc", f"-I{SRC}", f"-I{well_known}", f"--python_out={tmp}"]
        args += [f"{PACKAGE}/{name}.proto" for name in PROTOS]
        if protoc.main(args) != 0:
            raise ProtoBuildError(f"protoc failed on {SRC / PACKAGE}")
        (tmp / PACKAGE / "__init__.py").write_text("")
        try:
            os.rename(tmp, out)
        except OSError:
            if not (out / PACKAGE / "__init__.py").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gpusnap.proto.build", description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="target directory (default: the cache for this protobuf)")
    a = ap.parse_args(argv)
    try:
        print(build(a.out))
    except ProtoBuildError as e:
        print(f"gpusnap.proto.build: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
