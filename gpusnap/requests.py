"""Options the CLI hands to the CRIU action script of one checkpoint.

Podman runs runc with a scrubbed environment, so `gpusnap checkpoint` writes
its options to /run/gpusnap/requests/<init pid>.json; the action script
takes (reads and removes) that file.
"""

from __future__ import annotations

import json

from gpusnap.journal import state_subdir
from gpusnap.private import write_private


# The kind of request gpusnap's containerd client leaves when it quiesced the
# task's GPU before pausing it (ops/containerd_gpu.py): {"manifest": {...},
# "pids": [...]}. The shim then keeps the task paused for the dump, and
# pre-dump writes that manifest and quiesces nothing.
QUIESCED = "quiesced"


def _path(init_pid: int, kind: str = ""):
    """``kind``: a request for another step than pre-dump ("pages": post-dump's)."""
    return state_subdir("requests") / f"{init_pid}{'.' + kind if kind else ''}.json"


def put(init_pid: int, kind: str = "", **options) -> None:
    write_private(_path(init_pid, kind), json.dumps(options))


def take(init_pid: int, kind: str = "") -> dict:
    path = _path(init_pid, kind)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    path.unlink(missing_ok=True)
    return data if isinstance(data, dict) else {}


def peek(init_pid: int, kind: str = "") -> dict:
    """A request as ``take`` reads it, left for a later step to take."""
    try:
        data = json.loads(_path(init_pid, kind).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def drop(init_pid: int, kind: str = "") -> None:
    _path(init_pid, kind).unlink(missing_ok=True)
