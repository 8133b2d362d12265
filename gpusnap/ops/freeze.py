"""Freeze/thaw: release a container's GPU memory in place and take it back (no CRIU).

The processes keep running on the CPU; their CUDA calls block until thaw.
Each waits for the guardian of a checkpoint just taken (gpu/turn.py), which
would otherwise undo a freeze, or find a thaw's processes mid-restore.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from gpusnap import journal
from gpusnap.errors import GpusnapError
from gpusnap.gpu.inventory import read_inventory
from gpusnap.gpu.quiesce import Driver, QuiesceError, Timing, quiesce, resume
from gpusnap.gpu.turn import wait_turn
from gpusnap.ops import frozen
from gpusnap.ops.gpu_state import load_driver
from gpusnap.ops.preconditions import require_running
from gpusnap.procs import cuda_processes
from gpusnap.runtime import podman


def cuda_of(ctr: podman.Container, verb: str, command: str) -> tuple[list, Driver]:
    """The container's CUDA processes and the driver; one line if either is missing."""
    procs = cuda_processes(ctr.pid)
    if not procs:
        raise GpusnapError(f"container {ctr.name} has no CUDA processes, so it cannot {verb}",
                           f"`gpusnap {command}` applies to containers that use an NVIDIA GPU; "
                           "`gpusnap checkpoint` takes any container")
    driver = load_driver()
    if driver is None:
        raise GpusnapError("the NVIDIA driver's checkpoint API is not available",
                           "install driver r570 or newer")
    return procs, driver


@contextmanager
def gpu_turn(name: str, verb: str, command: str) -> Iterator[tuple]:
    """The running container, its CUDA processes and the driver, read once the
    container's turn has come (gpu/turn.py): a guardian still giving the GPUs
    back changes both. ``verb``: what it must be able to do ("be frozen");
    ``command``: the gpusnap command asked for, named in the lines."""
    ctr = podman.inspect(name)
    require_running(ctr, verb)
    with wait_turn(ctr.pid, f"{command} of {ctr.name}", command):
        procs, driver = cuda_of(ctr, verb, command)
        if command != "thaw":
            # a freeze again would record no pids (doctor would then restore them); a
            # move would resume them onto the new GPU: a thaw behind the user's back
            frozen.refuse(ctr.name, procs, verb)
        yield ctr, procs, driver


def _gpu_used() -> dict[str, int]:
    return {g.uuid: g.memory_used for g in read_inventory().gpus}


def freeze(name: str, lock_timeout_ms: int) -> dict:
    with gpu_turn(name, "be frozen", "freeze") as (ctr, procs, driver):
        return _freeze(ctr, procs, driver, lock_timeout_ms)


def _freeze(ctr: podman.Container, procs: list, driver: Driver, lock_timeout_ms: int) -> dict:
    before = _gpu_used()
    timing = Timing()
    try:
        changed = quiesce(driver, [p.pid for p in procs], lock_timeout_ms, timing)
    except QuiesceError as exc:
        raise GpusnapError(f"freeze of {ctr.name} failed, nothing changed: {exc}",
                           "a process may be stuck in a long kernel; retry with a longer "
                           "--timeout") from None
    frozen.mark(ctr.pid, ctr.name, changed)  # off the GPU on purpose: doctor leaves them
    journal.record("frozen", container=ctr.id, pids=changed, timing=timing.phases)
    return {"container": ctr.name, "pids": changed, "timing": timing.phases,
            "gpu_memory_used_before": before, "gpu_memory_used_after": _gpu_used()}


def thaw(name: str) -> dict:
    with gpu_turn(name, "be thawed", "thaw") as (ctr, procs, driver):
        return _thaw(ctr, procs, driver)


def _thaw(ctr: podman.Container, procs: list, driver: Driver) -> dict:
    timing = Timing()
    try:
        changed = resume(driver, [p.pid for p in procs], timing=timing)
    except QuiesceError as exc:
        raise GpusnapError(f"thaw of {ctr.name} failed: {exc}",
                           "check free GPU memory with `gpusnap gpus`, then thaw again") from None
    frozen.unmark(ctr.pid)
    journal.record("thawed", container=ctr.id, pids=changed, timing=timing.phases)
    return {"container": ctr.name, "pids": changed, "timing": timing.phases,
            "gpu_memory_used_after": _gpu_used()}
