"""An append-only record of what gpusnap did to which processes.

Hooks and CRIU action scripts have no terminal; this file is where their
story goes, and where `gpusnap doctor` looks for work left half done.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path


def state_dir() -> Path:
    """/run/gpusnap (root only); GPUSNAP_STATE_DIR moves it, e.g. for tests."""
    path = Path(os.environ.get("GPUSNAP_STATE_DIR", "/run/gpusnap"))
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    return path


def record(event: str, **fields) -> None:
    """Append one event; never fails the caller (a full /run must not stop a restore)."""
    line = json.dumps({"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "event": event, **fields},
                      sort_keys=True, default=str)
    try:
        fd = os.open(state_dir() / "journal.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        with os.fdopen(fd, "a") as f:
            f.write(line + "\n")
    except OSError:
        pass


def read(limit: int = 200) -> list[dict]:
    path = state_dir() / "journal.jsonl"
    try:
        lines = path.read_text().splitlines()[-limit:]
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out
