"""Content-defined chunking of checkpoint files, aligned to 512-byte blocks.

Why not byte-granular gear/FastCDC: a gear hash vectorised with numpy (the
32-byte window summed by doubling) keeps a core busy at a fraction of the
rate a push needs, and a per-byte Python loop is slower by orders of magnitude. Checkpoint data never
needs byte granularity: CRIU's pages-*.img hold whole 4 KiB pages (a mapping
that appears, grows or goes moves the rest by whole pages) and Podman's tar
members (rootfs-diff.tar, devshm-checkpoint.tar) move in 512-byte blocks.
So cut points are only considered every GRID bytes from the file's start,
decided by a hash of the WINDOW bytes before each: the boundaries are still
defined by content (an insertion of whole blocks shifts them with the data,
and chunks after it are found again), with FastCDC's normalisation (a
stricter mask before the average size, a looser one after it). Fixed-size
chunks would lose every chunk after the first inserted page.

The hash is computed for all positions of a range at once, in C: SAMPLES
bytes of each window (every 17th), taken for every position by one strided
slice each, mapped through per-sample random tables (bytes.translate) and
XORed together as big integers: the low hash byte of every position. A
candidate is found with bytes.find; only candidates get their higher bits
(one by one: one position in 2^8 or fewer). One zlib.crc32 call per position
in a Python loop would cost a Python call per position: the largest part of
a push's own CPU.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from typing import BinaryIO, Iterator

GRID = 512
WINDOW = 256
# A file is cut into segments of SEGMENT_CHUNKS maximal chunks, chunked one by
# one: a chunk never crosses a segment's end. Segments are what several
# processes chunk and upload at once (gpusnap/oci/segments.py), and a file read
# in one stream must be cut alike, or the two would not share a chunk.
SEGMENT_CHUNKS = 16
SAMPLES = tuple(1 + 17 * j for j in range(16))  # offsets before the position, 1..256
ALGORITHM = (f"gpusnap-cdc2: 2 bytes from {len(SAMPLES)} table-mapped samples of the "
             f"{WINDOW} bytes before every {GRID}-byte boundary; no chunk crosses a multiple "
             f"of {SEGMENT_CHUNKS} x max")


def _tables() -> tuple[tuple[bytes, ...], ...]:
    """Fixed pseudo-random byte maps, one per sample and hash byte (low, high,
    top): from sha256, so every host and version cuts alike."""
    def table(lane: str, j: int) -> bytes:
        out = b""
        block = 0
        while len(out) < 256:
            out += hashlib.sha256(f"gpusnap-cdc2/{lane}/{j}/{block}".encode()).digest()
            block += 1
        return out[:256]
    low = [table("low", j) for j in range(len(SAMPLES))]
    # Zeroed memory (a whole block of 0 bytes) must never cut, so that zero
    # runs give max-size chunks: give the all-zero window an odd low byte.
    zero = 0
    for t in low:
        zero ^= t[0]
    if not zero & 1:
        low[0] = bytes([low[0][0] ^ 1]) + low[0][1:]
    return (tuple(low), *(tuple(table(lane, j) for j in range(len(SAMPLES)))
                          for lane in ("high", "top")))


_LOW, _HIGH, _TOP = _tables()
_STEP = 1024  # positions hashed at once: 512 KiB of data


def _hash_byte(view: memoryview, first: int, count: int, tables: tuple[bytes, ...]) -> bytes:
    """One hash byte for each of ``count`` positions first, first + GRID, ..."""
    acc = 0
    for offset, table in zip(SAMPLES, tables):
        start = first - offset
        column = view[start:start + (count - 1) * GRID + 1:GRID].tobytes()
        acc ^= int.from_bytes(column.translate(table), "little")
    return acc.to_bytes(count, "little")


@functools.cache
def _passes(mask: int) -> bytes:
    """A translate table: byte b -> 1 when b & mask == 0 (the low hash byte
    passes). Made on first use: a push uses two masks of the 256."""
    return bytes(int(b & mask == 0) for b in range(256))


def _first_cut(view: memoryview, lo: int, hi: int, mask: int) -> int | None:
    """The first position p in [lo, hi), p - lo a multiple of GRID, whose hash
    has no bit of ``mask`` set."""
    high = mask >> 8
    flag = _passes(mask & 0xFF)
    while lo < hi:  # in steps: the cut is usually near the front of a long range
        count = min((hi - lo + GRID - 1) // GRID, _STEP)
        flags = _hash_byte(view, lo, count, _LOW).translate(flag)
        i = flags.find(1)
        while i != -1:
            pos = lo + i * GRID
            if not high or not _high_at(view, pos) & high:
                return pos
            i = flags.find(1, i + 1)
        lo += count * GRID
    return None


def _high_at(view: memoryview, pos: int) -> int:
    """Hash bits 8-23 of one position (masks past 16 bits: very large chunks)."""
    h = 0
    for offset, high, top in zip(SAMPLES, _HIGH, _TOP):
        b = view[pos - offset]
        h ^= high[b] | top[b] << 8
    return h


@dataclass(frozen=True)
class ChunkParams:
    min_size: int = 1 << 20
    avg_size: int = 4 << 20
    max_size: int = 16 << 20

    def __post_init__(self) -> None:
        if not (GRID <= self.min_size < self.avg_size < self.max_size):
            raise ValueError(f"chunk sizes must grow: {self}")
        if any(s % GRID for s in (self.min_size, self.avg_size, self.max_size)):
            raise ValueError(f"chunk sizes must be multiples of {GRID}")

    @property
    def segment(self) -> int:
        """Bytes of a segment: chunks end at every multiple of it."""
        return SEGMENT_CHUNKS * self.max_size

    @property
    def masks(self) -> tuple[int, int]:
        """(before avg, from avg on): a position is a cut when hash & mask == 0.

        FastCDC's normalisation: before avg a cut is half as likely as after
        it, so sizes bunch around avg and few chunks reach max. With
        min = avg/4 the mean comes out at avg (1.01x, computed).
        """
        bits = max((self.avg_size // GRID).bit_length() - 1, 3)
        return (1 << bits) - 1, (1 << (bits - 1)) - 1


def find_cut(buf: bytes | bytearray | memoryview, params: ChunkParams, eof: bool) -> int | None:
    """Length of the next chunk at the front of ``buf`` (which starts at a
    chunk boundary), or None when more data is needed to decide."""
    n = len(buf)
    if n >= params.max_size:
        end = params.max_size
    elif eof:
        end = n
    else:
        return None
    view = memoryview(buf)
    strict, loose = params.masks
    # A cut "after" the window's hash matches; the window lies inside the chunk.
    mid = min(params.avg_size, end)
    cut = _first_cut(view, params.min_size, mid, strict)
    if cut is None:
        start = params.min_size + max(0, -(-(mid - params.min_size) // GRID)) * GRID
        cut = _first_cut(view, start, end, loose)
    return end if cut is None else cut


def chunks_of(view: memoryview, params: ChunkParams) -> Iterator[memoryview]:
    """The chunks of one whole segment held in memory (a mapped file: no copy),
    as views into it: the same cuts ``split`` makes of it, whose only end of
    data inside a segment is the segment's end."""
    pos, n = 0, len(view)
    while pos < n:
        cut = find_cut(view[pos:], params, True)
        yield view[pos:pos + cut]
        pos += cut


