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
from gpusnap.gpu.inventory import Inventory, read_inventory
from gpusnap.gpu.plan import gib
from gpusnap.gpu.quiesce import Driver, QuiesceError, Timing, quiesce, refused_for_good, resume
from gpusnap.gpu.turn import wait_turn
from gpusnap.ops import frozen, moving
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
        _same_after_the_wait(ctr, verb, command)
        procs, driver = cuda_of(ctr, verb, command)
        if command != "thaw":
            # a freeze again would record no pids (doctor would then restore them); a
            # move would resume them onto the new GPU: a thaw behind the user's back
            frozen.refuse(ctr.name, procs, verb)
        # a move cut off: only its undo knows which GPUs the processes belong on
        moving.refuse(ctr.pid, ctr.name, verb)
        yield ctr, procs, driver


def _same_after_the_wait(ctr: podman.Container, verb: str, command: str) -> None:
    """The turn is keyed by the init pid read before the wait: a container
    stopped, restored or restarted meanwhile is another set of processes."""
    now = podman.inspect(ctr.id)
    require_running(now, verb)
    if now.pid != ctr.pid:
        raise GpusnapError(f"{ctr.name} was restarted or restored while the {command} waited "
                           "for its turn; nothing was changed",
                           f"run the same `gpusnap {command}` again")


def _gpu_used() -> dict[str, int]:
    return {g.uuid: g.memory_used for g in read_inventory().gpus}


def freeze(name: str, lock_timeout_ms: int) -> dict:
    with gpu_turn(name, "be frozen", "freeze") as (ctr, procs, driver):
        return _freeze(ctr, procs, driver, lock_timeout_ms)


def _held(inv: Inventory, pids: list[int]) -> dict[str, int]:
    """GPU UUID -> bytes ``pids`` hold there, as NVML sees them."""
    held: dict[str, int] = {}
    for pid in pids:
        for uuid, used in inv.process_memory.get(pid, {}).items():
            held[uuid] = held.get(uuid, 0) + used
    return held


def _freeze(ctr: podman.Container, procs: list, driver: Driver, lock_timeout_ms: int) -> dict:
    inv = read_inventory()
    before = {g.uuid: g.memory_used for g in inv.gpus}
    timing = Timing()
    try:
        changed = quiesce(driver, [p.pid for p in procs], lock_timeout_ms, timing)
    except QuiesceError as exc:
        raise GpusnapError(f"freeze of {ctr.name} failed, nothing changed: {exc}",
                           "a process may be stuck in a long kernel; retry with a longer "
                           "--timeout") from None
    # off the GPU on purpose (doctor leaves them); what they held is what a thaw needs free
    frozen.mark(ctr.pid, ctr.name, changed, _held(inv, changed))
    journal.record("frozen", container=ctr.id, pids=changed, timing=timing.phases)
    return {"container": ctr.name, "pids": changed, "timing": timing.phases,
            "gpu_memory_used_before": before, "gpu_memory_used_after": _gpu_used()}


def thaw(name: str) -> dict:
    with gpu_turn(name, "be thawed", "thaw") as (ctr, procs, driver):
        return _thaw(ctr, procs, driver)


def _room_for(name: str, needs: dict[str, int], inv: Inventory) -> None:
    """Refuse a thaw the GPU has no room for, before the driver is asked: driver
    580 refuses a process for good once its restore failed for memory, and a
    frozen container has no other way back."""
    if inv.error:
        return  # NVML unreadable: the driver's own answer is all there is
    for uuid, need in sorted(needs.items()):
        gpu = inv.by_uuid(uuid)
        if gpu is None:
            raise GpusnapError(f"{name} was frozen on GPU {uuid}, which this host no longer "
                               "has; it stays frozen", "`gpusnap gpus` lists this host's GPUs")
        free = max(gpu.memory_total - gpu.memory_used, 0)
        if need > free:
            raise GpusnapError(
                f"GPU {gpu.index} has {gib(free)} free and {name}'s frozen processes need "
                f"{gib(need)}; it stays frozen, nothing was changed",
                f"free GPU {gpu.index}'s memory (`gpusnap gpus` shows its use), then "
                f"`gpusnap thaw {name}`")


def _thaw(ctr: podman.Container, procs: list, driver: Driver) -> dict:
    _room_for(ctr.name, frozen.needs(ctr.pid), read_inventory())
    timing = Timing()
    try:
        changed = resume(driver, [p.pid for p in procs], timing=timing)
    except QuiesceError as exc:
        if refused_for_good(str(exc)):  # a thaw again would be refused the same
            raise GpusnapError(f"thaw of {ctr.name} failed and the driver will not take its "
                               f"processes back: {exc}",
                               f"their GPU state is lost: `podman restart {ctr.name}` starts "
                               "it afresh") from None
        raise GpusnapError(f"thaw of {ctr.name} failed: {exc}",
                           "check free GPU memory with `gpusnap gpus`, then thaw again") from None
    frozen.unmark(ctr.pid)
    journal.record("thawed", container=ctr.id, pids=changed, timing=timing.phases)
    return {"container": ctr.name, "pids": changed, "timing": timing.phases,
            "gpu_memory_used_after": _gpu_used()}
