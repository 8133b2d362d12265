"""Test doubles shared by the unit tests: a CUDA driver and a /proc tree on disk."""

from __future__ import annotations

import threading
from pathlib import Path

from gpusnap.gpu.cuda import CudaError, ProcessState
from gpusnap.gpu.inventory import GpuInfo, Inventory

# What each driver call needs and leaves, as cuCheckpointProcess* enforces it.
_TRANSITIONS = {
    "lock": (ProcessState.RUNNING, ProcessState.LOCKED),
    "checkpoint": (ProcessState.LOCKED, ProcessState.CHECKPOINTED),
    "restore": (ProcessState.CHECKPOINTED, ProcessState.LOCKED),
    "unlock": (ProcessState.LOCKED, ProcessState.RUNNING),
}
_CALLS = {"lock": "cuCheckpointProcessLock", "checkpoint": "cuCheckpointProcessCheckpoint",
          "restore": "cuCheckpointProcessRestore", "unlock": "cuCheckpointProcessUnlock",
          "state": "cuCheckpointProcessGetState"}
_CODES = {"CUDA_ERROR_INVALID_VALUE": 1, "CUDA_ERROR_OUT_OF_MEMORY": 2,
          "CUDA_ERROR_NOT_INITIALIZED": 3, "CUDA_ERROR_TIMEOUT": 909,
          "CUDA_ERROR_ILLEGAL_STATE": 401, "CUDA_ERROR_NOT_SUPPORTED": 801,
          "CUDA_ERROR_OPERATING_SYSTEM": 304}


class FakeDriver:
    """Stands in for gpusnap.gpu.cuda.CudaDriver: a state machine per pid.

    ``fail`` maps (call, pid) to a CUDA error name that call returns; a call in
    the wrong state fails with CUDA_ERROR_ILLEGAL_STATE, as the driver does.
    Pids not in ``states`` are not CUDA processes for the driver.
    """

    def __init__(self, states: dict[int, ProcessState],
                 fail: dict[tuple[str, int], str] | None = None,
                 on_call=None) -> None:
        self.states = dict(states)
        self.fail = dict(fail or {})
        self.calls: list[tuple[str, int]] = []
        self.lock_timeouts: dict[int, int] = {}
        self.gpu_pairs: dict[int, list[tuple[str, str]] | None] = {}
        self.on_call = on_call  # on_call(call, pid), outside the driver's lock
        self._mutex = threading.Lock()

    def _error(self, call: str, pid: int, name: str) -> CudaError:
        return CudaError(_CALLS[call], pid, _CODES[name], name)

    def _step(self, call: str, pid: int) -> None:
        if self.on_call is not None:
            self.on_call(call, pid)
        with self._mutex:
            self.calls.append((call, pid))
            if (call, pid) in self.fail:
                raise self._error(call, pid, self.fail[(call, pid)])
            if pid not in self.states:
                raise self._error(call, pid, "CUDA_ERROR_INVALID_VALUE")
            need, leave = _TRANSITIONS[call]
            if self.states[pid] != need:
                raise self._error(call, pid, "CUDA_ERROR_ILLEGAL_STATE")
            self.states[pid] = leave

    def state(self, pid: int) -> ProcessState:
        with self._mutex:
            self.calls.append(("state", pid))
            if ("state", pid) in self.fail:
                raise self._error("state", pid, self.fail[("state", pid)])
            if pid not in self.states:
                raise self._error("state", pid, "CUDA_ERROR_NOT_INITIALIZED")
            return self.states[pid]

    def lock(self, pid: int, timeout_ms: int) -> None:
        self.lock_timeouts[pid] = timeout_ms
        self._step("lock", pid)

    def checkpoint(self, pid: int) -> None:
        self._step("checkpoint", pid)

    def restore(self, pid: int, gpu_pairs: list[tuple[str, str]] | None = None) -> None:
        self.gpu_pairs[pid] = gpu_pairs
        self._step("restore", pid)

    def unlock(self, pid: int) -> None:
        self._step("unlock", pid)

    def landed(self, pid: int, seconds: float) -> bool:
        return True  # no call is ever left in flight here

    def called(self, call: str) -> list[int]:
        return sorted(pid for c, pid in self.calls if c == call)


def gpu(index: int, uuid: str, name: str = "NVIDIA H100 80GB HBM3", minor: int | None = None,
        memory_used: int = 0) -> GpuInfo:
    return GpuInfo(index=index, uuid=uuid, name=name, minor=index if minor is None else minor,
                   pci_bus_id=f"00000000:{index + 0x18:02X}:00.0", memory_total=80 << 30,
                   memory_used=memory_used, compute_capability="9.0")


UUID0 = "GPU-11111111-2222-3333-4444-555555555555"
UUID1 = "GPU-66666666-7777-8888-9999-aaaaaaaaaaaa"
UUID2 = "GPU-bbbbbbbb-cccc-dddd-eeee-ffffffffffff"


def inventory(*gpus: GpuInfo, driver: str = "580.159.04",
              process_memory: dict[int, dict[str, int]] | None = None) -> Inventory:
    return Inventory(driver_version=driver, cuda_driver_version="13.0", gpus=list(gpus),
                     process_memory=process_memory or {})


def fake_proc(root: Path, pid: int, ppid: int, comm: str = "sh", fds: dict[int, str] | None = None,
              maps: str = "", statm: str | None = "1000 250 100 1 0 200 0") -> Path:
    """A /proc/<pid> directory as procs.py reads it (stat, comm, fd/, maps, statm)."""
    base = root / str(pid)
    (base / "fd").mkdir(parents=True)
    (base / "stat").write_text(f"{pid} ({comm}) S {ppid} {pid} {pid} 0 -1 4194304 0 0\n")
    (base / "comm").write_text(comm + "\n")
    for fd, target in (fds or {}).items():
        (base / "fd" / str(fd)).symlink_to(target)
    (base / "maps").write_text(maps)
    if statm is not None:
        (base / "statm").write_text(statm + "\n")
    return base
