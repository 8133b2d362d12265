"""A pre-copy's round-1 pages files kept in RAM on the source, for the final round to write over.

The final round's stop reads the driver's copy of the GPU memory out of the
process into a file in RAM (pages/dump_ahead.py). Into memory the kernel
must first hand out and zero, that read runs at a fraction of the rate it has
into memory that is already the file's: at 32 GiB in a VM, 3.6 GB/s against
~36 GB/s alone (docs/benchmarks.md), seconds of the stop. Round 1 had a pages
file of the same size in that very tmpfs, freed once pushed. So:

- ``keep``: a pre-checkpoint push moves its largest pages files, one per
  process the final round will read ahead, into a folder of the container's
  own beside its push folder, where the host still has room for the final
  round's driver copy and its reserve; only in gpusnap's own tmpfs (root's,
  0700), never in a folder others may write to;
- ``claim``: the final round renames that folder into its own push folder
  before its RAM check, which counts it as memory held already: from then on
  it lives and goes with that push folder, and nobody else can evict it;
- the read-ahead renames each file to its own and writes over its pages; the
  pre-dump step unlinks what it did not use before CRIU dumps. Every byte of
  the final pages file is written by the read or by post-dump's composing.

Unclaimed, they give way to any push or restore that needs the memory
(prepared_pages.evict_for), and go after KEEP_S whatever comes: a detached
`sleep; rm` started with them (a push's ``sweep`` and `gpusnap doctor` find
them should that process be killed). GPUSNAP_PAGES_KEEP=0 never keeps them.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import time
from pathlib import Path

from gpusnap import journal
from gpusnap.pages import memory, same_pages

PREFIX = "gpusnap-kept-"
CLAIMED = "kept"  # the claimed folder's name in a push folder
ENV = "GPUSNAP_PAGES_KEEP"
KEEP_S = 900  # a final round later than this is rare: the memory goes back
MIN_FILE = 256 << 20  # below this the read-ahead does not run (dump_ahead.MIN_TOTAL)
CLAIM_MARGIN_S = 60  # a folder this close to its expiry is left to it, not claimed


def folders(roots: tuple[Path, ...] | None = None) -> list[Path]:
    """Every kept folder, oldest first."""
    found = []
    for root in roots if roots is not None else memory.roots():
        try:
            found += [p for p in root.glob(PREFIX + "*") if _ours(p, stat.S_ISDIR)]
        except OSError:
            continue
    return sorted(found, key=memory.mtime)


def _ours(path: Path, kind) -> bool:
    """``path`` is of ``kind`` itself (not a link to one) and this user's."""
    try:
        st = path.lstat()
    except OSError:
        return False
    return kind(st.st_mode) and st.st_uid == os.geteuid()


def _private(folder: Path) -> bool:
    """Only this user may put a name into ``folder`` (gpusnap's tmpfs; not /dev/shm)."""
    try:
        st = folder.stat()
    except OSError:
        return False
    return st.st_uid == os.geteuid() and not st.st_mode & 0o022


def keep(aside: Path, container_id: str, count: int, held_too: int,
         info: dict[str, int] | None = None) -> dict | None:
    """After a pre-checkpoint push: move the ``count`` largest pages files of
    ``aside`` (a folder in RAM) into a kept folder of the container's beside
    it, where the host keeps room for ``held_too`` more bytes (the final
    round's driver copy) and its reserve besides. What was kept, or None."""
    if os.environ.get(ENV, "1") == "0" or count < 1 or not _private(aside.parent):
        return None
    drop(container_id)
    try:
        files = sorted((p for p in aside.glob("pages-*.img")
                        if _ours(p, stat.S_ISREG) and p.stat().st_size >= MIN_FILE),
                       key=lambda p: p.stat().st_size, reverse=True)[:count]
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
    # Named for this round: the expiry of an earlier round's folder never takes it.
    folder = aside.parent / f"{PREFIX}{container_id}.{time.time_ns()}"
    try:
        folder.mkdir(mode=0o700)
        for i, path in enumerate(files):  # numbered by size: the largest first
            os.rename(path, folder / f"{i:03d}.img")
            _move_index(path, folder / f"{i:03d}.img")
    except OSError as exc:
        shutil.rmtree(folder, ignore_errors=True)
        journal.record("pages-not-kept", container=container_id, error=str(exc))
        return None
    kept = {"folder": str(folder), "files": len(files), "bytes": memory.folder_bytes(folder)}
    journal.record("pages-kept", container=container_id, **kept)
    _expire(folder)
    return kept


