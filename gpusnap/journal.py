"""An append-only record of what gpusnap did to which processes.

Hooks and CRIU action scripts have no terminal; this file is where their
story goes, and where `gpusnap doctor` looks for work left half done.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

from gpusnap.private import open_private, private_dir
from gpusnap.redact import redact


def state_dir() -> Path:
    """/run/gpusnap (root only); GPUSNAP_STATE_DIR moves it, e.g. for tests."""
    return private_dir(os.environ.get("GPUSNAP_STATE_DIR", "/run/gpusnap"))


def state_subdir(name: str) -> Path:
    """A root-only folder of state_dir() (requests, containers, restores, actions)."""
    return private_dir(state_dir() / name)


KEPT_LOGS = 20


def keep_log(log: Path, verb: str, container: str) -> Path | None:
    """A copy of CRIU's ``log`` in state_dir()/logs (copy_log); None where there
    is no log or no room for the copy."""
    try:
        return copy_log(log, verb, container)
    except OSError:
        return None


def copy_log(log: Path, verb: str, container: str) -> Path:
    """A copy of CRIU's ``log`` in state_dir()/logs, named for the verb, the
    container and the time: the runtime's copy goes with the container (or the
    next dump overwrites it), and the log is what says why CRIU failed. OSError
    where there is no log (FileNotFoundError) or no room for the copy."""
    if not log.is_file():
        raise FileNotFoundError(2, "no log", str(log))
    logs = state_subdir("logs")
    kept = logs / f"{verb}-{container}-{time.strftime('%Y%m%dT%H%M%S')}.log"
    try:
        shutil.copyfile(log, kept)
    except OSError:
        kept.unlink(missing_ok=True)  # a cut copy would read as a CRIU killed mid-way
        raise
    # /run is memory: the newest KEPT_LOGS stay, enough to report a failure
    for old in sorted(logs.glob("*.log"), key=_mtime)[:-KEPT_LOGS]:
        old.unlink(missing_ok=True)
    return kept


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def record(event: str, **fields) -> None:
    """Append one event; never fails the caller (a full /run must not stop a restore)."""
    # Error texts come from elsewhere too (CRIU, Podman, a registry): no credential in them.
    fields = {k: redact(v) if isinstance(v, str) else v for k, v in fields.items()}
    # "at": the same moment to the millisecond, for timelines of one restore (bench/)
    now = time.time()
    line = json.dumps({"time": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(now)),
                       "at": round(now, 3), "event": event, **fields},
                      sort_keys=True, default=str)
    try:
        with open_private(state_dir() / "journal.jsonl", "a") as f:
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
