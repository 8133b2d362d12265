"""The NVIDIA driver's process checkpoint API (cuCheckpointProcess*), through ctypes.

ctypes over libcuda.so.1 keeps gpusnap independent of the cuda-bindings
release in use (13.3.0 lost the restore-args struct; 13.3.1 brought it back),
and needs nothing but the driver. All argument structs are 64 bytes in the
driver ABI (r570+); restore args carry GPU UUID pairs from r580 on.
"""

from __future__ import annotations

import atexit
import ctypes
import enum
import os
import threading
from dataclasses import dataclass

from typing import Callable

from gpusnap.errors import GpusnapError
from gpusnap.gpu import driver_calls
from gpusnap.gpu.driver_calls import WEDGED, Call
from gpusnap.procs import stopped
from gpusnap.waits import Bound

CUDA_SUCCESS = 0


class ProcessHalted(GpusnapError):
    """A process the driver cannot be asked about: it answers for a process only
    while that process runs, and waits for it otherwise (driver 580: a query
    about a SIGSTOPped process returned only once it was continued)."""


class ProcessState(enum.IntEnum):
    # RUNNING is 0, so a state is falsy: compare with `is None`, never truth-test.
    RUNNING = 0
    LOCKED = 1
    CHECKPOINTED = 2
    FAILED = 3


class _LockArgs(ctypes.Structure):
    _fields_ = [("timeoutMs", ctypes.c_uint), ("reserved0", ctypes.c_uint),
                ("reserved1", ctypes.c_uint64 * 7)]


class _ReservedArgs(ctypes.Structure):  # checkpoint and unlock args: reserved only
    _fields_ = [("reserved", ctypes.c_uint64 * 8)]


class _Uuid(ctypes.Structure):
    _fields_ = [("bytes", ctypes.c_ubyte * 16)]


class _GpuPair(ctypes.Structure):
    _fields_ = [("oldUuid", _Uuid), ("newUuid", _Uuid)]


class _RestoreArgs(ctypes.Structure):
    _fields_ = [("gpuPairs", ctypes.POINTER(_GpuPair)), ("gpuPairsCount", ctypes.c_uint),
                ("reserved", ctypes.c_ubyte * (64 - 8 - 4))]


assert ctypes.sizeof(_LockArgs) == 64 and ctypes.sizeof(_RestoreArgs) == 64


@dataclass(frozen=True)
class CudaError(Exception):
    """A driver call that failed, with the driver's own name for the error."""

    call: str
    pid: int
    code: int
    name: str

    def __str__(self) -> str:
        return f"{self.call}(pid {self.pid}) failed: {self.name} ({self.code})"


def uuid_bytes(uuid: str) -> bytes:
    """'GPU-8c6f...-...' (NVML's form) -> the 16 raw bytes the driver wants."""
    hexdigits = uuid.removeprefix("GPU-").replace("-", "")
    raw = bytes.fromhex(hexdigits)
    if len(raw) != 16:
        raise ValueError(f"not a GPU UUID: {uuid!r}")
    return raw


# Where driver libraries live when they are not in the loader's cache (some
# GPU VMs mount them read-only under /usr/local/nvidia).
LIBCUDA_CANDIDATES = ("libcuda.so.1", "/usr/local/nvidia/lib64/libcuda.so.1",
                      "/usr/local/nvidia/lib/libcuda.so.1",
                      "/usr/lib/x86_64-linux-gnu/libcuda.so.1")


def _load(library: str | None) -> ctypes.CDLL:
    candidates = [library] if library else [os.environ.get("GPUSNAP_LIBCUDA") or ""] + list(
        LIBCUDA_CANDIDATES)
    errors = []
    for name in filter(None, candidates):
        try:
            return ctypes.CDLL(name)
        except OSError as exc:
            errors.append(str(exc))
    raise RuntimeError("cannot load the NVIDIA driver library libcuda.so.1: " + "; ".join(errors[:1]))


