"""CRIU's memory pages in RAM (/dev/shm) instead of on disk, where the host can spare it.

CRIU's pages are a little more than the process's GPU memory. Written to the
disk they are throttled to its writeback (at tens of GiB, tens of seconds of
a migration's stop on the source, and on the target the same again before
CRIU reads them back: docs/benchmarks.md); written to a tmpfs they move at
memory speed. Both
ends only hold them for the length of a migration: the source until the push
has read them, the target until CRIU has restored them into the process.

A tmpfs takes memory the kernel cannot reclaim (GPU hosts often have no swap), so
RAM is used only where the host keeps a reserve beside everything the step
will hold at once: on the source the pages and the GPU memory the driver
moves into the process first; on the target the pages file and the restored
process (CRIU reads one into the other). Elsewhere the pages go to the disk. GPUSNAP_PAGES_RAM=0 never uses RAM; =1 skips the memory check
(the tmpfs must still have the room).

Which tmpfs: one of gpusnap's own, mounted on first use at /run/gpusnap/ram
with transparent huge pages (``huge=always``), else /dev/shm. CRIU writes
and reads its pages one 4 KiB page at a time through the page cache, and a
tmpfs of 4 KiB pages allocates, maps and looks up each one: with 2 MiB
folios it does so 512 times less often (docs/benchmarks.md, bench/page_io.py).
/dev/shm itself is left as the host has it (other programs share it).
GPUSNAP_PAGES_HUGE=0 uses /dev/shm.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from pathlib import Path
from typing import Callable

from gpusnap.pages import holds
from gpusnap.runtime.storage import staging_dir, storage_root

RAM_ROOT = Path("/dev/shm")
HUGE_ROOT = Path("/run/gpusnap/ram")
ENV = "GPUSNAP_PAGES_RAM"
HUGE_ENV = "GPUSNAP_PAGES_HUGE"
MIN_RESERVE = 2 << 30
# The tmpfs's own cap; ram_dir's memory check is what keeps the host's reserve.
HUGE_OPTIONS = "mode=0700,huge=always,size=90%"
MOUNT_S = 30  # mount(8) of that tmpfs; a second command waits for it at most twice that


def folder_bytes(folder: Path) -> int:
    """Bytes of the regular files in ``folder`` (pages kept or prepared in RAM);
    a file gone meanwhile (another process's claim or eviction) counts nothing."""
    total = 0
    try:
        entries = list(folder.iterdir())
    except OSError:
        return 0
    for p in entries:
        try:
            total += p.stat().st_size if p.is_file() else 0
        except OSError:
            continue
    return total


def mtime(path: Path) -> float:
    """``path``'s modification time; 0 where it is gone (sorts first, oldest)."""
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


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
            root: Path | None = None, hold: bool = True) -> Path | None:
    """``root`` (default: ram_root()) for ``size`` bytes of pages, where it has
    the room and the host can hold them and ``held_too`` more bytes at once
    with its reserve left, beside what other gpusnap processes chose RAM for
    and have not written yet (holds.py); None: the disk. ``hold``: this
    process's choice is held for it until it lets go or exits (hold_folder
    narrows it)."""
    root = ram_root() if root is None else root
    if shortfall(size, held_too, info, root, hold) != 0:
        return None
    return root


def shortfall(size: int, held_too: int = 0, info: dict[str, int] | None = None,
              root: Path | None = None, hold: bool = False) -> int | None:
    """Bytes ``root`` (default: ram_root()) lacks for ram_dir's ``size`` and
    ``held_too``: 0 where they fit (then held, with ``hold``), None where RAM is
    out of the question (switched off, no such folder, the ledger unusable)."""
    mode = os.environ.get(ENV, "auto")
    if mode == "0" or size <= 0:
        return None
    root = ram_root() if root is None else root
    try:
        if not root.is_dir():
            return None
        short = max(0, size + (64 << 20) - shutil.disk_usage(root).free)
    except OSError:
        return None
    if mode == "1":
        return short
    with holds.ledger() as ledger:
        if ledger is None:
            return None  # nothing known of the others' holds: the disk is the safe side
        info = meminfo() if info is None else info
        total, available = info.get("MemTotal", 0), info.get("MemAvailable", 0)
        if not total:
            return None
        short = max(short, size + held_too + reserve(total) - (available - ledger.others()))
        if hold and short == 0:
            ledger.hold(size + held_too)
    return short


