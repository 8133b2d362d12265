"""The file pages CRIU is about to copy on write, read ahead while it still starts.

A task's private file mappings (a library's data, a loader's relocations) are
restored by mapping the file and writing the task's changed pages over it
(criu/mem.c). Each first write to such a page makes the kernel read the file's
page before it copies it, one fault at a time on CRIU's one thread: on a host
whose page cache does not hold the image's libraries (a fresh replica, or the
coldstart bench, which drops the caches), an 8 GiB PyTorch replica's 30-odd
such writes cost 10-30 ms each, ~0.35 s of the stop (docs/benchmarks.md).

Pre-restore knows those pages before CRIU reaches them: the mm images say which
areas map which file at which offset, the pagemaps which pages of them the
images hold, and CRIU's files image which file each id is. ``read_ahead`` asks
the kernel for all of them at once (POSIX_FADV_WILLNEED: the reads are queued
and run side by side; nothing waits for them), from the container's root
filesystem as the runtime mounted it. Only files of the container's root mount
are read (another mount's file is not where its path says under that root); a
file that is not there, or not that size, is left to CRIU's faults as before.
"""

from __future__ import annotations

import bisect
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from gpusnap.criu import mm, pagemap
from gpusnap.criu.images import IMG_COMMON_MAGIC, ImageError, fields_of, messages, read_mounts

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
        data = path.read_bytes()
        if len(data) < 8 or struct.unpack_from("<II", data) != (IMG_COMMON_MAGIC, magic):
            raise ImageError(f"{name} is not a CRIU {name[:-4]} image")
        for entry in messages(data):
            if magic == REG_FILES_MAGIC:
                rid, reg = _reg_file(entry)
                out[rid] = reg
                continue
            f = {n: v for n, _, v in fields_of(entry)}
            if f.get(1) == FD_REG and isinstance(f.get(3), bytes):
                rid, reg = _reg_file(f[3])
                out[int(f.get(2, rid))] = reg
    return out


def wanted(folder: Path, pagemaps: dict[int, pagemap.Pagemap] | None = None
           ) -> dict[int, list[tuple[int, int]]]:
    """File id -> the (offset, length) ranges of it that CRIU writes over, merged
    (GAP apart or closer), from every task's mm image and pagemap; ``pagemaps``:
    those the caller read already (parsed ones are added to it)."""
    out: dict[int, list[tuple[int, int]]] = {}
    for mm_image in folder.glob("mm-*.img"):
        vpid = mm_image.name[3:-4]
        if not vpid.isdigit() or not (folder / f"pagemap-{vpid}.img").is_file():
            continue
        areas = sorted((v for v in mm.parse(mm_image.read_bytes()) if v.private_file),
                       key=lambda v: v.start)
        if not areas:
            continue
        pm = pagemaps.get(int(vpid)) if pagemaps is not None else None
        if pm is None:
            pm = pagemap.parse((folder / f"pagemap-{vpid}.img").read_bytes())
            if pagemaps is not None:
                pagemaps[int(vpid)] = pm
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


def root_mount_id(folder: Path) -> int | None:
    """The mount id of the container's root ("/") in the checkpoint."""
    roots = [m.mnt_id for m in read_mounts(folder) if m.mountpoint == "/"]
    return roots[0] if len(roots) == 1 else None


def container_root(folder: Path) -> Path | None:
    """The root filesystem the runtime mounted for the task being restored: the
    bundle's config.json beside the images folder (Podman's userdata/checkpoint),
    its root.path; None where there is no such bundle (another layout)."""
    import json

    spec = Path(os.path.realpath(folder)).parent / "config.json"
    try:
        root = json.loads(spec.read_text())["root"]["path"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    path = Path(root) if os.path.isabs(root) else spec.parent / root
    return path if path.is_dir() else None


@dataclass(frozen=True)
class ReadAhead:
    files: int
    bytes: int
    skipped: int  # files not found under the root, or not of the size CRIU saw


def read_ahead(folder: Path, root: Path,
               pagemaps: dict[int, pagemap.Pagemap] | None = None) -> ReadAhead:
    """Ask the kernel to read every file page CRIU will write over (WILLNEED)."""
    ranges = wanted(folder, pagemaps)
    if not ranges:
        return ReadAhead(0, 0, 0)
    files = regular_files(folder)
    root_id = root_mount_id(folder)
    done = asked = skipped = 0
    for fid, spans in sorted(ranges.items()):
        reg = files.get(fid)
        if reg is None or root_id is None or reg.mnt_id != root_id or not reg.name.startswith("/"):
            skipped += 1
            continue
        try:
            fd = os.open(root / reg.name.lstrip("/"), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            skipped += 1
            continue
        try:
            if reg.size is not None and os.fstat(fd).st_size != reg.size:
                skipped += 1  # not the file CRIU saw (the container's copy changed)
                continue
            for off, length in spans:
                os.posix_fadvise(fd, off, length, os.POSIX_FADV_WILLNEED)
                asked += length
            done += 1
        finally:
            os.close(fd)
    return ReadAhead(done, asked, skipped)