class CudaDriver:
    """One loaded driver; thread-safe (the driver serialises per process)."""

    def __init__(self, library: str | None = None) -> None:
        self._lib = _load(library)
        for name in ("cuCheckpointProcessLock", "cuCheckpointProcessCheckpoint",
                     "cuCheckpointProcessRestore", "cuCheckpointProcessUnlock",
                     "cuCheckpointProcessGetState"):
            if not hasattr(self._lib, name):
                raise RuntimeError(
                    f"the NVIDIA driver has no {name}: checkpoint needs driver r570 or newer")
        self._init_lock = threading.Lock()
        self._initialised = False
        self._init_call: Call | None = None
        # calls left behind at their bound, by pid: the driver serialises a
        # process's calls, so a later one would only wait behind it
        self._left: dict[int, tuple[Call, str]] = {}

    def init(self) -> None:
        """cuInit now (else at the first call): an agent loads it ahead."""
        self._init()

    def _init(self) -> None:
        with self._init_lock:
            if not self._initialised:
                self._check(self._bounded_init(), "cuInit", 0)
                self._initialised = True

    def _bounded_init(self) -> int:
        """cuInit's code, waited for as long as Bound DRIVER; past the bound, later
        calls fail at once rather than wait on the same cuInit again."""
        if self._init_call is None:
            self._init_call = Call("gpusnap-cuinit", lambda: self._lib.cuInit(0))
        call = self._init_call
        code = call.code(0 if driver_calls.is_hung(call) else Bound.of("DRIVER").seconds)
        if code is None:
            raise self._expired(call, "the NVIDIA driver's cuInit")
        self._init_call = None
        return code

    @staticmethod
    def _expired(call: Call, what: str, bound: Bound | None = None,
                 hint: str = "nothing was changed by the wait") -> GpusnapError:
        driver_calls.left_behind(call)
        return (bound or Bound.of("DRIVER")).expired(
            what, f"{WEDGED}; {hint}")

    def _ask(self, name: str, what: str, pid: int, bound: Bound, call: Callable[[], int]) -> None:
        """One checkpoint-API call about ``pid`` on a thread of its own, waited for
        as long as ``bound``: an error for the driver's error or for no answer.
        A pid whose earlier call was left behind is not asked again meanwhile."""
        left = self._left.get(pid)
        if left is not None and left[0].thread.is_alive():
            raise Bound.of("DRIVER").expired(
                f"the NVIDIA driver's {left[1]} of process {pid} (still without an answer)",
                f"{WEDGED}; `gpusnap doctor` shows the process's state once it answers")
        self._init()
        asked = Call(f"gpusnap-{what}", call)
        code = asked.code(bound.seconds)
        if code is None:
            self._left[pid] = (asked, what)
            raise self._expired(asked, f"the NVIDIA driver's {what} of process {pid}", bound,
                                "the call may still complete: `gpusnap doctor` shows the "
                                "process's state once the driver answers")
        self._check(code, name, pid)

    def landed(self, pid: int, seconds: float) -> bool:
        """Whether the call about ``pid`` left behind at its bound has answered,
        waited for up to ``seconds``: a rollback puts its process back once it
        has (quiesce.py). True at once where none was left behind."""
        left = self._left.get(pid)
        return left is None or left[0].landed(seconds)

    def _error_name(self, code: int) -> str:
        name = ctypes.c_char_p()
        if self._lib.cuGetErrorName(code, ctypes.byref(name)) == CUDA_SUCCESS and name.value:
            return name.value.decode()
        return f"CUDA error {code}"

    def _check(self, code: int, call: str, pid: int) -> None:
        if code != CUDA_SUCCESS:
            raise CudaError(call, pid, code, self._error_name(code))

    def state(self, pid: int) -> ProcessState:
        """The driver's state of ``pid``: refused for a stopped process (ProcessHalted)
        and bounded by DRIVER, for one that stops meanwhile or a wedged driver."""
        if stopped(pid):
            raise ProcessHalted(f"process {pid} is stopped: the NVIDIA driver answers for a "
                                "process only while it runs", f"`kill -CONT {pid}`")
        st = ctypes.c_int()
        self._ask("cuCheckpointProcessGetState", "state", pid, Bound.of("DRIVER"),
                  lambda: self._lib.cuCheckpointProcessGetState(pid, ctypes.byref(st)))
        return ProcessState(st.value)

    # The calls that move a process's GPU memory (or wait for its GPU work, the
    # lock) are bounded by DRIVER_MOVE: seconds for tens of GiB on a healthy GPU.

    def lock(self, pid: int, timeout_ms: int) -> None:
        args = _LockArgs(timeoutMs=timeout_ms)
        move = Bound.of("DRIVER_MOVE")  # and the lock's own timeout, however it is set
        self._ask("cuCheckpointProcessLock", "lock", pid,
                  Bound(move.name, move.seconds + timeout_ms / 1000),
                  lambda: self._lib.cuCheckpointProcessLock(pid, ctypes.byref(args)))

    def checkpoint(self, pid: int) -> None:
        args = _ReservedArgs()
        self._ask("cuCheckpointProcessCheckpoint", "checkpoint", pid, Bound.of("DRIVER_MOVE"),
                  lambda: self._lib.cuCheckpointProcessCheckpoint(pid, ctypes.byref(args)))

    def restore(self, pid: int, gpu_pairs: list[tuple[str, str]] | None = None) -> None:
        """Bring GPU state back; ``gpu_pairs`` (old UUID, new UUID) remaps GPUs (r580+)."""
        args = _RestoreArgs()
        if gpu_pairs:
            pairs = (_GpuPair * len(gpu_pairs))()
            for i, (old, new) in enumerate(gpu_pairs):
                ctypes.memmove(pairs[i].oldUuid.bytes, uuid_bytes(old), 16)
                ctypes.memmove(pairs[i].newUuid.bytes, uuid_bytes(new), 16)
            # the cast pointer keeps `pairs` alive, and args keeps it, for the call's thread
            args.gpuPairs = ctypes.cast(pairs, ctypes.POINTER(_GpuPair))
            args.gpuPairsCount = len(gpu_pairs)
        self._ask("cuCheckpointProcessRestore", "restore", pid, Bound.of("DRIVER_MOVE"),
                  lambda: self._lib.cuCheckpointProcessRestore(pid, ctypes.byref(args)))

    def unlock(self, pid: int) -> None:
        args = _ReservedArgs()
        self._ask("cuCheckpointProcessUnlock", "unlock", pid, Bound.of("DRIVER_MOVE"),
                  lambda: self._lib.cuCheckpointProcessUnlock(pid, ctypes.byref(args)))


class DriverAhead:
    """The driver, loaded and initialised (cuInit) on a thread while other work
    goes on (CRIU's steps for the agent, Podman's import for the CLI): a step
    that needs it later finds it ready instead of waiting for both."""

    SETTLE_S = 30.0

    def __init__(self) -> None:
        self._ready = threading.Event()
        self._driver: CudaDriver | None = None
        # A process that exits early (a failed restore) waits for the load first:
        # libcuda's exit handlers must not run under a cuInit still in flight.
        atexit.register(self._ready.wait, self.SETTLE_S)
        threading.Thread(target=self._load, name="gpusnap-cuda-ahead", daemon=True).start()

    def _load(self) -> None:
        try:
            driver = CudaDriver()
            driver.init()
            self._driver = driver
        except Exception:  # noqa: BLE001 -- whoever calls get() loads it itself and says why
            pass
        finally:
            self._ready.set()

    def get(self) -> CudaDriver | None:
        """The driver once loaded; None where it could not be (no driver here),
        or where the load outlasts SETTLE_S (cuInit takes well under a second):
        the caller then loads it itself, rather than wait here."""
        self._ready.wait(self.SETTLE_S)
        return self._driver
