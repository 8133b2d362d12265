"""Chunk, compress and upload the segments of big files in several processes.

One Python process pushes at a fraction of what the registry takes from
parallel uploads and of what one core chunks (bench/ingest.py,
docs/benchmarks.md): the chunker, the HTTP client and the bookkeeping all
hold the one GIL. A big file (CRIU's pages of a GPU
process: as large as its GPU memory) is therefore cut into segments
(chunker.SEGMENT_CHUNKS maximal chunks; a chunk never crosses a segment's end,
so a file read in one stream is cut the same), and each segment is read with
pread, chunked, hashed, compressed and uploaded by one of several worker
processes, each with its own registry connections and a few upload threads.

The pull side is the mirror image (FetchPool): each worker fetches, verifies
and decompresses one segment's chunks into a file of its own (on /dev/shm),
and the pulling process copies those files, in order, into the tar it writes
(Podman's import pipe, or an archive). A window of segments bounds the RAM
those files take, and no chunk data passes through the pulling process's heap.

Workers start by spawn (not fork: the pushing process has threads) and build
their registry client and cache once. What comes back per segment: its chunks
in order and the counts of what crossed the network. Encrypted pushes stay in
the pushing process (the sealing keys are not handed to other processes).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import shutil
import tempfile
import time
from collections import deque
# BrokenExecutor, not concurrent.futures.process's BrokenProcessPool: that module
# imports multiprocessing (~13 ms), which only a push or pull with workers needs.
from concurrent.futures import BrokenExecutor, Executor, Future
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

from gpusnap.errors import GpusnapError
from gpusnap.oci import chunker, reference
from gpusnap.oci.bundle import Chunk
from gpusnap.oci.cache import ChunkCache
from gpusnap.oci.registry import RegistryClient, RegistryOptions
from gpusnap.oci.transfer import Downloader, Uploader

THREADS_PER_WORKER = 3  # uploads in flight per worker while its main thread chunks


PROCESSES_ENV = "GPUSNAP_PROCESSES"
MIN_CORES = 8  # below this, workers only compete with Podman and the registry


def default_workers(stopped: bool = False) -> int:
    """GPUSNAP_PROCESSES, else on hosts of 8 cores or more half the cores (at
    most 12), or where the container is stopped for the push all but 4 (at
    most 24); on smaller hosts 0: the pushing process does it all. The registry
    on loopback, Podman and the pushing process need the other half (a
    registry at full rate keeps several cores busy); on a small host workers
    only compete with the pushing process, and a migration is slower with them
    (docs/benchmarks.md). A stopped
    container's cores are idle, and a final pre-copy round sends little but
    must hash every byte: there the workers set the pace of the stop."""
    env = os.environ.get(PROCESSES_ENV, "").strip()
    if env.isdigit():
        return int(env)
    cores = os.cpu_count() or 1
    if cores < MIN_CORES:
        return 0
    return min(24, cores - 4) if stopped else min(12, cores // 2)


@dataclass(frozen=True)
class Segment:
    path: str
    start: int
    length: int
    params: chunker.ChunkParams
    # (offset in the file, chunk) known to hold those bytes: a cut that lands on
    # one takes it without hashing (pages/same_pages.py: a pre-copy's final round)
    known: tuple[tuple[int, Chunk], ...] = ()


@dataclass
class SegmentResult:
    chunks: list[Chunk]
    counts: dict  # the worker's transfer.Stats moved by this segment: for count_elsewhere()


# -- in the worker process ------------------------------------------------------------

_worker: dict = {}


def _client_and_cache(ref: str, opts: RegistryOptions, cache_root: str | None, push: bool):
    """A worker's own registry connection and chunk cache, built once in its initializer."""
    return (RegistryClient(reference.parse(ref), opts, push=push),
            ChunkCache.open(Path(cache_root)) if cache_root else None)


def _moved(stats, before: dict) -> dict:
    """What a worker's Stats gained since ``before`` (its to_dict())."""
    return {k: v - before[k] for k, v in stats.to_dict().items()}


def _init(ref: str, opts: RegistryOptions, cache_root: str | None, level: int) -> None:
    _worker["uploader"] = Uploader(*_client_and_cache(ref, opts, cache_root, True), level,
                                   THREADS_PER_WORKER)


