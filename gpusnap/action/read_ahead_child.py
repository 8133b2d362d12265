"""pre-restore's read-ahead of the file pages CRIU copies on write
(pages/file_pages.py), in a child process beside fill planning: each parses
CRIU's images, which takes a share of CRIU's stop, on a core of its own. Only
ever a hint: a child that fails or hangs never fails the restore.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

from gpusnap import journal

READ_AHEAD_WAIT_S = 5.0


def start(folder: Path) -> int | None:
    """read_ahead in a child process; its pid, for reap before the step ends:
    a child left behind would be CRIU's to reap."""
    try:
        pid = os.fork()
    except OSError as exc:  # only ever a hint: never in the step's own way
        journal.record("file-pages-not-read-ahead", error=f"fork: {exc}")
        return None
    if pid == 0:  # the child: never back into the caller's code
        code = 1
        try:
            # none of the caller's files (an agent's restore turn is an flock
            # this copy would hold), and an end of its own should nobody reap it
            os.closerange(3, os.sysconf("SC_OPEN_MAX"))
            signal.alarm(int(READ_AHEAD_WAIT_S) + 1)
            read_ahead(folder)
            code = 0
        except BaseException:  # noqa: BLE001 -- a hint that failed: the step goes on
            pass
        finally:
            os._exit(code)
    return pid


def reap(pid: int) -> None:
    """Wait for the read-ahead child; one that hangs (a mount that does not answer)
    is killed after READ_AHEAD_WAIT_S: it only ever gave hints. One that not even
    SIGKILL ends at once (uninterruptible I/O) is left after a second more."""
    with contextlib.suppress(ChildProcessError):
        if _waited(pid, READ_AHEAD_WAIT_S):
            return
        os.kill(pid, signal.SIGKILL)
        ended = _waited(pid, 1.0)
        journal.record("file-pages-not-read-ahead", error=f"stopped after {READ_AHEAD_WAIT_S:g} s"
                       + ("" if ended else f" (pid {pid} left in uninterruptible I/O)"))


class Later:
    """Read-ahead children reaped after the step that handed them over, by a
    process that is not CRIU's child (the agent: action/agent.py), so that
    CRIU's stop ends without waiting for a hint. Never a blocking wait (the
    agent's next step may be waiting): each is reaped once it ends, killed
    READ_AHEAD_WAIT_S after it was handed over, and killed as the agent leaves."""

    def __init__(self) -> None:
        self._started: dict[int, float] = {}
        self._killed: set[int] = set()

    def add(self, pid: int) -> None:
        self._started[pid] = time.monotonic()

    def pending(self) -> bool:
        return bool(self._started)

    def reap_ended(self) -> None:
        """Reap those that ended; kill those past their time (reaped once they end)."""
        for pid, since in list(self._started.items()):
            try:
                ended = os.waitpid(pid, os.WNOHANG) != (0, 0)
            except ChildProcessError:
                ended = True
            if ended:
                del self._started[pid]
                self._killed.discard(pid)
            elif pid not in self._killed and time.monotonic() - since >= READ_AHEAD_WAIT_S:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                self._killed.add(pid)
                journal.record("file-pages-not-read-ahead",
                               error=f"stopped after {READ_AHEAD_WAIT_S:g} s")

    def kill_all(self) -> None:
        """Those still reading, killed: the agent leaves (its children then
        are init's to reap)."""
        for pid in self._started:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
        self._started.clear()


def _waited(pid: int, seconds: float) -> bool:
    """Whether child ``pid`` ended (and was reaped) within ``seconds``."""
    deadline = time.monotonic() + seconds
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def read_ahead(folder: Path) -> None:
    """The file pages CRIU copies on write, asked of the disk now (file_pages.py);
    only ever a hint: CRIU faults in what this did not."""
    from gpusnap.pages import file_pages  # the read-ahead child only: not every step's start-up
    started = time.monotonic()
    try:
        dirs = file_pages.host_dirs(folder)
        if dirs is None:
            return
        done = file_pages.read_ahead(folder, dirs)
    except (OSError, ValueError) as exc:
        journal.record("file-pages-not-read-ahead", error=str(exc))
        return
    if done.files or done.skipped:
        journal.record("file-pages-read-ahead", files=done.files, bytes=done.bytes,
                       skipped=done.skipped, seconds=round(time.monotonic() - started, 3))
