"""GPU state of a container's processes, for verbs that run outside CRIU."""

from __future__ import annotations

import time

from gpusnap.gpu.cuda import ProcessState
from gpusnap.errors import GpusnapError
from gpusnap.gpu.quiesce import Driver, require_driver, resume, states
from gpusnap.procs import alive


def load_driver() -> Driver | None:
    """The CUDA driver, or None on a host without one."""
    try:
        return require_driver()
    except GpusnapError:
        return None


def ensure_running(pids: list[int], wait_s: float = 60.0) -> list[int]:
    """After a failed dump: give CRIU's guardian time, then resume what is still held.

    Returns the pids this call had to resume itself.
    """
    if not pids:
        return []
    driver = load_driver()
    if driver is None:
        return []
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        held = [p for p, s in states(driver, [p for p in pids if alive(p)]).items()
                if s != ProcessState.RUNNING]
        if not held:
            return []
        time.sleep(0.2)
    return resume(driver, held)
