"""Options the CLI hands to the CRIU action script of one checkpoint.

Podman runs runc with a scrubbed environment, so `gpusnap checkpoint` writes
its options to /run/gpusnap/requests/<init pid>.json; the action script
takes (reads and removes) that file.
"""

from __future__ import annotations

import json

from gpusnap.journal import state_subdir
from gpusnap.private import write_private
from gpusnap.procs import start_time


# Bound requests (put_bound) about one containerd task, by its init's pid:
# QUIESCED: gpusnap's containerd client quiesced the task's GPU before pausing
# it (ops/containerd_gpu.py): {"manifest": {...}, "pids": [...]}. The shim then
# keeps the task paused for the dump; pre-dump takes it, writes that manifest
# and quiesces nothing.
QUIESCED = "quiesced"
# HELD: the shim thawed a task the client had paused, for the driver's lock,
# and pauses it again after the dump for the client, which resumes it (the rw
# diff may come after the dump). The guardian gives the GPUs back only once
# the shim's Resume has dropped it.
HELD = "held"


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


def put_bound(init_pid: int, kind: str, **data) -> None:
    """A request bound to the process that has ``init_pid`` now (its start time)."""
    put(init_pid, kind, started=start_time(init_pid), **data)


def bound(init_pid: int, kind: str, consume: bool = False) -> dict:
    """A put_bound request of this very process: one left for an earlier
    process under the same pid (its writer killed before it could drop it) is
    dropped, not obeyed. ``consume``: taken (the writer may check it was)."""
    found = take(init_pid, kind) if consume else peek(init_pid, kind)
    if found and found.get("started") != start_time(init_pid):
        drop(init_pid, kind)
        return {}
    return found


def held(init_pid: int) -> bool:
    """A HELD request of this very task whose holder (the shim that wrote it)
    still runs: one whose shim died before its Resume is dropped, not waited on."""
    found = bound(init_pid, HELD)
    if not found:
        return False
    holder = found.get("holder")
    if holder is not None and start_time(int(holder)) != found.get("holder_started"):
        drop(init_pid, HELD)
        return False
    return True
