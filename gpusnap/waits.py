"""Every wait gpusnap makes on another program has a bound, named here.

A wait that runs out raises WaitExpired: one line that says what was waited
for and for how long. Each bound can be widened (or, in tests, shortened) with
``GPUSNAP_WAIT_<NAME>=SECONDS``, or with a ``NAME=SECONDS`` line in
/etc/gpusnap/waits.conf: the only way to reach the steps runc, CRIU and the
containerd shim run, whose environment is not the user's. The defaults are far
above what a healthy host takes, so they only ever end a hang.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, NoReturn, Sequence

from gpusnap.errors import GpusnapError

# name -> default seconds. A restore's and a checkpoint's bound grow with the
# bytes they move (Bound.for_bytes); the others are fixed.
DEFAULTS: dict[str, float] = {
    "PODMAN": 120.0,          # a Podman query: inspect, info, version, exists, rm
    "PODMAN_RESTORE": 600.0,  # podman container restore, plus RATE for its bytes
    "PODMAN_CHECKPOINT": 3600.0,  # a dump of a GPU process that holds 140 GB takes minutes
    "IMPORT_OPEN": 300.0,     # Podman's first open of the import stream
    "STOP": 15.0,             # a program asked to stop, before it is killed
    "REGISTRY": 120.0,        # a registry's answer, each try (oci/registry.py)
    "RUNC": 3600.0,           # a runc command the containerd shim runs (shim/runc.py)
    # the GPUs of a container's last checkpoint given back (gpu/turn.py): the
    # guardian's own bound on a freeze CRIU left (120 s), then the driver's restore
    "GPU_TURN": 180.0,
    "DRIVER": 120.0,          # the NVIDIA driver's cuInit and state query (seconds at most)
    # NVML in the OCI hook, which runc kills at hooks.d's 30 s: the shell front
    # may have spent 17 s on the agent first (packaging/bin/gpusnap-hook)
    "HOOK_NVML": 8.0,
    "RESUME_SETTLE": 30.0,    # the driver answering for a restored process (at once when healthy)
    # the driver's lock (plus its own timeout), checkpoint, restore or unlock of
    # one process: seconds for tens of GiB of GPU memory on a healthy GPU
    "DRIVER_MOVE": 900.0,
    # a driver call left at its bound in a quiesce that failed, waited for once
    # more by the rollback: a lock that lands later is undone then, not left LOCKED
    "DRIVER_LATE": 60.0,
    "PTRACE": 30.0,           # a thread of a container's process stopping under ptrace (µs)
    "DEVICES": 30.0,          # a child that mknods a running container's GPU nodes (ms)
}
# Bytes a second below which a big restore or checkpoint counts as hung: a
# twentieth of the slowest disk the benches saw, so only a stall reaches it.
RATE = 20 << 20


class WaitExpired(GpusnapError):
    """A bound ran out; ``message`` names what was waited for and how long."""


@dataclass(frozen=True)
class Bound:
    name: str
    seconds: float

    @classmethod
    def of(cls, name: str, extra: float = 0.0) -> "Bound":
        raw = os.environ.get(f"GPUSNAP_WAIT_{name}") or _configured(name)
        try:
            seconds = float(raw) if raw else DEFAULTS[name] + extra
        except ValueError:
            seconds = DEFAULTS[name] + extra
        if not math.isfinite(seconds):  # nan would never run out, inf never end a hang
            seconds = DEFAULTS[name] + extra
        return cls(name, max(seconds, 0.1))

    @classmethod
    def for_bytes(cls, name: str, size: int) -> "Bound":
        return cls.of(name, extra=size / RATE)

    def expired(self, what: str, hint: str | None = None) -> WaitExpired:
        return WaitExpired(f"{what}: no answer within {self.seconds:.0f} s",
                           hint or f"nothing was changed by the wait; if the host is just slow, "
                                   f"raise the bound ({raise_words(self.name)})")


def conf_path() -> Path:
    return Path(os.environ.get("GPUSNAP_WAITS_CONF") or "/etc/gpusnap/waits.conf")


def _configured(name: str) -> str | None:
    """NAME's value in waits.conf (NAME=SECONDS lines, # comments), if any."""
    try:
        text = conf_path().read_text()
    except OSError:
        return None
    found = None
    for line in text.splitlines():
        key, eq, value = line.split("#", 1)[0].partition("=")
        if eq and key.strip() == name:
            found = value.strip()
    return found


