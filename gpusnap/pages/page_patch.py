"""A prepared pages file made a restore's own: chunks it holds at the same
offset stay, chunks it holds elsewhere are moved into place within the file
(a few pages more or less before them shift the rest), and only what is
left is fetched. prepared_pages.py decides when a folder is worth patching.
"""

from __future__ import annotations

import bisect
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from gpusnap.oci.bundle import Chunk, FileEntry

Runs = list[tuple[int, list[Chunk]]]  # (offset, consecutive chunks) still to write


def layout(chunks: list[Chunk] | list[list]) -> list[tuple[str, int]]:
    return [(c.digest, c.size) if isinstance(c, Chunk) else (str(c[0]), int(c[1]))
            for c in chunks]


@dataclass
class Patch:
    """How a prepared file becomes a restore's: bytes already in place, moves
    within the file (src, dst, size) for chunks it holds elsewhere (what a
    few pages more or less before them shift), and runs still to fetch."""
    same: int = 0
    moves: list[tuple[int, int, int]] = field(default_factory=list)
    runs: Runs = field(default_factory=list)

    @property
    def moved(self) -> int:
        return sum(m[2] for m in self.moves)


def plan_patch(new: list[Chunk], old: list[tuple[str, int]]) -> Patch:
    """``new``'s chunks against the old file's: in place, movable (the same
    chunk at another offset), or runs to fetch, each with its offset."""
    at, where, pos = set(), {}, 0
    for digest, size in old:
        at.add((pos, digest, size))
        where.setdefault((digest, size), pos)
        pos += size
    patch, pos, run_end = Patch(), 0, -1
    for c in new:
        src = where.get((c.digest, c.size))
        if (pos, c.digest, c.size) in at:
            patch.same += c.size
        elif src is not None:
            patch.moves.append((src, pos, c.size))
        elif run_end == pos:
            patch.runs[-1][1].append(c)
            run_end = pos + c.size
        else:
            patch.runs.append((pos, [c]))
            run_end = pos + c.size
        pos += c.size
    return patch


class _Written:
    """Disjoint byte ranges written so far (a patch's destinations never overlap)."""

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.ends: list[int] = []

    def overlaps(self, start: int, end: int) -> bool:
        i = bisect.bisect_left(self.starts, end)
        return i > 0 and self.ends[i - 1] > start

    def add(self, start: int, end: int) -> None:
        i = bisect.bisect_left(self.starts, start)
        self.starts.insert(i, start)
        self.ends.insert(i, end)


MOVE_THREADS = 4


MOVE_BATCH = 32 << 20  # one buffer, reused: what a patch adds to the restore's RSS


def apply_moves(fd: int, moves: list[tuple[int, int, int]], threads: int = MOVE_THREADS,
                batch: int = MOVE_BATCH) -> list[tuple[int, int, int]]:
    """Copy each (src, dst, size) within the file, in an order that reads every
    source before anything is written over it where it can: moves forward from
    the end, then moves backward from the start (a shift by a few pages is then
    copied whole). A move whose source was already written over is returned,
    not done: its chunk is fetched instead.

    In batches of up to ``batch`` bytes: every source of a batch is read into
    one buffer (threads: a tmpfs read takes no inode lock) before any of it is
    written back (pwrite, GIL released). The buffer is allocated once: fresh
    buffers each batch, or mappings to write through, take the restore's RSS
    past the 256 MiB it is held to."""
    ahead = sorted((m for m in moves if m[1] > m[0]), key=lambda m: m[1], reverse=True)
    back = sorted((m for m in moves if m[1] < m[0]), key=lambda m: m[1])
    order = ahead + back
    if not order:
        return []
    written, left, i = _Written(), [], 0
    buf = memoryview(bytearray(max([batch, *(m[2] for m in order)])))
    with ThreadPoolExecutor(threads, thread_name_prefix="gpusnap-move") as pool:
        while i < len(order):
            todo, size = [], 0
            while i < len(order) and (not todo or size + order[i][2] <= len(buf)):
                src, dst, n = order[i]
                i += 1
                if written.overlaps(src, src + n):
                    left.append((src, dst, n))
                    continue
                todo.append((src, dst, n, size))
                size += n
            list(pool.map(lambda m: _read(fd, buf[m[3]:m[3] + m[2]], m[0]), todo))
            list(pool.map(lambda m: _write(fd, buf[m[3]:m[3] + m[2]], m[1]), todo))
            for _, dst, n, _ in todo:
                written.add(dst, dst + n)
    return left


def _read(fd: int, view: memoryview, offset: int) -> None:
    while view:
        n = os.preadv(fd, [view], offset)
        if n <= 0:
            raise OSError(f"short read at {offset} of a prepared pages file")
        view, offset = view[n:], offset + n


def _write(fd: int, view: memoryview, offset: int) -> None:
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def bytes_held(patch: Patch) -> int:
    return patch.same + patch.moved


def patch_in_place(path: Path, entry: FileEntry, old: list[tuple[str, int]]) -> Runs:
    """The prepared file at ``path`` made ``entry``'s but for the runs returned:
    chunks it holds elsewhere moved into place, then the file cut to size
    (not before: a move may read past the new end)."""
    patch = plan_patch(entry.chunks, old)
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    try:
        if entry.size > os.fstat(fd).st_size:
            os.ftruncate(fd, entry.size)
        left = apply_moves(fd, patch.moves)
        os.ftruncate(fd, entry.size)
    finally:
        os.close(fd)
    if not left:
        return patch.runs
    fetch = {dst for _, dst, _ in left}  # moves whose source was written over: fetched
    for off, run in patch.runs:
        for c in run:
            fetch.add(off)
            off += c.size
    runs: Runs = []
    pos = run_end = 0
    for c in entry.chunks:
        if pos in fetch:
            if runs and run_end == pos:
                runs[-1][1].append(c)
            else:
                runs.append((pos, [c]))
            run_end = pos + c.size
        pos += c.size
    return runs
