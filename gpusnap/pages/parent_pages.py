"""A prepared folder of round 1 used as CRIU's *parent* images: the final round's
pages that round 1 holds at the same address are not written again at all.

The final round of a pre-copy finds most of its pages file in round 1's,
but shifted by a few pages that an early mapping grew by: patching the
prepared file moves nearly all of it within the file in the stop, at the
host's copy rate (docs/benchmarks.md). CRIU reads a pages file in its
pagemap's order, so the offsets cannot be pointed elsewhere; but a pagemap run
marked PE_PARENT is read from the ``parent`` images folder at the same address,
which is how CRIU's own pre-dump chains restore (criu/page-read.c). So the
restore rewrites the final round's pagemap: every page whose bytes lie in round
1's prepared file at the offset where round 1 kept *the same address* becomes a
parent run; only the other pages go into a new, compact pages file; the claimed
prepared folder (round 1's pagemaps kept beside its pages) becomes the parent.

Which bytes are equal comes from the chunk lists (content digests), not from
reading either file: a page is the parent's where the chunks that cover it lie
in round 1's file shifted by one whole number of pages, and both pagemaps put
the same address there.
"""

from __future__ import annotations

import bisect
import os
from dataclasses import dataclass, field
from pathlib import Path

from gpusnap.criu import pagemap as pm
from gpusnap.oci.bundle import Chunk

PAGE = pm.PAGE
Runs = list[tuple[int, list[Chunk]]]


@dataclass
class Plan:
    """One task's pages against its parent's: the rewritten pagemap, the byte
    ranges of the final pages file still to write (compacted, in order), and the
    chunk runs (at their final offsets) that cover them."""
    pagemap: bytes
    own: list[tuple[int, int]]
    runs: Runs = field(default_factory=list)
    parent_bytes: int = 0
    pagemap_path: str = ""  # the bundle's pagemap this one stands for

    @property
    def own_bytes(self) -> int:
        return sum(b - a for a, b in self.own)


def _matched(new: list[Chunk], old: list[tuple[str, int]]) -> list[tuple[int, int, int]]:
    """(start, end, delta) in the new file: where its bytes equal the old
    file's at offset + delta, consecutive chunks with one delta merged. A
    chunk is looked for where the previous one's shift puts it, then in place,
    then anywhere: a chunk that occurs many times (zeroed memory) would
    otherwise be matched with its first copy, at another address."""
    at, where, pos = set(), {}, 0
    for digest, size in old:
        at.add((pos, digest, size))
        where.setdefault((digest, size), pos)
        pos += size
    out: list[tuple[int, int, int]] = []
    pos = delta = 0
    for c in new:
        src = next((s for s in (pos + delta, pos) if (s, c.digest, c.size) in at),
                   where.get((c.digest, c.size)))
        if src is not None:
            delta = src - pos
            if out and out[-1][1] == pos and out[-1][2] == delta:
                out[-1] = (out[-1][0], pos + c.size, delta)
            else:
                out.append((pos, pos + c.size, delta))
        pos += c.size
    return out


class _Addresses:
    """Offset in a pages file -> address, from its pagemap's present runs."""

    def __init__(self, pagemap: pm.Pagemap) -> None:
        self.runs = pm.offsets(pagemap)
        self.starts = [r[0] for r in self.runs]

    def at(self, offset: int) -> tuple[int, int] | None:
        """(vaddr - offset, end of that run in the file) where ``offset`` lies."""
        i = bisect.bisect_right(self.starts, offset) - 1
        if i < 0:
            return None
        start, vaddr, pages = self.runs[i]
        end = start + pages * PAGE
        return (vaddr - start, end) if offset < end else None


