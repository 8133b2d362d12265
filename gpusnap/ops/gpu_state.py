"""GPU state of a container's processes, for verbs that run outside CRIU."""

from __future__ import annotations

from gpusnap.gpu.cuda import ProcessState
from gpusnap.errors import GpusnapError
from gpusnap.gpu.quiesce import Driver, require_driver, resume, states
from gpusnap.gpu.turn import wait_turn
from gpusnap.procs import alive
from gpusnap.waits import WaitExpired


def load_driver() -> Driver | None:
    """The CUDA driver, or None on a host without one."""
    try:
        return require_driver()
    except GpusnapError:
        return None


def ensure_running(init_pid: int, pids: list[int]) -> list[int]:
    """After a failed dump: once CRIU's guardian has given the GPUs back (or
    there was none: gpu/turn.py), resume what is still held.

    Returns the pids this call had to resume itself; none where the guardian
    still works past the wait's bound (it holds on; doctor shows what is left).
    """
    if not pids:
        return []
    driver = load_driver()
    if driver is None:
        return []
    try:
        turn = wait_turn(init_pid, "the GPUs given back after the failed dump")
    except WaitExpired:
        return []
    with turn:
        held = [p for p, s in states(driver, [p for p in pids if alive(p)]).items()
                if s != ProcessState.RUNNING]
        return resume(driver, held) if held else []