def _expire(folder: Path) -> None:
    """Remove ``folder`` after KEEP_S, whether or not any gpusnap runs by then
    (a claimed folder has moved away: nothing is removed then)."""
    try:
        subprocess.Popen(["sh", "-c", 'sleep "$1"; rm -rf -- "$2"', "gpusnap-kept-expiry",
                          str(KEEP_S), str(folder)], start_new_session=True,
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
    except OSError:
        pass  # a push's sweep and doctor still find it


def _of(container_id: str, roots: tuple[Path, ...] | None = None) -> list[Path]:
    return [f for f in folders(roots) if f.name.rpartition(".")[0] == PREFIX + container_id]


def claim(container_id: str, into: Path, count: int) -> list[str]:
    """The container's newest kept folder in ``into``'s filesystem folder,
    renamed into ``into`` (the final round's push folder): its ``count``
    largest files (the rest unlinked: nothing would write over them); [] where
    there is none, it is about to expire, or another took it first."""
    found = [f for f in _of(container_id, (into.parent,))
             if time.time() - memory.mtime(f) < KEEP_S - CLAIM_MARGIN_S] if _private(into.parent) else []
    if not found or count < 1:
        return []
    claimed = into / CLAIMED
    try:
        os.rename(found[-1], claimed)
    except OSError:
        return []
    drop(container_id)  # older rounds' folders, if any: of no use now
    files = [str(p) for p in sorted(claimed.glob("*.img")) if _ours(p, stat.S_ISREG)]
    release(files[count:])
    return files[:count]


def drop(container_id: str) -> None:
    """The container's kept folders, gone."""
    for folder in _of(container_id):
        shutil.rmtree(folder, ignore_errors=True)


def stale(now: float | None = None) -> list[Path]:
    """Kept folders older than KEEP_S."""
    now = time.time() if now is None else now
    return [f for f in folders() if now - memory.mtime(f) > KEEP_S]


def sweep() -> None:
    """Give back the memory of kept folders whose final round never came."""
    for folder in stale():
        freed = memory.folder_bytes(folder)
        shutil.rmtree(folder, ignore_errors=True)
        journal.record("pages-kept-dropped", folder=str(folder), bytes=freed, why="too old")


def release(paths: list[str]) -> None:
    """Kept files the read-ahead did not write over, unlinked before CRIU
    dumps (its pages would otherwise need that memory too)."""
    for path in paths:
        for name in (path, same_pages.index_path(path)):
            try:
                os.unlink(name)
            except OSError:
                pass


def _move_index(src: str | Path, dst: str | Path) -> None:
    """A pages file's index of round 1's chunks (same_pages.py) follows it; a
    stale one at ``dst`` never stays beside another file."""
    try:
        os.rename(same_pages.index_path(src), same_pages.index_path(dst))
    except OSError:
        same_pages.index_path(dst).unlink(missing_ok=True)


def open_over(path: str, donor: str | None) -> tuple[int, int]:
    """``path`` opened for the read-ahead (dump_ahead.read), and the bytes of
    memory it already holds: ``donor`` (a kept file) renamed to it where it
    can be, else a new empty file. Only this user's own regular file, linked
    nowhere else, is written over (another name would change with it)."""
    if donor:
        try:
            os.rename(donor, path)
        except OSError:
            pass
        else:
            _move_index(donor, path)
            try:
                fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
            except OSError:
                fd = -1
            if fd >= 0:
                st = os.fstat(fd)
                if stat.S_ISREG(st.st_mode) and st.st_nlink == 1 and st.st_uid == os.geteuid():
                    return fd, st.st_blocks * 512
                os.close(fd)
            os.unlink(path)  # whatever it was, not ours to write: a new file takes its name
            same_pages.index_path(path).unlink(missing_ok=True)
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600), 0


def pick(donors: list[str], size: int) -> str | None:
    """The donor to write a ``size``-byte file over, taken off ``donors``: the
    smallest that holds it whole, else the largest."""
    sizes = []
    for d in donors:
        try:
            sizes.append((os.lstat(d).st_size, d))
        except OSError:
            continue
    if not sizes:
        return None
    whole = [x for x in sizes if x[0] >= size]
    _, chosen = min(whole) if whole else max(sizes)
    donors.remove(chosen)
    return chosen
