"""GPU state of a container's processes, for verbs that run outside CRIU."""

from __future__ import annotations

import time

from gpusnap import journal
from gpusnap.gpu.cuda import ProcessState
from gpusnap.errors import GpusnapError
from gpusnap.gpu.quiesce import Driver, require_driver, resume, resume_onto, states
from gpusnap.gpu.turn import holder, key_for, try_take
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


def bring_back(pids: list[int], driver: Driver,
               choices: list[tuple[str, list[tuple[str, str]] | None]]) -> list[int]:
    """After a restore Podman says is done: processes its post-resume step left
    CHECKPOINTED or LOCKED resumed here, onto the plan's GPUs, under their
    container's turn, rather than a restored container left off its GPU.
    A turn someone holds is left to them. Returns the pids resumed; raises
    QuiesceError where the driver refuses."""
    turn = try_take(key_for(pids[0]), "restore's check")
    if turn is None:
        return []
    with turn:
        label, changed, refused = resume_onto(driver, pids, choices)
    journal.record("resumed", init_pid=key_for(pids[0]), pids=changed, gpu_pairs=label,
                   failed_first=refused, by="restore's check",
                   why="post-resume left them off their GPUs")
    return changed

