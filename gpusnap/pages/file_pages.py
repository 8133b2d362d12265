"""The file pages CRIU is about to copy on write, read ahead while it still starts.

A task's private file mappings (a library's data, a loader's relocations) are
restored by mapping the file and writing the task's changed pages over it
(criu/mem.c). Each first write to such a page makes the kernel read the file's
page before it copies it, one fault at a time on CRIU's one thread: on a host
whose page cache does not hold the image's libraries (a fresh replica, or the
coldstart bench, which drops the caches), a PyTorch replica's few dozen such
writes each wait for the disk, one after another, in the stop
(docs/benchmarks.md).

Pre-restore knows those pages before CRIU reaches them: the mm images say which
areas map which file at which offset, the pagemaps which pages of them the
images hold, and CRIU's files image which file each id is, on which mount.
``read_ahead`` asks the kernel for all of them at once (POSIX_FADV_WILLNEED:
the reads are queued and run side by side; nothing waits for them) from where
the runtime's bundle says that mount comes from: the root filesystem it
mounted, or the host path of a bind mount (a volume, or the driver's libraries
a CDI spec or hook mounts in). A file on any other mount, not there, or not of
the size CRIU saw is left to CRIU's own faults. It is only ever a hint:
the page cache reads what CRIU would have read.
"""

from __future__ import annotations

import bisect
import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from gpusnap.criu import mm, pagemap
from gpusnap.criu.images import ImageError, checked_messages, fields_of, read_mounts

FILES_MAGIC, REG_FILES_MAGIC = 0x56303138, 0x50363636
FD_REG = 1  # fd_types.REG
GAP = 64 << 10  # ranges of one file closer than this are read as one


@dataclass(frozen=True)
class RegFile:
    name: str  # its path in the container's mount namespace
    mnt_id: int
    size: int | None


def _zigzag(n: int) -> int:
    return (n >> 1) ^ -(n & 1)


def _reg_file(data: bytes) -> tuple[int, RegFile]:
    f = {n: v for n, _, v in fields_of(data)}
    name = f.get(6)
    if not isinstance(name, bytes):
        raise ImageError("a regular file entry without a name")
    mnt = f.get(7)
    return int(f.get(1, 0)), RegFile(name.decode(errors="surrogateescape"),
                                     _zigzag(mnt) if isinstance(mnt, int) else -1,
                                     f.get(8) if isinstance(f.get(8), int) else None)


def regular_files(folder: Path) -> dict[int, RegFile]:
    """CRIU's regular files by id: files.img (CRIU >= 3.13), else reg-files.img."""
    out: dict[int, RegFile] = {}
    for name, magic in (("files.img", FILES_MAGIC), ("reg-files.img", REG_FILES_MAGIC)):
        path = folder / name
        if not path.is_file():
            continue
        for entry in checked_messages(path.read_bytes(), magic, name[:-4], name):
            if magic == REG_FILES_MAGIC:
                rid, reg = _reg_file(entry)
                out[rid] = reg
                continue
            f = {n: v for n, _, v in fields_of(entry)}
            if f.get(1) == FD_REG and isinstance(f.get(3), bytes):
                rid, reg = _reg_file(f[3])
                out[int(f.get(2, rid))] = reg
    return out


def wanted(folder: Path) -> dict[int, list[tuple[int, int]]]:
    """File id -> the (offset, length) ranges of it that CRIU writes over, merged
    (GAP apart or closer), from every task's mm image and pagemap."""
    out: dict[int, list[tuple[int, int]]] = {}
    for mm_image in folder.glob("mm-*.img"):
        vpid = mm_image.name[3:-4]
        if not vpid.isdigit() or not (folder / f"pagemap-{vpid}.img").is_file():
            continue
        areas = sorted((v for v in mm.parse(mm_image.read_bytes()) if v.private_file),
                       key=lambda v: v.start)
        if not areas:
            continue
        pm = pagemap.parse((folder / f"pagemap-{vpid}.img").read_bytes())
        starts = [v.start for v in areas]
        for run in pm.runs:
            lo, hi = run.vaddr, run.vaddr + run.pages * pagemap.PAGE
            i = max(bisect.bisect_right(starts, lo) - 1, 0)
            while i < len(areas) and areas[i].start < hi:
                v = areas[i]
                a, b = max(lo, v.start), min(hi, v.end)
                if b > a:
                    out.setdefault(v.shmid, []).append((v.pgoff + a - v.start, b - a))
                i += 1
    return {fid: _merged(ranges) for fid, ranges in out.items()}