def _run(seg: Segment) -> SegmentResult:
    """The segment's file is mapped, not read: chunks are views into the page
    cache, hashed (and, where new, compressed) where they lie: a worker that
    reads with pread into a buffer and copies a bytes object per chunk is
    markedly slower (bench/push_hash.py). Each chunk's pages leave the
    worker's page tables once it is done, so its RSS stays at what is in flight."""
    uploader = _worker["uploader"]
    before = uploader.stats.to_dict()
    if seg.length <= 0:
        return SegmentResult([], _moved(uploader.stats, before))
    skip = seg.start % mmap.ALLOCATIONGRANULARITY
    fd = os.open(seg.path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        if size < seg.start + seg.length:  # a mapping past the end would be SIGBUS
            raise EOFError(f"{seg.path} ends at {size}, before {seg.start + seg.length}")
        mapped = mmap.mmap(fd, seg.length + skip, mmap.MAP_SHARED, mmap.PROT_READ,
                           offset=seg.start - skip)
    finally:
        os.close(fd)
    known = dict(seg.known)
    try:
        with memoryview(mapped) as whole:
            futures, pos = [], skip
            for piece in chunker.chunks_of(whole[skip:], seg.params):
                same = known.get(seg.start + pos - skip)
                futures.append(uploader.known(same) if same is not None and same.size == len(piece)
                               else uploader.submit(piece))
                futures[-1].add_done_callback(_release(mapped, pos, len(piece)))
                pos += len(piece)
                del piece
            chunks = [f.result() for f in futures]
    finally:
        with contextlib.suppress(BufferError):
            mapped.close()  # else at its last view's release
    return SegmentResult(chunks, _moved(uploader.stats, before))


def _release(mapped: mmap.mmap, offset: int, length: int):
    """A done chunk's pages out of this process's page tables (the file keeps them)."""
    def done(_future) -> None:
        start = offset - offset % mmap.PAGESIZE
        with contextlib.suppress(ValueError, OSError):
            mapped.madvise(mmap.MADV_DONTNEED, start, offset + length - start)
    return done


# -- in the pushing process -------------------------------------------------------------


def _process_pool(workers: int, initializer: Callable, initargs: tuple) -> Executor:
    """Worker processes started fresh ("spawn"): never a fork of this threaded process."""
    import multiprocessing  # start-up: most commands never start a pool
    from concurrent.futures import ProcessPoolExecutor

    return ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                               initializer=_worker_start, initargs=(initializer, initargs))


def _worker_start(initializer: Callable, initargs: tuple) -> None:
    """A worker's start: Ctrl-C ends it at once and quietly (each printed a
    KeyboardInterrupt traceback beside the CLI's one line; ignored, the CLI's
    pool close waited for segments of 256 MiB to finish), and a worker whose
    CLI was killed leaves rather than wait on its queue forever."""
    import signal
    import threading

    signal.signal(signal.SIGINT, lambda signum, frame: os._exit(130))
    parent = os.getppid()

    def orphaned() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)
    threading.Thread(target=orphaned, name="parent-watch", daemon=True).start()
    initializer(*initargs)


class SegmentPool:
    """Worker processes for the big files of one push; ``submit_file`` returns a
    future per segment (-> SegmentResult), in file order."""

    def __init__(self, ref: str, opts: RegistryOptions, cache_root: Path | None, level: int,
                 workers: int) -> None:
        self.workers = workers
        self._pool = _process_pool(workers, _init,
                                   (ref, opts, str(cache_root) if cache_root else None, level))

    def submit_file(self, path: Path, size: int, params: chunker.ChunkParams,
                    have: dict[int, Future] | None = None) -> list[Future]:
        """The futures of every segment of ``path`` in order: those in ``have``
        (submitted early, by offset), the others submitted now."""
        step, have = params.segment, have or {}
        return [have[at] if at in have else self.submit(path, at, min(step, size - at), params)
                for at in range(0, size, step)]

    def submit(self, path: Path, start: int, length: int, params: chunker.ChunkParams,
               known: tuple[tuple[int, Chunk], ...] = ()) -> Future:
        try:
            return self._pool.submit(_run, Segment(str(path), start, length, params, known))
        except BrokenExecutor:  # a worker died before this segment was handed out
            raise worker_died("push") from None

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def known(chunks: list[Chunk]) -> Future:
    """A segment's result, done already: its chunks known without reading a
    byte of it (pages/same_pages.py: a pre-copy's final round)."""
    done: Future = Future()
    raw = sum(c.size for c in chunks)
    done.set_result(SegmentResult(chunks, {"chunks": len(chunks), "chunks_transferred": 0,
                                           "raw_bytes": raw, "network_bytes": 0,
                                           "known_bytes": raw}))
    return done


