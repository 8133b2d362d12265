"""Child reaping for the shim: one thread waits for every child.

The shim is a subreaper, so container processes (re-parented when runc
exits) and runc itself are all its children. A single waitpid(-1) loop sees
every exit; whoever needs one asks for a Future by pid. subprocess is not
used for runc: its own waitpid would race this loop (and lose exit codes).
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass

PR_SET_CHILD_SUBREAPER = 36
_UNCLAIMED_TTL = 120.0  # seconds an exit nobody asked for is kept


@dataclass(frozen=True)
class Exit:
    pid: int
    status: int  # exit code, or 128 + signal as containerd reports it
    at_ns: int  # wall clock, nanoseconds


def exit_status(wait_status: int) -> int:
    if os.WIFSIGNALED(wait_status):
        return 128 + os.WTERMSIG(wait_status)
    return os.WEXITSTATUS(wait_status)


def set_subreaper() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")


class Reaper:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._futures: dict[int, Future] = {}
        self._unclaimed: dict[int, Exit] = {}
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="reaper", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def watch(self, pid: int) -> Future:
        """A Future resolved with the Exit of PID (at once if it already exited).

        Its callbacks run on the reaper thread: they must only hand work on.
        """
        with self._lock:
            return self._watch_locked(pid)

    def _watch_locked(self, pid: int) -> Future:
        fut = self._futures.get(pid)
        if fut is None:
            fut = Future()
            done = self._unclaimed.pop(pid, None)
            if done is not None:
                fut.set_result(done)
            else:
                self._futures[pid] = fut
        return fut

    def spawn(self, argv: list[str], *, stdin: int | None = None, stdout: int | None = None,
              stderr: int | None = None, extra_fds: tuple[int, ...] = (),
              env: dict[str, str] | None = None) -> tuple[int, Future]:
        """Start ARGV with the given fds as its stdio (None: /dev/null) and EXTRA_FDS as fds 3, 4, ...

        EXTRA_FDS must not be numbered below 3 + len(EXTRA_FDS) (dup them high first).
        """
        actions = []
        for target, fd, mode in ((0, stdin, os.O_RDONLY), (1, stdout, os.O_WRONLY), (2, stderr, os.O_WRONLY)):
            if fd is None:
                actions.append((os.POSIX_SPAWN_OPEN, target, os.devnull, mode, 0))
            else:
                actions.append((os.POSIX_SPAWN_DUP2, fd, target))
        for target, fd in enumerate(extra_fds, start=3):
            actions.append((os.POSIX_SPAWN_DUP2, fd, target))
        with self._lock:
            pid = os.posix_spawnp(argv[0], argv, os.environ if env is None else env, file_actions=actions)
            fut = self._watch_locked(pid)
        self._wake.set()
        return pid, fut

    def _loop(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, 0)
            except ChildProcessError:
                # No children: sleep until spawn() makes one (re-parented
                # container processes only appear when a child exits).
                self._wake.wait(1.0)
                self._wake.clear()
                continue
            except InterruptedError:
                continue
            ex = Exit(pid, exit_status(status), time.time_ns())
            with self._lock:
                fut = self._futures.pop(pid, None)
                if fut is None:
                    now = time.time_ns()
                    self._unclaimed = {p: e for p, e in self._unclaimed.items()
                                       if now - e.at_ns < _UNCLAIMED_TTL * 1e9}
                    self._unclaimed[pid] = ex
            if fut is not None:
                fut.set_result(ex)
