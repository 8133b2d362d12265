"""A pre-copy's round-1 pages files kept in RAM on the source, for the final round to write over.

The final round's stop reads the driver's copy of the GPU memory out of the
process into a file in RAM (pages/dump_ahead.py). Into memory the kernel
must first hand out and zero, that read runs at a fraction of the rate it has
into memory that is already the file's: at 32 GiB in a VM, 3.6 GB/s against
17-27 GB/s, seconds of the stop (docs/benchmarks.md). Round 1 had a pages file
of the same size in that very tmpfs, freed once pushed. So a pre-checkpoint
push keeps its big pages files (``keep``), renamed into a folder of the
container's own; the final round's read-ahead takes one over by a rename and
writes into its pages (``dump_ahead.read``), which round 1's bytes never
outlive: every byte of the final pages file is written by the read or by
post-dump's composing.

They are held only while the host can spare them: kept where, beside them,
the host still has room for the final round's driver copy and its reserve;
given up to any push or restore that needs the memory (prepared_pages.evict_for);
gone after the container's next push, and after KEEP_S whatever comes
(``sweep``, at every push; `gpusnap doctor` lists older ones). GPUSNAP_PAGES_KEEP=0
never keeps them.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

from gpusnap import journal
from gpusnap.pages import memory

PREFIX = "gpusnap-kept-"
ENV = "GPUSNAP_PAGES_KEEP"
KEEP_S = 900  # a final round later than this is rare: the memory goes back
MIN_FILE = 256 << 20  # below this the read-ahead does not run (dump_ahead.MIN_TOTAL)


def folder_of(container_id: str, root: Path) -> Path:
    return root / f"{PREFIX}{container_id}"


def folders(roots: tuple[Path, ...] | None = None) -> list[Path]:
    """Every kept folder, oldest first."""
    found = []
    for root in roots if roots is not None else memory.roots():
        try:
            found += [p for p in root.glob(PREFIX + "*") if p.is_dir()]
        except OSError:
            continue
    return sorted(found, key=_mtime)


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def size_of(folder: Path) -> int:
    try:
        return sum(p.stat().st_size for p in folder.iterdir() if p.is_file())
    except OSError:
        return 0


def keep(aside: Path, container_id: str, held_too: int,
         info: dict[str, int] | None = None) -> dict | None:
    """After a pre-checkpoint push: move the big pages files of ``aside`` (a
    folder in RAM) into the container's kept folder beside it, where the host
    keeps room for ``held_too`` more bytes (the final round's driver copy) and
    its reserve besides. What was kept, or None."""
    if os.environ.get(ENV, "1") == "0":
        return None
    drop(container_id)
    try:
        files = sorted((p for p in aside.glob("pages-*.img")
                        if p.is_file() and not p.is_symlink() and p.stat().st_size >= MIN_FILE),
                       key=lambda p: p.stat().st_size, reverse=True)
    except OSError:
        return None
    if not files:
        return None
    info = memory.meminfo() if info is None else info
    total, available = info.get("MemTotal", 0), info.get("MemAvailable", 0)
    if not total or available < held_too + memory.reserve(total):
        journal.record("pages-not-kept", container=container_id, available=available,
                       needed=held_too + memory.reserve(total))
        return None
    folder = folder_of(container_id, aside.parent)
    try:
        folder.mkdir(mode=0o700)
        for i, path in enumerate(files):  # numbered by size: the largest is taken first
            os.rename(path, folder / f"{i:03d}.img")
    except OSError as exc:
        shutil.rmtree(folder, ignore_errors=True)
        journal.record("pages-not-kept", container=container_id, error=str(exc))
        return None
    kept = {"folder": str(folder), "files": len(files), "bytes": size_of(folder)}
    journal.record("pages-kept", container=container_id, **kept)
    return kept


def files(container_id: str) -> list[str]:
    """The container's kept files, largest first ([] where none)."""
    folder, _ = held(container_id)
    try:
        return [str(p) for p in sorted(folder.glob("*.img"))] if folder else []
    except OSError:
        return []


def held(container_id: str) -> tuple[Path | None, int]:
    """The container's kept folder and its bytes: memory its final round
    writes over instead of taking more (None, 0 where none)."""
    for root in memory.roots():
        folder = folder_of(container_id, root)
        if folder.is_dir():
            return folder, size_of(folder)
    return None, 0


def drop(container_id: str) -> None:
    """The container's kept folder, gone (what its final round took is not in it)."""
    for root in memory.roots():
        shutil.rmtree(folder_of(container_id, root), ignore_errors=True)


def stale(now: float | None = None) -> list[Path]:
    """Kept folders older than KEEP_S."""
    now = time.time() if now is None else now
    return [f for f in folders() if now - _mtime(f) > KEEP_S]


def sweep() -> None:
    """Give back the memory of kept folders whose final round never came."""
    for folder in stale():
        freed = size_of(folder)
        shutil.rmtree(folder, ignore_errors=True)
        journal.record("pages-kept-dropped", folder=str(folder), bytes=freed, why="too old")
