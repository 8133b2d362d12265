"""Guardian started by the pre-dump action: no process is left without its GPU.

It waits for CRIU to exit. Processes that were dumped and killed are gone;
any that survived (``--leave-running``, or a dump that failed or was killed)
are restored and unlocked as soon as their cgroup is thawed. A CRIU that was
killed leaves the cgroup frozen, and no one else thaws it (neither runc nor
crun does): after a grace for the runtime, the guardian thaws it itself. Memory pre-dump
took out of a process (dump_ahead.py: handed over on stdin, a socket, with
the files that hold it) is written back first: the driver restores from it.
A process whose memory cannot be written back is left locked, not restored
from memory that is not its own, and the journal says so.

Where the containerd shim thawed a task its client had paused and pauses it
again for the client (requests.HELD, under the init's pid), the GPUs come
back once the client's Resume has dropped that request, however long that
takes: the guardian thaws nothing the client holds.

gpusnap's containerd client starts one too, over the processes it quiesced
before its pause (ops/containerd_gpu.py), watching the client instead of
CRIU: if the client dies first, a dump it left in flight is waited for (CRIU
traces the processes, however long) and its request is dropped
(--drop-request).

It holds the container's turn (gpu/turn.py, ``--turn-fd``, from pre-dump)
until the GPUs are back, so a second checkpoint waits rather than dumping
processes this guardian is about to unlock. Its last journal event, before it
lets go, is turn.DONE with its verdict: `gpusnap checkpoint --leave-running` waits
for the turn and says it (ops/gpu_back.py).

Usage: python -m gpusnap.action.guardian CRIU_PID PID... [--init INIT_PID [--drop-request]
       [--turn-fd FD]]
"""

from __future__ import annotations

import os
import select
import sys
import time
from typing import Callable

from gpusnap import journal, requests
from gpusnap.criu.freezer import is_frozen, thaw
from gpusnap.gpu import staging
from gpusnap.gpu.cuda import CudaDriver
from gpusnap.gpu.quiesce import QuiesceError, resume
from gpusnap.gpu.turn import DONE, claim, release_fd
from gpusnap.procs import alive, traced_by_criu
from gpusnap.waits import leave

THAW_WAIT_S = 120.0
# CRIU thaws the cgroup as it ends; frozen this long after CRIU is gone, no one will
THAW_GRACE_S = 5.0


def wait_exit(pid: int) -> None:
    try:
        fd = os.pidfd_open(pid)
    except (ProcessLookupError, OSError):
        return
    try:
        select.select([fd], [], [])
    finally:
        os.close(fd)


def survivors_to_resume(pids: list[int], deadline: float, grace: float = THAW_GRACE_S,
                        held: Callable[[], bool] = lambda: False,
                        dump_in_flight_bounded: bool = True) -> list[int]:
    """The surviving pids, once none of them is frozen; a freeze that outlives CRIU
    by ``grace`` is thawed here (or the deadline passed). While ``held()`` (the
    client holds the task paused) or CRIU still traces them, the grace waits."""
    thaw_at = time.monotonic() + grace
    while True:
        living = [p for p in pids if alive(p)]
        dumping = any(traced_by_criu(p) for p in living) and \
            (time.monotonic() < deadline or not dump_in_flight_bounded)
        is_held = held()
        if living and (is_held or dumping):
            thaw_at = time.monotonic() + grace  # the grace counts from when they let go
            if is_held or not dump_in_flight_bounded:  # and so does the deadline
                deadline = max(deadline, time.monotonic() + grace + THAW_WAIT_S)
            time.sleep(0.25)
            continue
        frozen = [p for p in living if is_frozen(p)]
        if not frozen or time.monotonic() > deadline:
            return living
        if time.monotonic() > thaw_at:
            thawed = [p for p in frozen if thaw(p)]
            if thawed:  # else a parent cgroup holds the freeze: not CRIU's, left alone
                journal.record("guardian-thawed", pids=thawed,
                               why="CRIU ended with the container frozen (killed mid-dump)")
            thaw_at = deadline
        time.sleep(0.05)


