"""What the shim keeps in containerd's bundle directory, readable without grpc.

`SHIM delete` runs after a shim died and must be quick (containerd waits on
it in every `ctr run --rm`), so it imports only this module.
"""

from __future__ import annotations

import json
import os
import shutil

from gpusnap.proto.wire import varint

SHIM_STATE = "gpusnap-shim.json"  # runc root and binary of a created container; removed by Delete


def runc_root(root_option: str, namespace: str) -> str:
    return os.path.join(root_option or "/run/containerd/runc", namespace)


def write_state(bundle: str, runc_root_dir: str, runc_binary: str) -> None:
    from gpusnap.private import write_private  # not at the top: `delete` only reads

    write_private(os.path.join(bundle, SHIM_STATE),
                  json.dumps({"runc_root": runc_root_dir, "runc": runc_binary}))


def read_state(bundle: str) -> dict | None:
    """None when no runc container was created here, or it was deleted cleanly."""
    try:
        with open(os.path.join(bundle, SHIM_STATE)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def clear_state(bundle: str) -> None:
    try:
        os.unlink(os.path.join(bundle, SHIM_STATE))
    except FileNotFoundError:
        pass


def drop_unpacked_checkpoint(checkpoint: str) -> None:
    """Remove CHECKPOINT where containerd unpacked it for this one restore: containerd
    1.7 unpacks it into a temporary ctrd-checkpoint* directory (Tasks.Create) and
    never removes it; a GPU checkpoint there holds GBs."""
    if checkpoint and os.path.basename(checkpoint.rstrip("/")).startswith("ctrd-checkpoint"):
        shutil.rmtree(checkpoint, ignore_errors=True)


def delete_response(exit_status: int, exited_at_ns: int) -> bytes:
    """containerd.task.v3.DeleteResponse{exit_status=2, exited_at=3} in protobuf wire format.

    Encoded by hand so `delete` needs no protobuf import (tests compare it with
    the generated message).
    """
    secs, nanos = divmod(exited_at_ns, 1_000_000_000)
    ts = b"\x08" + varint(secs) + (b"\x10" + varint(nanos) if nanos else b"")
    return b"\x10" + varint(exit_status) + b"\x1a" + varint(len(ts)) + ts
