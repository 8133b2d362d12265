"""Options the CLI hands to the CRIU action script of one checkpoint.

Podman runs runc with a scrubbed environment, so `gpusnap checkpoint` writes
its options to /run/gpusnap/requests/<init pid>.json; the action script
takes (reads and removes) that file.
"""

from __future__ import annotations

import json
import os

from gpusnap.journal import state_dir


def _path(init_pid: int):
    folder = state_dir() / "requests"
    folder.mkdir(mode=0o700, exist_ok=True)
    return folder / f"{init_pid}.json"


def put(init_pid: int, **options) -> None:
    path = _path(init_pid)
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(options, f)
    os.replace(tmp, path)


def take(init_pid: int) -> dict:
    path = _path(init_pid)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    path.unlink(missing_ok=True)
    return data if isinstance(data, dict) else {}


def drop(init_pid: int) -> None:
    _path(init_pid).unlink(missing_ok=True)
