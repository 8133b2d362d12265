"""RAM chosen for pages and not yet written: held for the process that chose it.

memory.ram_dir checks the host's free memory before pages go to a tmpfs. Two
restores started together would each see the same free memory and both take
RAM that only one of them fits in (the kernel then kills what it picks, a job
among them). Each process that chooses RAM writes its hold into a ledger (one
file per process, under a lock), and every check counts the others' holds
less what they have written already. A hold ends when its step lets go
(memory.let_go) or its process ends: an entry whose process is gone counts
nothing and is removed.

One ledger for the host (its memory is one pool, whichever tmpfs the pages
go to), in gpusnap's root-only state folder: never in a tmpfs (/dev/shm is
anyone's to write, links included).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

from gpusnap.journal import state_subdir
from gpusnap.private import write_private
from gpusnap.procs import runs_as, start_time

_LOCK = "lock"
LOCK_S = 10  # a holder only reads a few files; one stopped (Ctrl-Z) past this: the disk instead


def _written(folder: str) -> int | None:
    """Bytes of memory ``folder``'s files take in its tmpfs; None once it is gone
    (renamed into place, discarded): then its pages are counted wherever they went."""
    total = 0
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return None
    for entry in entries:
        with contextlib.suppress(OSError):
            if entry.is_file(follow_symlinks=False):
                total += entry.stat(follow_symlinks=False).st_blocks * 512
    return total


class Ledger:
    """One RAM root's holds, read and changed under its lock."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._mine = folder / str(os.getpid())

    def others(self) -> int:
        """Bytes other live processes hold and have not written yet."""
        total = 0
        for path in self.folder.iterdir():
            if not path.name.isdigit() or path == self._mine:
                continue
            try:
                held = json.loads(path.read_text())
                pid, started, size = int(path.name), held["started"], int(held["bytes"])
            except (OSError, ValueError, KeyError, TypeError):
                continue  # written whole by rename under the lock: anything else is not a hold
            if not runs_as(pid, started):
                path.unlink(missing_ok=True)
                continue
            written = _written(held["folder"]) if held.get("folder") else 0
            total += 0 if written is None else max(0, size - written)
        return total

    def hold(self, size: int) -> None:
        self._write({"started": start_time(os.getpid()), "bytes": size, "folder": ""})

    def name_folder(self, folder: Path) -> None:
        try:
            held = json.loads(self._mine.read_text())
        except (OSError, ValueError):
            return  # nothing held here (GPUSNAP_PAGES_RAM=1 checks nothing)
        self._write({**held, "folder": str(folder)})

    def _write(self, held: dict) -> None:
        write_private(self._mine, json.dumps(held))  # whole or not at all


def locked(fd: int, seconds: float) -> bool:
    """flock(LOCK_EX) on ``fd`` within ``seconds``."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)


def ledger_dir() -> Path:
    """The host's ledger: in the state folder."""
    return state_subdir("holds")


def let_go() -> None:
    """This process's hold ends. Its own entry: no lock needed (a reader skips
    an entry it cannot read), so a holder stopped with Ctrl-Z holds up nothing."""
    with contextlib.suppress(OSError):
        (ledger_dir() / str(os.getpid())).unlink()


@contextlib.contextmanager
def ledger() -> Iterator[Ledger | None]:
    """The host's ledger, locked: a check and the hold it grants are one step.
    None where it cannot be had (the state folder unusable, or its lock not
    within LOCK_S)."""
    try:
        folder = ledger_dir()
        lock = open(folder / _LOCK, "a")
    except OSError:
        yield None
        return
    with lock:
        yield Ledger(folder) if locked(lock.fileno(), LOCK_S) else None
