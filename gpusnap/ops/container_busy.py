"""One gpusnap command at a time checkpoints a container.

Podman's lock runs two checkpoints of one container one after the other, but
a gpusnap command does more around its dump: requests left for the action
script (one file per container and kind), pages linked into a RAM folder,
the guardian's verdict read from the journal, the local checkpoint dropped
once pushed. Two such commands interleaved there take each other's requests
and links, or drop the folder the other's dump is writing. A second command
is refused at once, in one line, before it touches anything; the lock is an
flock, so a command killed lets go with its process.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator

from gpusnap.errors import GpusnapError
from gpusnap.journal import state_subdir


@contextlib.contextmanager
def only_command(container_id: str, name: str, what: str) -> Iterator[None]:
    """Held for the block; GpusnapError where another gpusnap command holds it."""
    path = state_subdir("busy") / container_id
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise _busy(name, fd) from None
        os.ftruncate(fd, 0)
        # who, then the names refuse_if_busy knows the container by
        os.pwrite(fd, f"pid {os.getpid()}: {what}\n{name}\n{container_id}\n".encode(), 0)
        yield
    finally:
        # the file stays: removing it would let a third command lock a new
        # file while a second still waits on this one
        os.close(fd)


def refuse_if_busy(source: str) -> None:
    """GpusnapError where a gpusnap command holds the container named or
    (its ID's prefix) numbered ``source``: said before Podman is asked about
    it, which waits on the container's lock for as long as the other's dump."""
    try:
        entries = list(os.scandir(state_subdir("busy")))
    except OSError:
        return
    for entry in entries:
        try:
            fd = os.open(entry.path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            lines = _said(fd).splitlines()
            names = lines[1:3] if len(lines) >= 3 else []
            if not (source in names or (len(source) >= 12 and names[1:]
                                        and names[1].startswith(source))):
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                raise _busy(source, fd) from None
        finally:
            os.close(fd)


def _busy(name: str, fd: int) -> GpusnapError:
    who = _said(fd).splitlines()[:1]
    return GpusnapError(f"{name} is being checkpointed by another gpusnap command "
                        f"({who[0] if who else 'it has not said which yet'}); nothing was done",
                        "wait for it to end (`gpusnap status` lists background uploads), "
                        "then run this again")


def _said(fd: int) -> str:
    try:
        return os.pread(fd, 1024, 0).decode(errors="replace").strip()
    except OSError:
        return ""
