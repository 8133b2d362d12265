"""Freeze/thaw: release a container's GPU memory in place and take it back (no CRIU).

The processes keep running on the CPU; their CUDA calls block until thaw.
Each waits for the guardian of a checkpoint just taken (gpu/turn.py), which
would otherwise undo a freeze, or find a thaw's processes mid-restore.
"""

from __future__ import annotations

from gpusnap import journal
from gpusnap.errors import GpusnapError
from gpusnap.gpu.inventory import read_inventory
from gpusnap.gpu.quiesce import QuiesceError, Timing, quiesce, resume
from gpusnap.gpu.turn import wait_turn
from gpusnap.ops.gpu_state import load_driver
from gpusnap.ops.preconditions import require_running
from gpusnap.procs import cuda_processes
from gpusnap.runtime import podman


def cuda_targets(name: str, verb: str, command: str):
    """The running container, its CUDA processes and the driver; one line if any
    is missing. ``verb``: what it must be able to do ("be frozen"); ``command``:
    the gpusnap command asked for, named in the hint."""
    ctr = podman.inspect(name)
    require_running(ctr, verb)
    procs = cuda_processes(ctr.pid)
    if not procs:
        raise GpusnapError(f"container {ctr.name} has no CUDA processes, so it cannot {verb}",
                           f"`gpusnap {command}` applies to containers that use an NVIDIA GPU; "
                           "`gpusnap checkpoint` takes any container")
    driver = load_driver()
    if driver is None:
        raise GpusnapError("the NVIDIA driver's checkpoint API is not available",
                           "install driver r570 or newer")
    return ctr, procs, driver


def _gpu_used() -> dict[str, int]:
    return {g.uuid: g.memory_used for g in read_inventory().gpus}


def freeze(name: str, lock_timeout_ms: int) -> dict:
    ctr, procs, driver = cuda_targets(name, "be frozen", "freeze")
    before = _gpu_used()
    timing = Timing()
    try:
        with wait_turn(ctr.pid, f"freeze of {ctr.name}"):
            changed = quiesce(driver, [p.pid for p in procs], lock_timeout_ms, timing)
    except QuiesceError as exc:
        raise GpusnapError(f"freeze of {ctr.name} failed, nothing changed: {exc}",
                           "a process may be stuck in a long kernel; retry with a longer "
                           "--timeout") from None
    journal.record("frozen", container=ctr.id, pids=changed, timing=timing.phases)
    return {"container": ctr.name, "pids": changed, "timing": timing.phases,
            "gpu_memory_used_before": before, "gpu_memory_used_after": _gpu_used()}


def thaw(name: str) -> dict:
    ctr, procs, driver = cuda_targets(name, "be thawed", "thaw")
    timing = Timing()
    try:
        with wait_turn(ctr.pid, f"thaw of {ctr.name}"):
            changed = resume(driver, [p.pid for p in procs], timing=timing)
    except QuiesceError as exc:
        raise GpusnapError(f"thaw of {ctr.name} failed: {exc}",
                           "check free GPU memory with `gpusnap gpus`, then thaw again") from None
    journal.record("thawed", container=ctr.id, pids=changed, timing=timing.phases)
    return {"container": ctr.name, "pids": changed, "timing": timing.phases,
            "gpu_memory_used_after": _gpu_used()}
