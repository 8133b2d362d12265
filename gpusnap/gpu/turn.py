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
import time
from dataclasses import dataclass
from pathlib import Path

from gpusnap.journal import state_subdir
from gpusnap.waits import Bound

POLL_S = 0.1


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


def claim(fd: int, role: str) -> None:
    """Write this process as the holder of the turn held through ``fd``
    (a guardian, once pre-dump has handed it the turn and exited)."""
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()} {role}\n".encode(), 0)


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
    claim(fd, role)
    return Turn(init_pid, fd)


def _busy_line(init_pid: int) -> str:
    pid, role = holder(init_pid)
    who = f"pid {pid}" if pid else "pid unknown"
    if role == "guardian":
        return (f"gpusnap's guardian ({who}) still holds the container's GPUs: it gives them "
                "back once the last checkpoint's dump is over")
    return f"gpusnap's {role or 'step'} ({who}) is still changing the container's GPU state"


def wait_turn(init_pid: int, what: str, role: str, bound: Bound | None = None) -> Turn:
    """The turn, once whoever holds it has let go; WaitExpired after ``bound``.
    ``what``: the step waiting, named in the line ("freeze of CTR")."""
    bound = bound or Bound.of("GPU_TURN")
    started = time.monotonic()
    deadline = started + bound.seconds
    while True:
        turn = try_take(init_pid, role)
        if turn is not None:
            turn.waited_s = round(time.monotonic() - started, 3)
            return turn
        if time.monotonic() > deadline:
            raise bound.expired(
                f"{what}: {_busy_line(init_pid)}",
                "nothing was changed; try again once it is done (a containerd task its client "
                "keeps paused gets its GPUs back once it is resumed; `gpusnap doctor` shows "
                f"what is still checkpointed; a slow host: GPUSNAP_WAIT_{bound.name}=SECONDS)")
        time.sleep(POLL_S)


def held() -> dict[int, tuple[int | None, str]]:
    """Turns held now: (holder's pid, role) by the container's init pid. A
    file no one holds (its holder closed it without letting go) is removed."""
    found: dict[int, tuple[int | None, str]] = {}
    try:
        paths = list(state_subdir("turns").glob("*.lock"))
    except OSError:  # no state folder to read (not root): nothing known held
        return found
    for path in paths:
        try:
            init_pid = int(path.stem)
        except ValueError:
            continue
        turn = try_take(init_pid, "doctor")
        if turn is None:
            found[init_pid] = holder(init_pid)
        else:
            turn.release()
    return found


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