def parent_ranges(new: list[Chunk], old: list[tuple[str, int]], final: pm.Pagemap,
                  parent: pm.Pagemap) -> list[tuple[int, int]]:
    """Page-aligned [start, end) ranges of the final pages file whose pages the
    parent holds at the same address with the same bytes."""
    mine, theirs = _Addresses(final), _Addresses(parent)
    out: list[tuple[int, int]] = []
    for start, end, delta in _matched(new, old):
        if delta % PAGE:
            continue  # not page for page: CRIU's files hold whole pages, so not the same pages
        pos, end = -(-start // PAGE) * PAGE, end // PAGE * PAGE
        while pos < end:
            a, b = mine.at(pos), theirs.at(pos + delta)
            if a is None or b is None:  # a hole in either pagemap's present runs: skip a page
                pos += PAGE
                continue
            stop = min(end, a[1], b[1] - delta)
            if a[0] == b[0] + delta:  # the same address on both sides
                if out and out[-1][1] == pos:
                    out[-1] = (out[-1][0], stop)
                else:
                    out.append((pos, stop))
            pos = stop
    return out


def _complement(size: int, taken: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out, pos = [], 0
    for a, b in taken:
        if a > pos:
            out.append((pos, a))
        pos = b
    if pos < size:
        out.append((pos, size))
    return out


def _rewrite(final: pm.Pagemap, parent: list[tuple[int, int]]) -> pm.Pagemap:
    """The final pagemap with every present run split at the parent ranges."""
    runs, pos, i = [], 0, 0
    for r in final.runs:
        if not r.present:
            runs.append(r)
            continue
        start, end = pos, pos + r.pages * PAGE
        cut = start
        while i < len(parent) and parent[i][0] < end:
            a, b = max(parent[i][0], start), min(parent[i][1], end)
            if a > cut:
                runs.append(pm.Run(r.vaddr + cut - start, (a - cut) // PAGE, r.flags))
            runs.append(pm.Run(r.vaddr + a - start, (b - a) // PAGE, pm.PE_PARENT))
            cut = b
            if parent[i][1] > end:
                break  # the range goes on into the next run
            i += 1
        if cut < end:
            runs.append(pm.Run(r.vaddr + cut - start, (end - cut) // PAGE, r.flags))
        pos = end
    return pm.Pagemap(final.pages_id, tuple(runs))


def _covering(chunks: list[Chunk], ranges: list[tuple[int, int]]) -> Runs:
    """The chunks that hold any byte of ``ranges``, as runs at their offsets."""
    runs: Runs = []
    pos, i, run_end = 0, 0, -1
    for c in chunks:
        end = pos + c.size
        while i < len(ranges) and ranges[i][1] <= pos:
            i += 1
        if i < len(ranges) and ranges[i][0] < end:
            if run_end == pos:
                runs[-1][1].append(c)
            else:
                runs.append((pos, [c]))
            run_end = end
        pos = end
    return runs


def plan(new: list[Chunk], old: list[tuple[str, int]], fm: pm.Pagemap,
         parent_map: pm.Pagemap) -> Plan:
    """The final round's pages (chunk list ``new``, pagemap ``fm``) against
    round 1's (chunk list ``old``, pagemap ``parent_map``)."""
    size = sum(c.size for c in new)
    if fm.present_bytes() != size:
        raise pm.ImageError(f"the pagemap names {fm.present_bytes()} bytes of pages, "
                            f"the pages file has {size}")
    ranges = parent_ranges(new, old, fm, parent_map)
    own = _complement(size, ranges)
    return Plan(pm.serialize(_rewrite(fm, ranges)), own, _covering(new, own),
                sum(b - a for a, b in ranges))


def compact(scratch: Path, out: Path, own: list[tuple[int, int]]) -> int:
    """The own ranges of ``scratch`` (the final file's offsets, written there
    by chunk) one after another into ``out``: the pages file CRIU reads
    beside its parent. Bytes."""
    written = 0
    with open(scratch, "rb", buffering=0) as src, open(out, "wb", buffering=0) as dst:
        for a, b in own:
            left, at = b - a, a
            while left:
                try:
                    n = os.copy_file_range(src.fileno(), dst.fileno(), left, at)
                except OSError:
                    n = 0
                if n <= 0:  # no in-kernel copy here: through a buffer
                    data = os.pread(src.fileno(), min(left, 8 << 20), at)
                    if not data:
                        raise OSError(f"short read at {at} of {scratch}")
                    n = os.write(dst.fileno(), data)
                at, left, written = at + n, left - n, written + n
    return written
