"""One process at a time changes the GPU state of a container's CUDA processes.

A leave-running checkpoint ends with its guardian giving the GPUs back
(action/guardian.py), seconds after CRIU is done at GBs of GPU memory, and
later still where the containerd shim holds the task paused for its client.
A second checkpoint in that window would find the processes already
checkpointed, quiesce nothing and start no guardian, and the first guardian
would unlock them under the second dump. So pre-dump, gpusnap's containerd
client, freeze, thaw, move and doctor --fix each wait for their turn, keyed
by the container's init pid; whoever quiesces hands the turn to its guardian,
which holds it through CRIU and until its resume has returned.

The turn is an flock on a file of the state folder: the kernel drops it when
its last holder exits, however that happens, so a killed guardian never
leaves a container locked out. Its holder writes its pid and role in it, for
the line that names who is still at work.
"""

from __future__ import annotations

import fcntl
import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from gpusnap.journal import state_subdir
from gpusnap.procs import ancestors, ns_init
from gpusnap.waits import Bound, raise_words

POLL_S = 0.1
# The journal event a guardian ends with, its verdict (ok or not), written
# before it lets go: whoever then takes the turn finds it (ops/gpu_back.py).
DONE = "guardian-done"
# The roles that hold a turn from pre-dump until the GPUs are back.
GUARDING = ("pre-dump", "guardian", "guardian-held")


@dataclass
class Turn:
    """A held turn: ``fd`` keeps it, in this process and any it is passed to."""

    init_pid: int
    fd: int
    handed: bool = False
    waited_s: float = 0.0  # how long wait_turn waited for the last holder

    def hand_over(self) -> None:
        """``fd`` was passed to a process that holds the turn on: leaving, this
        process closes its copy rather than letting go."""
        self.handed = True

    def take_back(self) -> None:
        """The process it was handed to is gone: leaving, this one lets go."""
        self.handed = False

    def release(self) -> None:
        """Let go: the next taker may change the processes' GPU state."""
        release_fd(self.init_pid, self.fd)

    def close(self) -> None:
        """This process's copy only, once handed to a process that holds it on."""
        try:
            os.close(self.fd)
        except OSError:
            pass

    def __enter__(self) -> "Turn":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close() if self.handed else self.release()


def _path(init_pid: int) -> Path:
    return state_subdir("turns") / f"{init_pid}.lock"


def claim(init_pid: int, fd: int, role: str) -> bool:
    """Write this process as the holder of the turn held through ``fd`` (a
    guardian, once pre-dump has handed it the turn and exited). False, and
    nothing written, where ``fd`` is not that turn's file."""
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or os.stat(_path(init_pid)).st_ino != st.st_ino:
            return False
        os.set_inheritable(fd, False)  # no child of the holder keeps the turn
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {role}\n".encode(), 0)
    except OSError:
        return False
    return True


def holder(init_pid: int) -> tuple[int | None, str]:
    """(pid, role) written by the turn's holder, where the file is there."""
    try:
        pid, _, role = _path(init_pid).read_text().strip().partition(" ")
        return int(pid), role
    except (OSError, ValueError):
        return None, ""


def try_take(init_pid: int, role: str) -> Turn | None:
    """The turn if no one holds it now, else None. ``role``: what this process
    does with it ("pre-dump", "freeze"), named to whoever waits."""
    path = _path(init_pid)
    opened = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    # never 0-2: CRIU runs the action script with those closed, and the
    # guardian's stdin (its socket) would land on a turn handed to it there
    fd = fcntl.fcntl(opened, fcntl.F_DUPFD_CLOEXEC, 3)
    os.close(opened)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    try:  # its last holder removed the file after this open: that lock guards nothing
        same = os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        same = False
    if not same:
        os.close(fd)
        return try_take(init_pid, role)
    claim(init_pid, fd, role)
    return Turn(init_pid, fd)


def _busy_line(init_pid: int) -> str:
    pid, role = holder(init_pid)
    who = f"pid {pid}" if pid else "pid unknown"
    if role == "guardian":
        return (f"gpusnap's guardian ({who}) still holds the container's GPUs: it gives them "
                "back once the last checkpoint's dump is over")
    return f"gpusnap's {role or 'step'} ({who}) is still changing the container's GPU state"


def wait_turn(init_pid: int, what: str, role: str, bound: Bound | None = None,
              go_on: Callable[[int | None, str], bool] | None = None) -> Turn | None:
    """The turn, once whoever holds it has let go; WaitExpired after ``bound``.
    ``what``: the step waiting, named in the line ("freeze of CTR"). None, at
    once, where ``go_on(holder's pid, role)`` says this step may go on beside
    that holder."""
    bound = bound or Bound.of("GPU_TURN")
    started = time.monotonic()
    deadline = started + bound.seconds
    while True:
        turn = try_take(init_pid, role)
        if turn is not None:
            turn.waited_s = round(time.monotonic() - started, 3)
            return turn
        if go_on is not None and go_on(*holder(init_pid)):
            return None
        if time.monotonic() > deadline:
            raise bound.expired(
                f"{what}: {_busy_line(init_pid)}",
                "nothing was changed; try again once it is done (a containerd task its client "
                "keeps paused gets its GPUs back once it is resumed; `gpusnap doctor` shows "
                f"what is still checkpointed; a slow host: {raise_words(bound.name)})")
        time.sleep(POLL_S)


def key_for(pid: int) -> int:
    """The init pid a turn of ``pid``'s container is keyed by: the nearest
    ancestor (itself included) with a turn file, which pre-dump names by
    runc's init pid whatever the pid namespaces; else that namespace's init."""
    for at in ancestors(pid):
        if at <= 1:
            break
        if _path(at).exists():
            return at
    return ns_init(pid) or pid


def release_fd(init_pid: int, fd: int) -> None:
    """Let go of a turn held through ``fd`` (one passed to this process, say).
    The file goes first, while still held, so no later taker locks a file
    that is about to vanish (try_take checks it locked the one named)."""
    try:
        if os.stat(_path(init_pid)).st_ino == os.fstat(fd).st_ino:
            _path(init_pid).unlink(missing_ok=True)
    except OSError:
        pass
    try:
        os.close(fd)
    except OSError:
        pass