def split(stream: BinaryIO, params: ChunkParams, size: int | None = None) -> Iterator[bytes]:
    """Read ``stream`` (``size`` bytes, or to EOF) and yield its chunks in order.

    One buffer of 2 * max_size, filled with readinto: the data is copied once
    from the stream and once into each chunk, and the unread tail is moved to
    the front only when less than max_size is left behind it. A segment's end
    (params.segment) is an end of data for the chunk before it.
    """
    cap = 2 * params.max_size
    buf = bytearray(cap)
    view = memoryview(buf)
    start = filled = 0
    offset = 0  # of view[start] in the stream
    left = size
    eof = False
    readinto = getattr(stream, "readinto", None)
    try:
        while True:
            while not eof and filled - start < params.max_size:
                if cap - filled < params.max_size:  # compact: the tail moves to the front
                    view[:filled - start] = view[start:filled]
                    start, filled = 0, filled - start
                want = cap - filled if left is None else min(cap - filled, left)
                if want <= 0:
                    eof = True
                    break
                if readinto is not None:
                    n = readinto(view[filled:filled + want])
                else:
                    piece = stream.read(want)
                    n = len(piece)
                    view[filled:filled + n] = piece
                if not n:
                    eof = True
                    break
                filled += n
                if left is not None:
                    left -= n
            if filled == start:
                if left:
                    raise EOFError(f"stream ended {left} bytes early")
                return
            to_segment_end = params.segment - offset % params.segment
            if to_segment_end <= filled - start:
                cut = find_cut(view[start:start + to_segment_end], params, True)
            else:
                cut = find_cut(view[start:filled], params, eof)
            if cut is None:  # cannot happen: max_size is buffered, or EOF
                raise AssertionError("chunker needs more data")
            yield bytes(view[start:start + cut])
            start += cut
            offset += cut
    finally:
        view.release()