def _handed_over() -> list:
    """What pre-dump read ahead, (task, fd) each; nothing where stdin is no socket."""
    # start-up: loaded once CRIU is gone, not beside the dump
    import socket

    from gpusnap.pages import dump_ahead
    try:
        sock = socket.socket(fileno=0)
    except OSError:
        return []
    return dump_ahead.received(sock)


def write_back(taken: list, init: int | None = None) -> set[int]:
    """Each surviving process's memory back from the files; the pids it failed for."""
    from gpusnap.pages import dump_ahead  # start-up: loaded once CRIU is gone, not beside the dump
    failed = set()
    for task, fd in taken:
        if not alive(task.pid):
            continue
        try:
            dump_ahead.write_back(task, fd)
            journal.record("guardian-wrote-back", pid=task.pid, bytes=task.bytes)
        except OSError as exc:
            failed.add(task.pid)
            journal.record("guardian-failed", init_pid=init, pids=[task.pid],
                           error=f"its memory could not be written back ({exc}): left "
                                 "locked; restore the container from its checkpoint")
    return failed


def _option(argv: list[str], name: str) -> tuple[int | None, list[str]]:
    """``name VALUE`` taken out of ``argv``: (VALUE, the rest)."""
    if name not in argv:
        return None, argv
    at = argv.index(name)
    return int(argv[at + 1]), argv[:at] + argv[at + 2:]


def main(argv: list[str]) -> int:
    client = "--drop-request" in argv
    argv = [a for a in argv if a != "--drop-request"]
    init, argv = _option(argv, "--init")
    turn_fd, argv = _option(argv, "--turn-fd")
    if turn_fd is not None and init is not None:  # the holder now that pre-dump is gone
        if not claim(init, turn_fd, "guardian"):  # not the turn's file: nothing to let go
            journal.record("guardian-turn-lost", init_pid=init, fd=turn_fd)
            turn_fd = None
    code = 1
    try:
        code = _guard(argv, init, client, turn_fd)
    except Exception as exc:  # noqa: BLE001 -- said where someone looks: the journal
        journal.record("guardian-failed", init_pid=init, error=f"{type(exc).__name__}: {exc}")
    finally:
        # before the turn goes: whoever waits for it (`gpusnap checkpoint
        # --leave-running`, ops/gpu_back.py) finds the verdict once it is free
        journal.record(DONE, init_pid=init, ok=code == 0)
        if turn_fd is not None and init is not None:  # the next checkpoint may quiesce
            release_fd(init, turn_fd)
    return code


def _held(init: int | None, turn_fd: int | None) -> Callable[[], bool]:
    """Whether the shim holds the task for its client (requests.held); the turn
    says so while it does ("guardian-held"): pre-dump of the shim's next try
    may go on without it, since this guardian waits for that client's Resume."""
    if init is None:
        return lambda: False
    said = [False]

    def held() -> bool:
        now = requests.held(init)
        if turn_fd is not None and now != said[0]:
            claim(init, turn_fd, "guardian-held" if now else "guardian")
            said[0] = now
        return now
    return held


def _guard(argv: list[str], init: int | None, client: bool, turn_fd: int | None) -> int:
    criu_pid, pids = int(argv[0]), [int(p) for p in argv[1:]]
    wait_exit(criu_pid)
    if client and init is not None:  # its client is gone: no later dump may obey it
        requests.drop(init, requests.QUIESCED)
    taken = _handed_over()
    watched = sorted(set(pids) | {task.pid for task, _ in taken})
    living = survivors_to_resume(watched, time.monotonic() + THAW_WAIT_S,
                                 held=_held(init, turn_fd), dump_in_flight_bounded=not client)
    failed = write_back(taken, init) if taken and living else set()
    for task, _ in taken:  # memory back (or its process gone): a driver restore may run
        if task.pid not in failed:
            staging.release(task.pid)
    living = [p for p in living if p in pids and p not in failed]
    if not living:
        return 1 if failed else 0
    try:
        changed = resume(CudaDriver(), living)
        journal.record("guardian-resumed", init_pid=init, pids=changed)
    except (QuiesceError, RuntimeError) as exc:
        journal.record("guardian-failed", init_pid=init, pids=living, error=str(exc))
        return 1
    return 0


if __name__ == "__main__":
    leave(main(sys.argv[1:]))