def raise_words(name: str) -> str:
    """How a user raises bound ``name``, wherever the process that waits runs."""
    return f"GPUSNAP_WAIT_{name}=SECONDS, or {name}=SECONDS in {conf_path()}"


def stop(proc: subprocess.Popen, grace: float | None = None) -> None:
    """SIGTERM, then SIGKILL after ``grace`` seconds: Podman cleans up on the first."""
    if proc.poll() is not None:
        return
    try:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=Bound.of("STOP").seconds if grace is None else grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    except ProcessLookupError:
        pass


def stop_tree(proc: subprocess.Popen, descendants: Callable[[int], list[int]]) -> None:
    """``proc`` and what it started (runc, CRIU under a Podman; ``descendants``
    names them): a Podman stopped alone leaves them working on the container it
    reported as failed. Signalled through pidfds taken at once: a pid reused in
    the grace is never hit."""
    fds = []
    for pid in descendants(proc.pid) if proc.poll() is None else []:
        with contextlib.suppress(OSError):
            fds.append(os.pidfd_open(pid))
    try:
        for fd in fds:
            with contextlib.suppress(OSError):
                signal.pidfd_send_signal(fd, signal.SIGTERM)
        stop(proc)
        for fd in fds:
            with contextlib.suppress(OSError):  # those the grace above did not end
                signal.pidfd_send_signal(fd, signal.SIGKILL)
    finally:
        for fd in fds:
            os.close(fd)


def run(argv: Sequence[str], what: str, bound: Bound,
        watch: Callable[[], None] | None = None, tick: float = 0.25,
        hint: str | None = None,
        progress: Callable[[], int] | None = None,
        tree: Callable[[int], list[int]] | None = None) -> subprocess.CompletedProcess:
    """``subprocess.run(argv, capture_output=True, text=True)`` that ends within
    ``bound``. ``watch`` is called every ``tick`` seconds while it runs and may
    raise (the stream it reads has died, say): the program is stopped first,
    then the error goes on. ``progress`` (bytes fed to it so far, say) restarts
    the bound whenever it moves: a restore that reads a slow download is not
    hung. Output is read all along, so a chatty program never blocks on a full
    pipe. ``tree`` (a pid's descendants): at the bound, what the program
    started is stopped too."""
    proc = subprocess.Popen(list(argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.monotonic() + bound.seconds
    moved = progress() if progress is not None else None
    try:
        while True:
            try:
                out, err = proc.communicate(timeout=tick)
                return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
            except subprocess.TimeoutExpired:
                pass
            if watch is not None:
                watch()
            if progress is not None and progress() != moved:
                moved, deadline = progress(), time.monotonic() + bound.seconds
            if time.monotonic() > deadline:
                raise bound.expired(what, hint)
    except BaseException as exc:
        if tree is not None and isinstance(exc, WaitExpired):
            stop_tree(proc, tree)
        else:
            stop(proc)
        # what is left in the pipes, so no reader of them hangs
        try:
            proc.communicate(timeout=Bound.of("STOP").seconds)
        except (subprocess.TimeoutExpired, ValueError, OSError):
            pass
        raise


def leave(code: int) -> NoReturn:
    """Exit with ``code``; by os._exit where a driver call of this process is in
    flight (gpu/driver_calls.py), since libcuda's exit handlers would wait on it and
    the process, holding CRIU or a command, would end only when it does."""
    calls = sys.modules.get("gpusnap.gpu.driver_calls")  # loaded only where the driver was
    if calls is not None and calls.driver_busy():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
