"""Chunk, compress and upload the segments of big files in several processes.

One Python process pushed at ~270 MB/s on a 16-core H100 host, where the
registry alone took 720 MB/s from 16 parallel uploads and one core chunks at
~640 MB/s (bench/ingest.py, docs/benchmarks.md): the chunker, the HTTP client
and the bookkeeping all hold the one GIL. A big file (CRIU's pages of a GPU
process: as large as its GPU memory) is therefore cut into segments
(chunker.SEGMENT_CHUNKS maximal chunks; a chunk never crosses a segment's end,
so a file read in one stream is cut the same), and each segment is read with
pread, chunked, hashed, compressed and uploaded by one of several worker
processes, each with its own registry connections and a few upload threads.

Workers start by spawn (not fork: the pushing process has threads) and build
their registry client and cache once. What comes back per segment: its chunks
in order and the counts of what crossed the network. Encrypted pushes stay in
the pushing process (the sealing keys are not handed to other processes).
"""

from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from gpusnap.oci import chunker
from gpusnap.oci.bundle import Chunk
from gpusnap.oci.registry import RegistryOptions

THREADS_PER_WORKER = 3  # uploads in flight per worker while its main thread chunks


def default_workers() -> int:
    """Half the cores, 2 to 12: the registry on loopback, Podman and the pushing
    process need the rest (the registry took ~4 cores at 700 MB/s)."""
    return max(2, min(12, (os.cpu_count() or 2) // 2))


@dataclass(frozen=True)
class Segment:
    path: str
    offset: int  # where the file's data starts in ``path`` (0, or a member's in a tar)
    start: int  # the segment, in the file's own offsets
    length: int
    params: chunker.ChunkParams


@dataclass
class SegmentResult:
    chunks: list[Chunk]
    raw_bytes: int
    network_bytes: int
    sent: int


class _Range:
    """``length`` bytes of a file from ``offset``, read with pread (no shared file position)."""

    def __init__(self, fd: int, offset: int, length: int) -> None:
        self.fd, self.pos, self.end = fd, offset, offset + length

    def readinto(self, buf) -> int:
        want = min(len(buf), self.end - self.pos)
        if want <= 0:
            return 0
        n = os.preadv(self.fd, [memoryview(buf)[:want]], self.pos)
        self.pos += n
        return n


# -- in the worker process ------------------------------------------------------------

_worker: dict = {}


def _init(ref: str, opts: RegistryOptions, cache_root: str | None, level: int) -> None:
    from gpusnap.oci import reference
    from gpusnap.oci.cache import ChunkCache
    from gpusnap.oci.registry import RegistryClient
    from gpusnap.oci.transfer import Uploader

    client = RegistryClient(reference.parse(ref), opts, push=True)
    cache = ChunkCache.open(Path(cache_root)) if cache_root else None
    _worker["uploader"] = Uploader(client, cache, level, THREADS_PER_WORKER)


def _run(seg: Segment) -> SegmentResult:
    uploader = _worker["uploader"]
    before = uploader.stats.network_bytes, uploader.stats.chunks_transferred
    fd = os.open(seg.path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        futures = [uploader.submit(piece) for piece in
                   chunker.split(_Range(fd, seg.offset + seg.start, seg.length), seg.params,
                                 seg.length)]
        chunks = [f.result() for f in futures]
    finally:
        os.close(fd)
    return SegmentResult(chunks, seg.length, uploader.stats.network_bytes - before[0],
                         uploader.stats.chunks_transferred - before[1])


# -- in the pushing process -------------------------------------------------------------


class SegmentPool:
    """Worker processes for the big files of one push; ``submit_file`` returns a
    future per segment (-> SegmentResult), in file order."""

    def __init__(self, ref: str, opts: RegistryOptions, cache_root: Path | None, level: int,
                 workers: int) -> None:
        self.workers = workers
        self._pool = ProcessPoolExecutor(
            workers, mp_context=multiprocessing.get_context("spawn"), initializer=_init,
            initargs=(ref, opts, str(cache_root) if cache_root else None, level))

    def submit_file(self, path: Path, offset: int, size: int, params: chunker.ChunkParams,
                    start: int = 0) -> list[Future]:
        """The segments of ``path`` from ``start`` (a multiple of the segment) to ``size``."""
        step = params.segment
        return [self.submit(path, offset + at, min(step, size - at), params)
                for at in range(start, size, step)]

    def submit(self, path: Path, start: int, length: int, params: chunker.ChunkParams) -> Future:
        return self._pool.submit(_run, Segment(str(path), 0, start, length, params))

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def worth_it(size: int, params: chunker.ChunkParams) -> bool:
    """Files of at least four segments go to the workers; smaller ones are read
    in the pushing process (a worker costs a Python start, ~0.3 s, once)."""
    return size >= 4 * params.segment
