"""Content-defined chunking of checkpoint files, aligned to 512-byte blocks.

Why not byte-granular gear/FastCDC: a gear hash vectorised with numpy (the
32-byte window summed by doubling) ran at 150-240 MB/s on the build host and
kept a core busy; a per-byte Python loop is ~100x slower. Checkpoint data never
needs byte granularity: CRIU's pages-*.img hold whole 4 KiB pages (a mapping
that appears, grows or goes moves the rest by whole pages) and Podman's tar
members (rootfs-diff.tar, devshm-checkpoint.tar) move in 512-byte blocks.
So cut points are only considered every GRID bytes from the file's start,
decided by a CRC of the WINDOW bytes before each: the boundaries are still
defined by content (an insertion of whole blocks shifts them with the data,
and chunks after it are found again), but only 1 position in 512 is hashed,
in C (zlib.crc32): ~2 GB/s with FastCDC's normalisation (a stricter mask
before the average size, a looser one after it). Fixed-size chunks would lose
every chunk after the first inserted page.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import BinaryIO, Iterator

GRID = 512
WINDOW = 256
ALGORITHM = f"gpusnap-cdc: crc32 of {WINDOW} bytes before every {GRID}-byte boundary"


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
    def masks(self) -> tuple[int, int]:
        """(before avg, from avg on): a position is a cut when crc & mask == 0.

        FastCDC's normalisation: before avg a cut is half as likely as after
        it, so sizes bunch around avg and few chunks reach max. With
        min = avg/4 the mean comes out at avg (1.01x computed, ~1.0x measured).
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
    crc = zlib.crc32
    # A cut "after" the window's CRC matches; the window lies inside the chunk.
    pos = params.min_size
    stop = min(params.avg_size, end)
    while pos < stop:
        if crc(view[pos - WINDOW:pos]) & strict == 0:
            return pos
        pos += GRID
    while pos < end:
        if crc(view[pos - WINDOW:pos]) & loose == 0:
            return pos
        pos += GRID
    return end


def split(stream: BinaryIO, params: ChunkParams, size: int | None = None) -> Iterator[bytes]:
    """Read ``stream`` (``size`` bytes, or to EOF) and yield its chunks in order.

    One buffer of 2 * max_size, filled with readinto: the data is copied once
    from the stream and once into each chunk, and the unread tail is moved to
    the front only when less than max_size is left behind it.
    """
    cap = 2 * params.max_size
    buf = bytearray(cap)
    view = memoryview(buf)
    start = filled = 0
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
            cut = find_cut(view[start:filled], params, eof)
            if cut is None:  # cannot happen: max_size is buffered, or EOF
                raise AssertionError("chunker needs more data")
            yield bytes(view[start:start + cut])
            start += cut
    finally:
        view.release()
