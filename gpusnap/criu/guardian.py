"""Guardian started by the pre-dump action: no process is left without its GPU.

It waits for CRIU to exit. Processes that were dumped and killed are gone;
any that survived (``--leave-running``, or a dump that failed or was killed)
are restored and unlocked as soon as their cgroup is thawed.

Usage: python -m gpusnap.criu.guardian CRIU_PID PID...
"""

from __future__ import annotations

import os
import select
import sys
import time

from gpusnap import journal
from gpusnap.criu.freezer import is_frozen
from gpusnap.gpu.quiesce import QuiesceError, resume
from gpusnap.procs import alive

THAW_WAIT_S = 120.0


def wait_exit(pid: int) -> None:
    try:
        fd = os.pidfd_open(pid)
    except (ProcessLookupError, OSError):
        return
    try:
        select.select([fd], [], [])
    finally:
        os.close(fd)


def survivors_to_resume(pids: list[int], deadline: float) -> list[int]:
    """The surviving pids, once none of them is frozen (or the deadline passed)."""
    while True:
        living = [p for p in pids if alive(p)]
        if not any(is_frozen(p) for p in living) or time.monotonic() > deadline:
            return living
        time.sleep(0.05)


def main(argv: list[str]) -> int:
    criu_pid, pids = int(argv[0]), [int(p) for p in argv[1:]]
    wait_exit(criu_pid)
    living = survivors_to_resume(pids, time.monotonic() + THAW_WAIT_S)
    if not living:
        return 0
    from gpusnap.gpu.cuda import CudaDriver
    try:
        changed = resume(CudaDriver(), living)
        journal.record("guardian-resumed", pids=changed)
    except (QuiesceError, RuntimeError) as exc:
        journal.record("guardian-failed", pids=living, error=str(exc))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
