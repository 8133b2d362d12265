"""GPU state of a container's processes, for verbs that run outside CRIU."""

from __future__ import annotations

import time
from typing import Callable, TypeVar

from gpusnap import journal
from gpusnap.gpu.cuda import ProcessState
from gpusnap.errors import GpusnapError
from gpusnap.gpu.quiesce import Driver, require_driver, resume, resume_onto, states
from gpusnap.gpu.turn import holder, key_for, try_take
from gpusnap.ops import frozen
from gpusnap.procs import alive, stopped

T = TypeVar("T")
# How long the restore's check waits for a restore's turn: the agent lets go of it as it exits
TURN_WAIT_S = 10.0


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
    on_purpose = frozen.frozen()  # `gpusnap freeze`'s: never restored behind its back
    pids = [p for p in pids if p not in on_purpose]
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
    resumed = under_turn(init_pid, "checkpoint's clean-up", held, lambda: resume(driver, held))
    return resumed or []


def under_turn(key: int, role: str, pids: list[int], act: Callable[[], T],
               wait_s: float = 0.0) -> T | None:
    """``act()`` (a resume of ``pids``) under their container's turn (gpu/turn.py),
    waiting up to ``wait_s`` for it; None where another holds it on, or it
    cannot be taken from here (recorded as 'resume-left', with who or why):
    two resumes of one process fail each other."""
    deadline = time.monotonic() + wait_s
    try:
        while (turn := try_take(key, role)) is None and time.monotonic() < deadline:
            time.sleep(0.05)
    except OSError as exc:  # a state folder this process cannot write: nothing done from here
        journal.record("resume-left", init_pid=key, pids=pids, error=str(exc), by=role)
        return None
    if turn is None:
        who, held_as = holder(key)
        journal.record("resume-left", init_pid=key, pids=pids, holder=who, role=held_as, by=role)
        return None
    with turn:
        return act()


def bring_back(pids: list[int], driver: Driver,
               choices: list[tuple[str, list[tuple[str, str]] | None]]) -> list[int] | None:
    """After a restore Podman says is done: processes its post-resume step left
    CHECKPOINTED or LOCKED resumed here, onto the plan's GPUs, under their
    container's turn (waited for up to TURN_WAIT_S), rather than a restored
    container left off its GPU. Returns the pids resumed, None where the turn
    stayed held; raises QuiesceError where the driver refuses."""
    key = key_for(pids[0])
    done = under_turn(key, "restore's check", pids,
                      lambda: resume_onto(driver, pids, choices), wait_s=TURN_WAIT_S)
    if done is None:
        return None
    label, changed, refused = done
    journal.record("resumed", init_pid=key, pids=changed, gpu_pairs=label, failed_first=refused,
                   by="restore's check", why="post-resume left them off their GPUs")
    return changed
