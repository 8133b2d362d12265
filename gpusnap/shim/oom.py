"""A task killed for memory, said to containerd as TaskOOM.

containerd's CRI reads that event: a container the kernel's OOM killer ended
then reports reason "OOMKilled" (`kubectl describe pod`, the kubelet's
restart back-off), not a bare exit 137 that reads as a crash. containerd's
runc shim watches the task's memory cgroup for it; so does this one, with
one thread per task that waits in poll():

- cgroup v2: memory.events, whose oom_kill counter the kernel raises and
  announces as POLLPRI on the open file;
- cgroup v1: an eventfd registered with memory.oom_control through
  cgroup.event_control; the kernel signals it at each OOM and once more when
  the cgroup is removed.

A task whose cgroup cannot be found (no memory controller) is not watched:
its exits are still published, without the reason.
"""

from __future__ import annotations

import logging
import os
import select
import threading
from typing import Callable

from gpusnap.procs import cgroup_of

log = logging.getLogger("gpusnap.shim")


def memory_cgroup(pid: int) -> tuple[str, bool] | None:
    """The folder of PID's memory cgroup, as the shim (in the host's cgroup
    namespace) sees it, and whether it is cgroup v2; None where there is none."""
    try:
        found = cgroup_of(pid, "memory")
    except OSError:
        return None
    if found is None or not found[0].is_dir():
        return None
    return str(found[0]), found[1] == 2


def oom_kills(events: str) -> int:
    """memory.events' oom_kill count (0 where the kernel does not count it)."""
    for line in events.splitlines():
        key, _, value = line.partition(" ")
        if key == "oom_kill" and value.strip().isdigit():
            return int(value)
    return 0


class OomWatch:
    """Calls ``on_oom`` from its own thread each time the kernel's OOM killer
    acts in the task's memory cgroup, until ``stop`` or the cgroup goes."""

    def __init__(self, folder: str, cgroup2: bool, on_oom: Callable[[], None]) -> None:
        self.folder, self._on_oom = folder, on_oom
        self._stop_r, self._stop_w = os.pipe2(os.O_CLOEXEC)
        self._fds: list[int] = []
        self._lock = threading.Lock()  # one reader of the counter: each kill said once
        self._stop_lock = threading.Lock()
        try:
            self._more = self._v2() if cgroup2 else self._v1()
            threading.Thread(target=self._run, name="oom", daemon=True).start()
        except BaseException:  # OSError; RuntimeError: no thread (the shim at its pids limit)
            self._close()
            self.stop()
            raise

    def check(self) -> bool:
        """Says an OOM kill the kernel counted since the last check, now, from
        this thread: the task's exit calls it before TaskExit, while its cgroup
        still stands (the watch's thread may not have run yet, and Delete
        removes the cgroup right after the exit). False once the cgroup is gone."""
        with self._lock:
            if not self._fds:
                return False
            try:
                grew = self._more()
            except OSError:  # the cgroup removed under the read
                return False
            if grew:
                self._on_oom()
            return True

    def _v2(self) -> Callable[[], bool]:
        fd = os.open(os.path.join(self.folder, "memory.events"), os.O_RDONLY | os.O_CLOEXEC)
        self._fds.append(fd)
        last = oom_kills(os.pread(fd, 4096, 0).decode())  # reading arms the next POLLPRI

        def more() -> bool:
            nonlocal last
            now = oom_kills(os.pread(fd, 4096, 0).decode())  # OSError: the cgroup is gone
            grew, last = now > last, now
            return grew
        self._watch = (fd, select.POLLPRI)
        return more

    def _v1(self) -> Callable[[], bool]:
        efd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        self._fds.append(efd)
        control = os.open(os.path.join(self.folder, "memory.oom_control"), os.O_RDONLY | os.O_CLOEXEC)
        self._fds.append(control)
        with open(os.path.join(self.folder, "cgroup.event_control"), "w") as f:
            f.write(f"{efd} {control}")

        def more() -> bool:
            try:
                signalled = os.eventfd_read(efd) > 0
            except BlockingIOError:  # woken for nothing
                signalled = False
            # the last signal comes when the cgroup is removed: not an OOM
            if not os.path.isdir(self.folder):
                raise FileNotFoundError(self.folder)
            return signalled
        self._watch = (efd, select.POLLIN)
        return more

    def _run(self) -> None:
        poller = select.poll()
        poller.register(self._watch[0], self._watch[1])
        poller.register(self._stop_r, select.POLLIN)
        try:
            while True:
                ready = dict(poller.poll())
                # the cgroup's news before the stop: an OOM that ended the task
                # wakes both at once, and its event must still go out
                if self._watch[0] in ready and not self.check():
                    return  # the cgroup is gone
                if self._stop_r in ready:
                    return
        finally:
            with self._lock:
                self._close()

    def stop(self) -> None:
        """Ends the thread (at the task's Delete); called once or more, from
        any thread (two Deletes of one task)."""
        with self._stop_lock:
            fd, self._stop_w = self._stop_w, -1
        if fd < 0:
            return
        try:
            os.write(fd, b"x")
        except OSError:  # the thread ended already and closed its end
            pass
        os.close(fd)

    def _close(self) -> None:
        for fd in [*self._fds, self._stop_r]:
            try:
                os.close(fd)
            except OSError:
                pass
        self._fds = []


def watch(cid: str, pid: int, on_oom: Callable[[], None]) -> OomWatch | None:
    """A watch of PID's memory cgroup (the task's init), or None where it has none."""
    found = memory_cgroup(pid)
    if found is None:
        log.info("container %s: no memory cgroup found for pid %d; its OOM kills are not reported",
                 cid, pid)
        return None
    folder, cgroup2 = found
    try:
        return OomWatch(folder, cgroup2, on_oom)
    except Exception as e:  # noqa: BLE001 -- the task runs on, unwatched: never its Create's failure
        log.info("container %s: cannot watch %s for OOM kills: %s", cid, folder, e)
        return None
