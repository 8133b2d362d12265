"""GPU state of a container's processes, for verbs that run outside CRIU."""

from __future__ import annotations

import time

from gpusnap import journal
from gpusnap.gpu.cuda import ProcessState
from gpusnap.errors import GpusnapError
from gpusnap.gpu.quiesce import Driver, require_driver, resume, states
from gpusnap.gpu.turn import holder, try_take
from gpusnap.procs import alive, stopped


def load_driver() -> Driver | None:
    """The CUDA driver, or None on a host without one."""
    try:
        return require_driver()
    except GpusnapError:
        return None


def ensure_running(init_pid: int, pids: list[int], wait_s: float = 60.0) -> list[int]:
    """After a failed dump: give CRIU's guardian time, then resume what is still
    held, under the container's turn (gpu/turn.py). A guardian still holding
    the turn then is left to it: two resumes of one process fail each other.

    Returns the pids this call had to resume itself.
    """
    if not pids:
        return []
    driver = load_driver()
    if driver is None:
        return []
    deadline = time.monotonic() + wait_s
    while True:
        # a stopped one is left out: the driver would answer only once it runs
        asked = [p for p in pids if alive(p) and not stopped(p)]
        held = [p for p, s in states(driver, asked).items() if s != ProcessState.RUNNING]
        if not held:
            return []
        if time.monotonic() > deadline:
            break
        time.sleep(0.2)
    turn = try_take(init_pid, "checkpoint's clean-up")
    if turn is None:
        who, role = holder(init_pid)
        journal.record("resume-left", init_pid=init_pid, pids=held, holder=who, role=role)
        return []
    with turn:
        return resume(driver, held)