def worth_it(size: int, params: chunker.ChunkParams) -> bool:
    """Files of at least four segments go to the workers; smaller ones are read
    in the pushing process (a worker costs a Python start, once)."""
    return size >= 4 * params.segment


# -- pull: segments fetched into files by worker processes --------------------------------

FETCH_SEGMENT = 64 << 20  # raw bytes a worker fetches into one file (8-16 chunks)
FETCH_THREADS = 3  # downloads in flight per worker


@dataclass(frozen=True)
class FetchSegment:
    out: str  # the file the worker writes (created 0600)
    chunks: list[Chunk]
    offset: int = -1  # >= 0: write into ``out`` (it exists) from there, in place
    mapped: bool = False  # in place through a shared mapping, not pwrite (_write_mapped)


def _init_fetch(ref: str, opts: RegistryOptions, cache_root: str | None) -> None:
    _worker["downloader"] = Downloader(*_client_and_cache(ref, opts, cache_root, False),
                                       FETCH_THREADS)


def _fetch(seg: FetchSegment) -> dict:
    downloader = _worker["downloader"]
    before = downloader.stats.to_dict()
    if seg.mapped:
        _write_mapped(seg.out, seg.offset, sum(c.size for c in seg.chunks),
                      downloader.fetch(seg.chunks))
        return _moved(downloader.stats, before)
    in_place = seg.offset >= 0
    fd = os.open(seg.out, os.O_WRONLY | os.O_CLOEXEC if in_place else
                 os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    pos = max(seg.offset, 0)
    try:
        for piece in downloader.fetch(seg.chunks):
            view = memoryview(piece)
            while view:
                n = os.pwrite(fd, view, pos) if in_place else os.write(fd, view)
                view, pos = view[n:], pos + n
    finally:
        os.close(fd)
    return _moved(downloader.stats, before)


def _write_mapped(path: str, offset: int, length: int, pieces: Iterable[bytes]) -> None:
    """``pieces`` copied into ``path`` from ``offset`` through a shared mapping.

    Why not pwrite: every write(2) to one file takes its inode lock, so a dozen
    workers writing one pages file on a tmpfs take turns (their cores busy
    mostly spinning on that lock: docs/benchmarks.md); page faults
    on a shared mapping take no such lock. Only for a tmpfs file that has the
    room (memory.ram_dir checked it): a mapping of a file the filesystem cannot
    grow raises SIGBUS, where write(2) would say ENOSPC."""
    if length == 0:
        return
    start = offset - offset % mmap.ALLOCATIONGRANULARITY  # mappings start page-aligned
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    try:
        with mmap.mmap(fd, offset + length - start, offset=start) as mm:
            pos = offset - start
            for piece in pieces:
                n = len(piece)
                mm[pos:pos + n] = piece
                pos += n
    finally:
        os.close(fd)


def fetch_segments(chunks: list[Chunk]) -> list[list[Chunk]]:
    """A file's chunks in runs of about FETCH_SEGMENT raw bytes."""
    out: list[list[Chunk]] = [[]]
    size = 0
    for c in chunks:
        if size >= FETCH_SEGMENT:
            out.append([])
            size = 0
        out[-1].append(c)
        size += c.size
    return [run for run in out if run]


def worth_fetching(size: int) -> bool:
    return size >= 4 * FETCH_SEGMENT


class FetchPool:
    """Worker processes that fetch big files' segments into files under a
    scratch folder; ``pieces(chunks)`` yields the file's bytes in order."""

    def __init__(self, ref: str, opts: RegistryOptions, cache_root: Path | None, workers: int,
                 count: Callable[[dict], None]) -> None:
        self.workers, self._count = workers, count
        self.window = workers + 2  # segments fetched or waiting to be copied: RAM bound
        self.dir = Path(tempfile.mkdtemp(prefix=FETCH_PREFIX, dir=_scratch(self.window)))
        self._initargs = (ref, opts, str(cache_root) if cache_root else None)
        # Made at the first segment: a restore that only links prepared files
        # starts no process (not even multiprocessing's resource tracker).
        self._pool: Executor | None = None
        self._n = 0

    @property
    def started(self) -> bool:
        return self._pool is not None

    def pieces(self, chunks: list[Chunk], buffer: int = 4 << 20) -> Iterator[memoryview]:
        runs = deque(fetch_segments(chunks))
        pending: deque[tuple[Path, Future]] = deque()
        buf = bytearray(buffer)
        try:
            while runs or pending:
                while runs and len(pending) < self.window:
                    self._n += 1
                    out = self.dir / f"{self._n}.seg"
                    pending.append((out, self._submit(FetchSegment(str(out), runs.popleft()))))
                out, future = pending.popleft()
                self._done(future)
                with open(out, "rb", buffering=0) as f:
                    while n := f.readinto(buf):
                        yield memoryview(buf)[:n]
                out.unlink()
        finally:
            for _, f in pending:
                f.cancel()

    def _submit(self, segment: FetchSegment) -> Future:
        if self._pool is None:
            self._pool = _process_pool(self.workers, _init_fetch, self._initargs)
        try:
            return self._pool.submit(_fetch, segment)
        except BrokenExecutor:  # a worker died before this segment was handed out
            raise worker_died("pull", self._initargs[2] is not None) from None

    def _done(self, future: Future) -> None:
        """A segment's counts, once it is fetched; a dead worker in one line."""
        try:
            self._count(future.result())
        except BrokenExecutor:
            raise worker_died("pull", self._initargs[2] is not None) from None

    def write_file(self, chunks: list[Chunk], path: Path,
                   check: Callable[[], None] = lambda: None, mapped: bool = False) -> int:
        """A file's chunks written into ``path`` by the workers, each segment at
        its offset (no copy through this process, no order to keep): CRIU's
        pages beside Podman's import (pages/pages_aside.py). ``check``: called
        as segments complete, raises to stop. ``mapped``: a tmpfs file, written
        through mappings (_write_mapped). Returns the bytes written."""
        size = sum(c.size for c in chunks)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, size)
        finally:
            os.close(fd)
        return self.patch_file([(0, chunks)], path, check, mapped)

    def patch_file(self, runs: list[tuple[int, list[Chunk]]], path: Path,
                   check: Callable[[], None] = lambda: None, mapped: bool = False) -> int:
        """Runs of chunks, each (offset, chunks), written into the existing file
        ``path`` in place, as write_file does (pages/prepared_pages.py: only what
        differs from a file prepared ahead). Returns the bytes written."""
        futures, written = [], 0
        for start, chunks in runs:
            offset = start
            for run in fetch_segments(chunks):
                futures.append(self._submit(FetchSegment(str(path), run, offset, mapped)))
                offset += sum(c.size for c in run)
            written += offset - start
        try:
            for future in futures:
                self._done(future)
                check()
        finally:
            for future in futures:
                future.cancel()
        return written

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        shutil.rmtree(self.dir, ignore_errors=True)


def worker_died(verb: str, cached: bool = True) -> GpusnapError:
    """A worker process killed (the OOM killer's way), in one line: ``verb``
    push or pull; what is done already is not done again (a pull's, where it
    has a chunk cache)."""
    if verb == "push":
        return GpusnapError("a push worker process died (out of memory?)",
                            "push again: chunks already sent are skipped")
    return GpusnapError("a download worker process died (out of memory?)",
                        "run the command again: chunks already fetched are in the cache"
                        if cached else "run the command again")


# A killed pull leaves its scratch (RAM, on /dev/shm): `gpusnap doctor --fix` finds it by this
FETCH_PREFIX = "gpusnap-fetch-"
SCRATCH_ROOTS = (Path("/dev/shm"), Path("/var/tmp"))


def _scratch(window: int) -> Path:
    """/dev/shm when it holds the window of segments twice over, else /var/tmp."""
    shm, disk = SCRATCH_ROOTS
    try:
        if shutil.disk_usage(shm).free >= 2 * window * FETCH_SEGMENT:
            return shm
    except OSError:
        pass
    return disk
