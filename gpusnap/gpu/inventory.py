"""What NVIDIA GPUs this host has, read through NVML (nvidia-ml-py)."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from gpusnap.gpu import driver_calls
from gpusnap.waits import Bound

_NVML = "gpusnap-nvml"


@dataclass
class GpuInfo:
    index: int
    uuid: str
    name: str
    minor: int
    pci_bus_id: str
    memory_total: int
    memory_used: int
    compute_capability: str
    mig_enabled: bool = False

    @property
    def device_node(self) -> str:
        return f"/dev/nvidia{self.minor}"


@dataclass
class Inventory:
    """The host's GPUs; ``error`` says why there are none when NVML is unusable."""

    driver_version: str | None = None
    cuda_driver_version: str | None = None
    gpus: list[GpuInfo] = field(default_factory=list)
    # pid -> {gpu uuid: bytes used}, for compute processes NVML sees
    process_memory: dict[int, dict[str, int]] = field(default_factory=dict)
    error: str | None = None
    # NVML did not answer within its bound: the GPUs are there but unread
    unanswered: bool = False

    def by_minor(self, minor: int) -> GpuInfo | None:
        return next((g for g in self.gpus if g.minor == minor), None)

    def by_uuid(self, uuid: str) -> GpuInfo | None:
        return next((g for g in self.gpus if g.uuid == uuid), None)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["process_memory"] = {str(k): v for k, v in self.process_memory.items()}
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Inventory:
        return cls(driver_version=d.get("driver_version"),
                   cuda_driver_version=d.get("cuda_driver_version"),
                   gpus=[GpuInfo(**g) for g in d.get("gpus") or []],
                   process_memory={int(k): v for k, v in (d.get("process_memory") or {}).items()},
                   error=d.get("error"), unanswered=bool(d.get("unanswered")))


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def mps_active() -> bool:
    """An MPS control daemon is running (the driver cannot checkpoint MPS clients)."""
    pipe_dir = Path(os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps"))
    return (pipe_dir / "control").exists()


def read_inventory(bound: Bound | None = None) -> Inventory:
    """Query NVML; never raises: a host without a driver gets ``error`` set, and
    so does one whose driver does not answer within ``bound`` (DRIVER unless
    given; NVML waits on a wedged GPU as libcuda does; later reads in this
    process then fail at once)."""
    try:
        import pynvml  # optional (nvidia-ml-py), and start-up: NVML only where it is read
    except ImportError:
        return Inventory(error="nvidia-ml-py is not installed")
    bound = bound or Bound.of("DRIVER")
    wedged = f"NVML did not answer within {bound.seconds:.0f} s: {driver_calls.WEDGED}"
    if driver_calls.hung_named(_NVML):
        return Inventory(error=wedged, unanswered=True)
    call = driver_calls.Call(_NVML, lambda: _read(pynvml))
    inv = call.code(bound.seconds)
    if inv is None:
        driver_calls.left_behind(call)
        return Inventory(error=wedged, unanswered=True)
    return inv


def _read(pynvml) -> Inventory:
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
        return Inventory(error=f"no NVIDIA driver: {exc}")
    try:
        inv = Inventory(driver_version=_text(pynvml.nvmlSystemGetDriverVersion()))
        cuda = pynvml.nvmlSystemGetCudaDriverVersion()
        inv.cuda_driver_version = f"{cuda // 1000}.{cuda % 1000 // 10}"
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
            major, minor_cc = pynvml.nvmlDeviceGetCudaComputeCapability(handle)
            try:
                mig = pynvml.nvmlDeviceGetMigMode(handle)[0] == pynvml.NVML_DEVICE_MIG_ENABLE
            except pynvml.NVMLError:
                mig = False  # not a MIG-capable GPU
            gpu = GpuInfo(
                index=index,
                uuid=_text(pynvml.nvmlDeviceGetUUID(handle)),
                name=_text(pynvml.nvmlDeviceGetName(handle)),
                minor=pynvml.nvmlDeviceGetMinorNumber(handle),
                pci_bus_id=_text(pynvml.nvmlDeviceGetPciInfo(handle).busId),
                memory_total=mem.total,
                memory_used=mem.used,
                compute_capability=f"{major}.{minor_cc}",
                mig_enabled=mig,
            )
            inv.gpus.append(gpu)
            for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                used = proc.usedGpuMemory or 0
                inv.process_memory.setdefault(proc.pid, {})[gpu.uuid] = used
        return inv
    except pynvml.NVMLError as exc:
        return Inventory(error=f"NVML query failed: {exc}")
    finally:
        pynvml.nvmlShutdown()
