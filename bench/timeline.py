"""What the machine does while a case runs: a sampler thread for bench/gpu_scale.py.

Every ``every`` seconds one JSON line: seconds since start; bytes under Podman's
checkpoint dirs (CRIU's images), under gpusnap's push staging dirs (the export),
and under the registry's storage; dirty and writeback page cache; bytes the
disks wrote and read since start; CPU seconds used since the last sample by
each kind of process (criu, podman, gpusnap and its workers, registry, conmon,
the job). With it, a slow phase points at what was busy and what waited.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")
CHECKPOINTS = Path("/var/lib/containers/storage/overlay-containers")
STAGING = Path("/var/lib/containers")


def _tree_bytes(roots: list[Path]) -> int:
    total = 0
    for root in roots:
        for dirpath, _, names in os.walk(root):
            for n in names:
                try:
                    total += os.lstat(os.path.join(dirpath, n)).st_size
                except OSError:
                    pass
    return total


def _meminfo() -> dict[str, int]:
    out = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        key, rest = line.split(":", 1)
        if key in ("Dirty", "Writeback", "MemAvailable", "Shmem", "Cached"):
            out[key] = int(rest.split()[0]) << 10
    return out


def _disk_sectors() -> tuple[int, int]:
    """Sectors read and written by whole disks (not partitions, not loop/ram)."""
    rd = wr = 0
    for line in Path("/proc/diskstats").read_text().splitlines():
        f = line.split()
        name = f[2]
        if name.startswith(("loop", "ram", "dm-")) or (name[-1].isdigit() and
                                                        not name.startswith("nvme")):
            continue
        if name.startswith("nvme") and "p" in name[4:]:
            continue
        rd, wr = rd + int(f[5]), wr + int(f[9])
    return rd, wr


def _kind(comm: str, cmdline: str) -> str:
    if comm.startswith("criu") or "/criu" in cmdline.split(" ", 1)[0]:
        return "criu"
    if comm in ("podman", "conmon", "runc"):
        return comm
    if "registry" in comm or "registry" in cmdline.split(" ", 1)[0]:
        return "registry"
    if "gpusnap" in cmdline:
        return "gpusnap"
    if "multiprocessing" in cmdline or "spawn_main" in cmdline:
        return "gpusnap-workers"
    if "jobs.py" in cmdline:
        return "job"
    if comm in ("zstd", "tar", "oras"):
        return comm
    return "other"


def _cpu_by_kind() -> dict[str, float]:
    out: dict[str, float] = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(
                errors="replace")
        except OSError:
            continue
        comm = stat[stat.index("(") + 1:stat.rindex(")")]
        f = stat[stat.rindex(")") + 2:].split()
        secs = (int(f[11]) + int(f[12])) / TICK  # utime + stime of the process itself
        k = _kind(comm, cmd)
        out[k] = out.get(k, 0.0) + secs
    return out


class Timeline:
    """``with Timeline(path, registry_root):`` samples until the block ends."""

    def __init__(self, path: Path, registry_root: Path | None = None, every: float = 1.0) -> None:
        self.path, self.registry_root, self.every = path, registry_root, every
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> "Timeline":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        t0 = time.monotonic()
        rd0, wr0 = _disk_sectors()
        cpu0 = _cpu_by_kind()
        with open(self.path, "w") as out:
            while not self._stop.wait(self.every):
                rd, wr = _disk_sectors()
                cpu = _cpu_by_kind()
                # a process that ended takes its CPU with it: clamp at zero
                busy = {k: round(max(0.0, v - cpu0.get(k, 0.0)) / self.every, 2)
                        for k, v in cpu.items()}  # cores busy
                cpu0 = cpu
                row = {"t": round(time.monotonic() - t0, 2),
                       "criu_images": _tree_bytes(list(CHECKPOINTS.glob("*/userdata/checkpoint"))),
                       "staging": _tree_bytes(list(STAGING.glob(".gpusnap-push-*"))),
                       "registry": _tree_bytes([self.registry_root]) if self.registry_root else 0,
                       "disk_read": (rd - rd0) * 512, "disk_written": (wr - wr0) * 512,
                       "cpu": {k: v for k, v in busy.items() if v > 0.05},
                       **_meminfo()}
                out.write(json.dumps(row) + "\n")
                out.flush()


def summary(path: Path, step: float = 5.0) -> list[str]:
    """A line every ``step`` seconds: rates of images, staging, registry and disk, and CPU."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    lines, last = [], None
    for r in rows:
        if last is not None and r["t"] - last["t"] < step and r is not rows[-1]:
            continue
        if last is None:
            last = {**r, "t": 0.0, "criu_images": 0, "staging": 0, "registry": 0,
                    "disk_read": 0, "disk_written": 0}
        dt = max(r["t"] - last["t"], 1e-3)
        rate = {k: (r[k] - last[k]) / dt / 1e6 for k in
                ("criu_images", "staging", "registry", "disk_read", "disk_written")}
        lines.append(f"{r['t']:6.1f}s images {r['criu_images'] / 1e9:5.1f} GB ({rate['criu_images']:5.0f} MB/s) "
                     f"staging {rate['staging']:5.0f} registry {rate['registry']:5.0f} "
                     f"disk w {rate['disk_written']:5.0f} r {rate['disk_read']:5.0f} MB/s; "
                     f"dirty {r.get('Dirty', 0) / 1e9:4.1f} GB; cores " +
                     " ".join(f"{k} {v:.1f}" for k, v in sorted(r["cpu"].items(), key=lambda kv: -kv[1])))
        last = r
    return lines
