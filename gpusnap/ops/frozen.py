"""Containers `gpusnap freeze` left off their GPUs on purpose, until `gpusnap thaw`.

A freeze's processes are CHECKPOINTED in the driver, as a checkpoint that
never finished leaves them: without this record, `gpusnap doctor --fix` and a
failed checkpoint's clean-up took them for such and restored them onto a GPU
whose memory the freeze had freed for other work (driver 580 refuses such a
process for good once it refused it for memory). Each record names the
container's init pid and its processes with their start times, so a record
outliving its processes (a reboot, pids reused) names nothing.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

from gpusnap import journal
from gpusnap.errors import GpusnapError
from gpusnap.private import write_private
from gpusnap.procs import start_time


def _folder() -> Path:
    return journal.state_subdir("frozen")


def mark(init_pid: int, name: str, pids: list[int], needs: dict[str, int] | None = None) -> None:
    """``needs``: GPU UUID -> bytes its processes held, what a thaw must find free."""
    write_private(_folder() / f"{init_pid}.json",
                  json.dumps({"container": name, "init_pid": init_pid,
                              "pids": {str(p): start_time(p) for p in pids},
                              "needs": needs or {}}))


def needs(init_pid: int) -> dict[str, int]:
    """GPU UUID -> bytes the freeze of the container with ``init_pid`` released;
    empty where unknown (no record, or one written before it was recorded)."""
    try:
        data = json.loads((_folder() / f"{init_pid}.json").read_text())
        return {str(u): int(n) for u, n in (data.get("needs") or {}).items()}
    except (OSError, ValueError, TypeError, AttributeError):
        return {}


def unmark(init_pid: int) -> None:
    (_folder() / f"{init_pid}.json").unlink(missing_ok=True)


def frozen() -> dict[int, str]:
    """pid -> the container `gpusnap freeze` left it off its GPU in, where that
    process still runs (the same start time)."""
    found: dict[int, str] = {}
    for record in sorted(_folder().glob("*.json")):
        try:
            data = json.loads(record.read_text())
            pids = {int(p): t for p, t in data["pids"].items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue
        for pid, born in pids.items():
            if born is not None and start_time(pid) == born:
                found[pid] = str(data.get("container") or "?")
    return found


def refuse(name: str, procs: Sequence, verb: str) -> None:
    """One line where a container's CUDA processes (``procs``, with pids) are
    frozen: what it cannot ``verb`` until `gpusnap thaw`, nothing changed."""
    on_purpose = frozen() if procs else {}  # a CPU container: nothing to read
    if on_purpose and set(on_purpose) & {p.pid for p in procs}:
        raise GpusnapError(f"{name} is frozen (`gpusnap freeze`), so it cannot {verb}",
                           f"`gpusnap thaw {name}` first; nothing was changed")