def hold_folder(folder: Path) -> None:
    """The pages this process chose RAM for go into ``folder``, written there
    anew: what it holds there counts in MemAvailable as it comes, so other
    processes' checks count only the rest of this one's hold. (Not for a
    folder that links or moves in pages already in RAM: those would count as
    written.)"""
    if in_ram(folder):
        with holds.ledger() as ledger:
            if ledger is not None:
                ledger.name_folder(folder)


def hold_only(size: int) -> None:
    """Hold ``size`` bytes for this process without a check: memory it will
    take whatever a check would say (a restore from pages prepared in RAM: the
    process CRIU restores from them)."""
    with holds.ledger() as ledger:
        if ledger is not None:
            ledger.hold(size)


def let_go() -> None:
    """This process's hold ends: its step is done (what it took is in MemAvailable now)."""
    holds.let_go()


def ram_root() -> Path:
    """The tmpfs for pages in RAM: gpusnap's huge-page one (mounted here on
    first use, by root), else /dev/shm (GPUSNAP_PAGES_HUGE=0, not root, or a
    kernel whose tmpfs has no huge pages)."""
    if os.environ.get(HUGE_ENV, "1") == "0":
        return RAM_ROOT
    return HUGE_ROOT if mount_huge(HUGE_ROOT) else RAM_ROOT


def huge_mounted(point: Path = HUGE_ROOT, mountinfo: Path = Path("/proc/self/mountinfo")) -> bool:
    """A tmpfs with huge=always is mounted at ``point``."""
    try:
        lines = mountinfo.read_text().splitlines()
    except OSError:
        return False
    for line in lines:
        fields = line.split()
        if len(fields) < 10 or fields[4] != str(point):
            continue
        tail = fields[fields.index("-") + 1:]  # fstype, source, super options
        if tail[0] == "tmpfs" and "huge=always" in tail[2].split(","):
            return True
    return False


def mount_huge(point: Path) -> bool:
    """Mount gpusnap's huge-page tmpfs at ``point`` unless it is there; False
    where it cannot be (not root, no mount(8), tmpfs without huge pages).
    A lock beside it: two gpusnap commands must not stack two mounts."""
    if huge_mounted(point):
        return True
    if os.geteuid() != 0:
        return False
    try:
        point.mkdir(mode=0o700, parents=True, exist_ok=True)
        with open(point.parent / f".{point.name}.lock", "w") as lock:
            if not holds.locked(lock.fileno(), MOUNT_S * 2):
                return False  # a holder stopped (Ctrl-Z) or stuck: RAM without huge pages
            if huge_mounted(point):
                return True
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                subprocess.run(["mount", "-t", "tmpfs", "-o", HUGE_OPTIONS, "gpusnap-ram",
                                str(point)], capture_output=True, timeout=MOUNT_S, check=False)
    except OSError:
        return False
    return huge_mounted(point)


def roots() -> tuple[Path, ...]:
    """Every tmpfs pages in RAM may lie in."""
    return (HUGE_ROOT, RAM_ROOT)


def in_ram(path: Path, root: Path | None = None) -> bool:
    """``path`` lies in ``root`` (a folder ram_dir gave), by default in any of roots()."""
    real = Path(os.path.realpath(path))
    return any(real.is_relative_to(os.path.realpath(r)) for r in ((root,) if root else roots()))


def pages_dir(size: int, make_room: Callable[..., Path | None] | None = None) -> Path:
    """Where a restore writes CRIU's memory pages: RAM (memory.ram_root()) where the host
    can hold them and the restored process at once (pages/memory.py; CRIU
    reads them through a relative link: pages/pages_aside.py); else beside
    Podman's storage, so that the pre-restore action moves them into the
    container by a rename; else /var/tmp. ``make_room``: a
    caller's ram_dir that makes room first (pages/prepared_pages.evict_for)."""
    ram = (make_room or ram_dir)(size, held_too=size)
    if ram is not None:
        return ram
    root = storage_root()
    near = root.parent if root else None
    if near is not None and near.is_dir() and shutil.disk_usage(near).free >= size:
        return near
    return staging_dir(size, root)  # the root known already: no second `podman info`
