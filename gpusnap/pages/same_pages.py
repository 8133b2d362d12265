"""Pages of a pre-copy's final round that are as round 1 pushed them: found by the read, taken by the push unhashed.

A final round changes a few percent of a GPU process's memory, yet its push
hashed every byte: at 32 GiB two dozen worker processes, which kept the cores
busy while the read of the driver's copy ran beside them and slowed that read
several-fold (docs/benchmarks.md). Round 1's pages file is kept for the final
round's read to write over (kept_pages.py), so the read can tell, piece by
piece, whether the bytes it brings are those already there:

- round 1's push leaves an index beside each big pages file it pushed from RAM
  (``write_index``: the file's chunks, their parameters, the repository and
  compression they went to); kept_pages moves it with its file;
- the final round's read brings each piece into a small buffer, compares it
  with what the file holds, and writes only what differs (``read_compared``);
  the note it leaves the push names the ranges found the same;
- post-dump's compose compares CRIU's own pages with what the file holds at
  their offsets the same way (``copy_compared``) and tells the push the whole
  file is final, with the ranges found the same;
- the push (early_pages.py) takes a segment lying wholly in those ranges as
  round 1's chunks (``Index.segments``): no hash, no compression, no question
  to the registry.

Where the pages file's layout moved between the rounds (CRIU writes pages in
address order: a page more or less of the process's memory below the driver's
copy moves every offset after it), the read finds by how much each run moved
(``find_shift``), compares at the moved offset in a first pass and writes in a
second (a write in place would destroy bytes still to compare), and the push's
workers take round 1's chunks moved by that distance wherever their cut lands
on one (``Index.moved``): the cut still runs over every byte, the hash, the
compression and the question to the registry do not.

Only where it must hold: the same repository and compression (``push_id``),
the same chunk parameters (so the same segments), round-1 chunks that tile the
segment exactly. Those blobs went to that repository in round 1; a registry
that checks manifests (distribution does) refuses one naming a blob it lacks.
"""

from __future__ import annotations

import bisect
import ctypes
import json
import mmap
import os
from pathlib import Path
from typing import Callable

from gpusnap.oci.bundle import Chunk
from gpusnap.oci.chunker import ChunkParams

SUFFIX = ".chunks"  # the index's name: its pages file's, and this
# Bytes brought and compared at once, per reading thread. Each block costs two
# ctypes calls, each giving up and taking back the GIL: at 1 MiB 16 threads
# read 32 GiB in 2.2 s against 1.0 s at 4 MiB (docs/benchmarks.md).
COMPARE = 4 << 20
VERSION = 1


def index_path(path: str | Path) -> Path:
    return Path(f"{path}{SUFFIX}")


def _params(p: ChunkParams) -> list[int]:
    return [p.min_size, p.avg_size, p.max_size]


def write_index(path: Path, chunks: list[Chunk], params: ChunkParams, push_id: str) -> None:
    """Round 1's chunks of ``path``, beside it. Only speeds the final round up:
    a failure to write leaves no index (and no partial one)."""
    index = index_path(path)
    tmp = index.with_name(f".{index.name}.tmp")
    body = {"version": VERSION, "push": push_id, "size": sum(c.size for c in chunks),
            "params": _params(params), "chunks": [c.to_list() for c in chunks]}
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(body, f, separators=(",", ":"))
        os.replace(tmp, index)
    except OSError:
        tmp.unlink(missing_ok=True)


class Index:
    """Round 1's chunks of one pages file (``write_index``), each at its offset
    there: read once, asked for whole segments or for chunks moved."""

    def __init__(self, params: list[int], chunks: list[tuple[int, Chunk]]) -> None:
        self.params, self.chunks = params, chunks
        self.offsets = [o for o, _ in chunks]
        self._segments: dict[ChunkParams, dict[int, list[Chunk]]] = {}

    def segments(self, params: ChunkParams) -> dict[int, list[Chunk]]:
        """Round 1's chunks of each whole segment, by the segment's offset; {}
        for other parameters, or chunks that do not tile as a push cuts (a
        chunk never crosses a segment's end)."""
        if params not in self._segments:
            self._segments[params] = self._tiled(params) if self.params == _params(params) else {}
        return self._segments[params]

    def _tiled(self, params: ChunkParams) -> dict[int, list[Chunk]]:
        seg = params.segment
        found: dict[int, list[Chunk]] = {}
        for pos, c in self.chunks:
            at = pos - pos % seg
            if pos + c.size > at + seg:
                return {}
            found.setdefault(at, []).append(c)
        return {at: cs for at, cs in found.items() if sum(c.size for c in cs) == seg}

    def moved(self, moved: list[tuple[int, int, int]], start: int, end: int
              ) -> tuple[tuple[int, Chunk], ...]:
        """Round 1's chunks as they lie in [start, end) of the final file: each
        (offset there, chunk) where a range (a, b, shift) found unchanged holds
        the chunk's bytes, moved by ``shift`` (final offset - round 1's)."""
        out = []
        for a, b, shift in moved:
            lo, hi = max(a, start), min(b, end)
            i = bisect.bisect_left(self.offsets, lo - shift)
            while i < len(self.chunks) and self.chunks[i][0] + shift < hi:
                at, c = self.chunks[i]
                if at + shift >= lo and at + shift + c.size <= hi:
                    out.append((at + shift, c))
                i += 1
        return tuple(sorted(out, key=lambda x: x[0]))


