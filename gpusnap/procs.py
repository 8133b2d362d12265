"""Host processes: the tree CRIU dumps and which of its members use an NVIDIA GPU.

Everything here reads /proc of the host (the caller's pid namespace), which is
also the namespace the CUDA checkpoint API takes pids in.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

PROC = Path("/proc")
_NVIDIA_GPU_NODE = re.compile(r"^/dev/nvidia(\d+)$")


def _children_map(proc: Path = PROC) -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # exited while we looked
        # The command name may hold spaces and parentheses: split after the last ')'.
        fields = stat[stat.rfind(")") + 2 :].split()
        children.setdefault(int(fields[1]), []).append(int(entry.name))
    return children


def process_tree(root: int, proc: Path = PROC) -> list[int]:
    """The pids of ``root`` and all its descendants, root first."""
    children = _children_map(proc)
    tree, todo = [], [root]
    while todo:
        pid = todo.pop(0)
        tree.append(pid)
        todo.extend(sorted(children.get(pid, [])))
    return tree


def alive(pid: int) -> bool:
    return (PROC / str(pid)).exists()


@dataclass
class ProcessGpuUse:
    """What one process holds of the NVIDIA driver, read from /proc."""

    pid: int
    comm: str
    gpu_minors: list[int] = field(default_factory=list)
    opens_nvidia: bool = False  # any /dev/nvidia* fd (nvidiactl and uvm too)
    maps_libcuda: bool = False  # the CUDA driver library is loaded
    maps_nvidia: bool = False  # a /dev/nvidia* node is mapped (what CRIU cannot dump)

    @property
    def is_cuda(self) -> bool:
        # A checkpointed process has dropped its /dev/nvidia* fds but still maps libcuda.
        return self.opens_nvidia or self.maps_libcuda

    @property
    def holds_driver(self) -> bool:
        """Holds an fd or a mapping of the driver's nodes: CRIU can dump neither,
        so only a process the driver checkpoints (it drops both) can be dumped."""
        return self.opens_nvidia or self.maps_nvidia


def gpu_use(pid: int, proc: Path = PROC) -> ProcessGpuUse | None:
    """GPU use of one process, or None if it is gone."""
    base = proc / str(pid)
    try:
        comm = (base / "comm").read_text().strip()
    except OSError:
        return None
    use = ProcessGpuUse(pid=pid, comm=comm)
    minors: set[int] = set()
    try:
        for fd in (base / "fd").iterdir():
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("/dev/nvidia"):
                use.opens_nvidia = True
                m = _NVIDIA_GPU_NODE.match(target)
                if m:
                    minors.add(int(m.group(1)))
    except OSError:
        pass  # no permission or gone: maps may still tell
    try:
        with open(base / "maps", encoding="utf-8", errors="replace") as maps:
            for line in maps:
                use.maps_libcuda = use.maps_libcuda or "libcuda.so" in line
                use.maps_nvidia = use.maps_nvidia or " /dev/nvidia" in line
    except OSError:
        pass
    use.gpu_minors = sorted(minors)
    return use


def cuda_processes(root: int, proc: Path = PROC) -> list[ProcessGpuUse]:
    """The processes of the tree under ``root`` that use CUDA."""
    found = []
    for pid in process_tree(root, proc):
        use = gpu_use(pid, proc)
        if use is not None and use.is_cuda:
            found.append(use)
    return found


def rss_bytes(pids: list[int], proc: Path = PROC) -> int:
    """Resident memory of the given processes (an estimate of a dump's size)."""
    total = 0
    page = os.sysconf("SC_PAGE_SIZE")
    for pid in pids:
        try:
            total += int((proc / str(pid) / "statm").read_text().split()[1]) * page
        except (OSError, IndexError, ValueError):
            continue
    return total


def _stat_after_comm(pid: int) -> list[str] | None:
    """/proc/PID/stat's fields from the state on (field 3), past the command name,
    which may hold spaces and parentheses; None when the process is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def cgroup_of(pid: int, controller: str, root: Path = Path("/sys/fs/cgroup"),
              proc: Path = PROC) -> tuple[Path, int] | None:
    """The cgroup folder that holds ``pid`` for ``controller``, and its version:
    the v1 hierarchy that has the controller, else the unified one (2); None
    where /proc names neither. OSError: no such process."""
    v1 = v2 = None
    for line in (proc / str(pid) / "cgroup").read_text().splitlines():
        hierarchy, controllers, path = line.split(":", 2)
        if controller in controllers.split(","):
            v1 = path
        elif hierarchy == "0":
            v2 = path
    if v1 is not None:
        return root / controller / v1.lstrip("/"), 1
    if v2 is not None:
        return root / v2.lstrip("/"), 2
    return None


def parent_of(pid: int) -> int | None:
    """The parent's pid (/proc/PID/stat field 4); None when the process is gone."""
    fields = _stat_after_comm(pid)
    return None if fields is None else int(fields[1])


def stopped(pid: int) -> bool:
    """Whether ``pid`` is stopped (SIGSTOP, SIGTSTP: state T). A tracing stop
    (t, CRIU's seize) is not counted; a process gone is not stopped."""
    fields = _stat_after_comm(pid)
    return fields is not None and fields[0] == "T"


def age_s(pid: int) -> float | None:
    """Seconds since the process started (its start time against /proc/uptime)."""
    started = start_time(pid)
    try:
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return None if started is None else uptime - started / os.sysconf("SC_CLK_TCK")


def traced_by_criu(pid: int, proc: Path = PROC) -> bool:
    """CRIU holds it under ptrace, mid-dump (TracerPid's comm is criu; a
    debugger or strace is not a dump in flight)."""
    try:
        for line in (proc / str(pid) / "status").read_text().splitlines():
            if line.startswith("TracerPid:"):
                tracer = line.split()[1]
                return tracer != "0" and \
                    (proc / tracer / "comm").read_text().strip() == "criu"
    except (OSError, IndexError):
        pass
    return False


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22):
    with the pid, it names one process, not whichever reuses the number later."""
    fields = _stat_after_comm(pid)
    return None if fields is None else int(fields[19])


def runs_as(pid: int, started: int | None) -> bool:
    """Whether ``pid`` is still the process that started at ``started``
    (start_time) and has not exited: a zombie, killed but not yet reaped by its
    parent, does no more work."""
    fields = _stat_after_comm(pid)
    return fields is not None and started is not None and fields[0] not in ("Z", "X") \
        and int(fields[19]) == started


def ns_pid(pid: int) -> int:
    """The pid of a process in its own pid namespace (the container's): CRIU's images use it."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("NSpid:"):
            return int(line.split()[-1])
    return pid


def ancestors(pid: int) -> Iterator[int]:
    """``pid``, its parent, and on up while each is there (pid 1's parent is
    0): at most 64, far deeper than any tree between a task and its
    container's init, or between gpusnap's CLI and CRIU's action script."""
    at: int | None = pid
    for _ in range(64):
        if not at:
            return
        yield at
        at = parent_of(at)


def ns_init(pid: int) -> int | None:
    """The host pid of the first ancestor that is pid 1 of its namespace: a
    container process's init (a host process's is 1). None when it is gone."""
    for at in ancestors(pid):
        try:
            if ns_pid(at) == 1:
                return at
        except OSError:
            return None
    return None
