"""CRIU's memory pages in RAM (/dev/shm) instead of on disk, where the host can spare it.

At 32 GiB of GPU memory CRIU's pages are 36.7 GB. Written to the disk they
are throttled to its writeback (~0.8-1.4 GB/s on the H100 hosts: ~30-48 s of
a migration's stop on the source, and on the target the same again before
CRIU reads them back); written to a tmpfs they move at memory speed. Both
ends only hold them for the length of a migration: the source until the push
has read them, the target until CRIU has restored them into the process.

A tmpfs takes memory the kernel cannot reclaim (no swap on these hosts), so
RAM is used only where the host keeps a reserve beside everything the step
will hold at once: on the source the pages and the GPU memory the driver
moves into the process first; on the target the pages file and the restored
process (CRIU reads one into the other). Elsewhere the pages go to the disk
as before. GPUSNAP_PAGES_RAM=0 never uses RAM; =1 skips the memory check
(/dev/shm must still have the room).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

RAM_ROOT = Path("/dev/shm")
ENV = "GPUSNAP_PAGES_RAM"
MIN_RESERVE = 2 << 30


def meminfo(path: Path = Path("/proc/meminfo")) -> dict[str, int]:
    """/proc/meminfo in bytes (MemTotal, MemAvailable, ...); {} where unreadable."""
    out: dict[str, int] = {}
    try:
        for line in path.read_text().splitlines():
            key, _, rest = line.partition(":")
            fields = rest.split()
            if fields and fields[0].isdigit():
                out[key] = int(fields[0]) * (1024 if fields[1:] == ["kB"] else 1)
    except OSError:
        return {}
    return out


def reserve(total: int) -> int:
    """Memory left to everything else: a sixteenth of the host, at least 2 GiB."""
    return max(MIN_RESERVE, total // 16)


def ram_dir(size: int, held_too: int = 0, info: dict[str, int] | None = None,
            root: Path = RAM_ROOT) -> Path | None:
    """``root`` (/dev/shm) for ``size`` bytes of pages, where it has the room and
    the host can hold them and ``held_too`` more bytes at once with its reserve
    left; None: the disk."""
    mode = os.environ.get(ENV, "auto")
    if mode == "0" or size <= 0:
        return None
    try:
        if not root.is_dir() or shutil.disk_usage(root).free < size + (64 << 20):
            return None
    except OSError:
        return None
    if mode == "1":
        return root
    info = meminfo() if info is None else info
    total, available = info.get("MemTotal", 0), info.get("MemAvailable", 0)
    if not total or available < size + held_too + reserve(total):
        return None
    return root


def in_ram(path: Path, root: Path = RAM_ROOT) -> bool:
    """``path`` lies in ``root`` (a folder ram_dir gave)."""
    return Path(os.path.realpath(path)).is_relative_to(os.path.realpath(root))