def load_index(path: str | Path, push_id: str) -> Index | None:
    """The index beside ``path``; None where there is none, or one of another
    push (repository, compression) or version, or one that does not parse."""
    try:
        with open(index_path(path)) as f:
            body = json.load(f)
        if body.get("version") != VERSION or body.get("push") != push_id:
            return None
        chunks, pos = [], 0
        for item in body["chunks"]:
            c = Chunk.from_list(item)
            if c.size <= 0:
                return None
            chunks.append((pos, c))
            pos += c.size
        return Index(list(body["params"]), chunks)
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None


def covered(ranges: list[tuple[int, int]], start: int, end: int) -> bool:
    """[start, end) lies wholly in one of ``ranges`` (merged: adjacent ones joined)."""
    return any(a <= start and end <= b for a, b in ranges)


def merge(ranges: list[tuple[int, int]]) -> list[list[int]]:
    """Ranges sorted and joined where they touch."""
    out: list[list[int]] = []
    for a, b in sorted(ranges):
        if out and out[-1][1] >= a:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def merge_moved(ranges: list[tuple[int, int, int]]) -> list[list[int]]:
    """Ranges (a, b, shift) joined where they touch and moved by the same shift."""
    out: list[list[int]] = []
    for shift in sorted({r[2] for r in ranges}):
        out += [[a, b, shift] for a, b in merge([(a, b) for a, b, s in ranges if s == shift])]
    return sorted(out)


PROBE = 64 << 10  # bytes of a run looked for in round 1's file
SEARCH = 64 << 20  # how far from its own offset: a few pages more or less below it, at most this


def find_shift(read, kept: int, kept_size: int, address: int, length: int, offset: int,
               tried: tuple[int, ...] = (0,)) -> int | None:
    """By how much round 1's bytes of the run at ``address`` (``length`` bytes,
    at ``offset`` in the final file) lie moved in the kept file (``kept``, a
    descriptor, ``kept_size`` bytes): final offset - round 1's, a multiple of
    the page; None where a probe from its middle is found nowhere near, or a
    second from its first quarter does not agree. The shifts ``tried`` (0,
    the other runs') are checked first, cheaply. ``read(dst, src, n)`` brings
    n bytes of the process."""
    if length < 4 * PROBE or kept_size < PROBE:
        return None
    probes = []
    for at in (length // 2, length // 4):
        at -= at % mmap.PAGESIZE
        buf = ctypes.create_string_buffer(PROBE)
        read(ctypes.addressof(buf), address + at, PROBE)
        probes.append((at, buf.raw))
    mid, probe = probes[0]  # the one looked for; both must agree with a shift

    def agrees(shift: int) -> bool:
        return all(0 <= offset + at - shift <= kept_size - PROBE
                   and os.pread(kept, PROBE, offset + at - shift) == bytes_
                   for at, bytes_ in probes)

    for shift in tried:
        if agrees(shift):
            return shift
    if not probe.strip(b"\0"):
        return None  # zeros match anywhere
    lo = max(0, offset + mid - SEARCH)
    hi = min(kept_size, offset + mid + SEARCH + PROBE)
    if hi - lo < PROBE:
        return None
    skip = lo % mmap.ALLOCATIONGRANULARITY
    with mmap.mmap(kept, hi - lo + skip, mmap.MAP_SHARED, mmap.PROT_READ, offset=lo - skip) as view:
        at = view.find(probe, skip)
    if at < 0:
        return None
    shift = offset + mid - (lo + at - skip)
    return shift if shift % mmap.PAGESIZE == 0 and agrees(shift) else None


def read_compared(read: Callable[[int, int, int], None], memcmp: Callable[[int, int, int], int],
                  address: int, base: int, length: int, scratch: ctypes.Array,
                  write: bool = True) -> bool:
    """``length`` bytes of a process at ``address`` into the mapped file at
    ``base``, through ``scratch`` (COMPARE bytes): each part is compared with
    what the file holds and written only where it differs (``write``; else
    only compared, stopping at the first difference). ``read(dst, src, n)``
    brings n bytes of the process. True: every byte was as it was."""
    buf, same, done = ctypes.addressof(scratch), True, 0
    while done < length:
        n = min(COMPARE, length - done)
        read(buf, address + done, n)
        if memcmp(base + done, buf, n) != 0:
            if not write:
                return False
            ctypes.memmove(base + done, buf, n)
            same = False
        done += n
    return same


def copy_compared(src_fd: int, dst_fd: int, src: int, at: int, n: int) -> bool:
    """``n`` bytes of ``src_fd`` at ``src`` into ``dst_fd`` at ``at``, written
    only where they differ from what it holds there. True: it held them all."""
    same, done = True, 0
    while done < n:
        k = min(COMPARE, n - done)
        new = os.pread(src_fd, k, src + done)
        if len(new) != k:
            raise OSError(f"short read at {src + done}")
        if os.pread(dst_fd, k, at + done) != new:
            view, written = memoryview(new), 0
            while written < k:
                written += os.pwrite(dst_fd, view[written:], at + done + written)
            same = False
        done += k
    return same