def _merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for off, length in sorted(ranges):
        if out and off <= out[-1][0] + out[-1][1] + GAP:
            start = out[-1][0]
            out[-1] = (start, max(out[-1][0] + out[-1][1], off + length) - start)
        else:
            out.append((off, length))
    return out


def mount_points(folder: Path) -> dict[int, str]:
    """Each mount id of the checkpoint's mount namespace -> where it is mounted."""
    return {m.mnt_id: m.mountpoint for m in read_mounts(folder)}


def host_dirs(folder: Path) -> dict[str, Path] | None:
    """Where the runtime took each of the container's mount points from, as the
    bundle's config.json beside the images folder (Podman's userdata/checkpoint)
    says: "/" -> root.path, a bind mount's destination -> its source. None where
    there is no such bundle (another layout)."""
    spec_path = Path(os.path.realpath(folder)).parent / "config.json"
    try:
        spec = json.loads(spec_path.read_text())
        root = spec["root"]["path"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    out = {"/": Path(root) if os.path.isabs(root) else spec_path.parent / root}
    for m in spec.get("mounts") or []:
        if not isinstance(m, dict):
            continue
        binds = m.get("type") == "bind" or {"bind", "rbind"} & set(m.get("options") or [])
        src, dst = m.get("source"), m.get("destination")
        if binds and isinstance(src, str) and isinstance(dst, str) and os.path.isabs(src):
            out[os.path.normpath(dst)] = Path(src)
    return out


def _source(reg: RegFile, points: dict[int, str], dirs: dict[str, Path]) -> Path | None:
    """Where the bundle took the mount of ``reg`` from."""
    point = points.get(reg.mnt_id)
    return dirs.get(os.path.normpath(point)) if point else None


def host_path(reg: RegFile, points: dict[int, str], dirs: dict[str, Path]) -> Path | None:
    """The host path of a file CRIU saw at ``reg.name`` on mount ``reg.mnt_id``."""
    source = _source(reg, points, dirs)
    if source is None or not reg.name.startswith("/"):
        return None
    point = points[reg.mnt_id]
    rel = os.path.relpath(reg.name, point)
    if rel == ".":
        return source  # a file bind-mounted on its own
    if rel.startswith(".."):
        return None
    return source / rel


def _regular_file_in(path: Path, source: Path) -> str | None:
    """``path`` resolved, where it stays inside ``source`` (the names come from the
    images and the links on the way from the container's files: never a host file
    elsewhere) and is a regular file (never a device or FIFO, whose open acts)."""
    real, base = os.path.realpath(path), os.path.realpath(source)
    if real != base and not real.startswith(base.rstrip("/") + "/"):
        return None
    try:
        return real if stat.S_ISREG(os.lstat(real).st_mode) else None
    except OSError:
        return None


@dataclass(frozen=True)
class ReadAhead:
    files: int
    bytes: int
    skipped: int  # files not found under the root, or not of the size CRIU saw


def read_ahead(folder: Path, dirs: dict[str, Path]) -> ReadAhead:
    """Ask the kernel to read every file page CRIU will write over (WILLNEED);
    ``dirs``: host_dirs of the bundle."""
    ranges = wanted(folder)
    if not ranges:
        return ReadAhead(0, 0, 0)
    files = regular_files(folder)
    points = mount_points(folder)
    done = asked = skipped = 0
    for fid, spans in sorted(ranges.items()):
        reg = files.get(fid)
        path = host_path(reg, points, dirs) if reg is not None else None
        real = _regular_file_in(path, _source(reg, points, dirs)) if path else None
        try:
            fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY
                         | os.O_CLOEXEC) if real else None
        except OSError:
            fd = None
        if fd is None:
            skipped += 1
            continue
        try:
            if reg.size is not None and os.fstat(fd).st_size != reg.size:
                skipped += 1  # not the file CRIU saw (changed since)
                continue
            for off, length in spans:
                os.posix_fadvise(fd, off, length, os.POSIX_FADV_WILLNEED)
                asked += length
            done += 1
        finally:
            os.close(fd)
    return ReadAhead(done, asked, skipped)
