"""Chunks to and from a registry, several in flight, memory bounded.

Upload: hash the raw chunk, skip it when the registry already has its blob
(a HEAD; the cache remembers which blob a raw chunk became, so unchanged
memory is not even compressed again), else compress and upload.
Download: cache or registry, blob digest checked, decompressed, raw digest
checked, handed out in order.

Memory is bounded by bytes, not by a count of chunks (chunks are 64 KiB to
16 MiB and more): at most IN_FLIGHT_BYTES of raw chunk data are queued or
being worked on, each chunk's raw bytes are dropped as soon as they are
compressed (push) and each blob as soon as it is decompressed (pull).
"""

from __future__ import annotations

import copy
import hashlib
import threading
from collections import Counter, deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable, Iterator

from gpusnap.errors import GpusnapError
from gpusnap.oci.bundle import Chunk
from gpusnap.oci.cache import ChunkCache
from gpusnap.oci.lazy import need
from gpusnap.oci.malloc import one_heap_for_all_threads
from gpusnap.oci.registry import DigestMismatch, RegistryClient, damaged

if TYPE_CHECKING:  # cryptography: only where a checkpoint is encrypted
    from gpusnap.trust.encrypt import ChunkCipher

# 8 workers x 4 MiB average chunks keep every worker busy; a chunk and its
# compressed copy coexist briefly, so chunk data stays under ~2x this.
IN_FLIGHT_BYTES = 48 << 20
# Blobs that occur again later in the same pull (zero pages, repeated weights)
# are kept until their last occurrence, up to this many compressed bytes.
REPEAT_BYTES = 64 << 20

Progress = Callable[[int, int], None]  # (raw bytes done, bytes that crossed the network)


def sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _again(exc: BaseException) -> BaseException:
    """EXC for one more chunk, as a copy: one exception object raised from many
    threads gathers every raiser's frames on its traceback, and with them the
    chunk bytes each frame holds."""
    try:
        fresh = copy.copy(exc)
    except Exception:  # noqa: BLE001 -- an exception that does not copy: its words
        fresh = GpusnapError(str(exc))
    fresh.__traceback__ = None
    return fresh


@dataclass
class Stats:
    chunks: int = 0
    chunks_transferred: int = 0
    raw_bytes: int = 0
    network_bytes: int = 0  # compressed bytes sent or fetched
    cached_bytes: int = 0  # compressed bytes served by the local cache (pull)
    repeated_bytes: int = 0  # compressed bytes of a blob seen earlier in this pull
    known_bytes: int = 0  # raw bytes taken as chunks known already, not read (push: known())

    def to_dict(self) -> dict:
        return dict(vars(self))


class ByteBudget:
    """At most ``limit`` bytes taken at once; a chunk larger than the limit is
    let through alone (after everything else was given back), never refused."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._cond = threading.Condition()

    def fits(self, n: int) -> bool:
        with self._cond:
            return self.used == 0 or self.used + n <= self.limit

    def acquire(self, n: int) -> None:
        with self._cond:
            while self.used and self.used + n > self.limit:
                self._cond.wait()
            self.used += n

    def release(self, n: int) -> None:
        with self._cond:
            self.used -= n
            self._cond.notify_all()


class _Pool:
    def __init__(self, workers: int, progress: Progress | None,
                 in_flight_bytes: int = IN_FLIGHT_BYTES) -> None:
        one_heap_for_all_threads()
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="gpusnap-xfer")
        self.lookahead = 2 * workers
        self.budget = ByteBudget(in_flight_bytes)
        self.stats = Stats()
        self._lock = threading.Lock()
        self._progress = progress
        self._local = threading.local()
        self._error: BaseException | None = None  # the first chunk that failed for good

    def _note(self, future: Future) -> None:
        """A done chunk's failure, the first one kept (a done callback)."""
        if not future.cancelled() and future.exception() is not None and self._error is None:
            self._error = future.exception()

    def _give_up_if_failed(self) -> None:
        """A chunk that failed for good fails the transfer: the chunks queued
        behind it do not go to the registry. Each would try the dead registry
        in its turn, its retries and connect bounds over again (tens of
        seconds a chunk, the one line that much later), for a transfer that
        fails anyway."""
        if self._error is not None:
            raise _again(self._error)

    def _count(self, raw: int, network: int, cached: int = 0, repeated: int = 0) -> None:
        with self._lock:
            self.stats.chunks += 1
            self.stats.chunks_transferred += 1 if network else 0
            self.stats.raw_bytes += raw
            self.stats.network_bytes += network
            self.stats.cached_bytes += cached
            self.stats.repeated_bytes += repeated
        if self._progress:
            self._progress(raw, network)

    def count_elsewhere(self, other: dict) -> None:
        """Counts (Stats fields) of chunks another process moved for this
        transfer (segments.py's workers)."""
        with self._lock:
            for k, v in other.items():
                setattr(self.stats, k, getattr(self.stats, k) + v)
        if self._progress:
            self._progress(other["raw_bytes"], other["network_bytes"])

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


class Uploader(_Pool):
    """With a ``cipher``, each zstd frame is sealed before its blob digest is
    taken (docs/trust.md); the cache then indexes the chunk under
    ``cipher.cache_index``, so plain and sealed blobs of a chunk never mix."""

    def __init__(self, client: RegistryClient, cache: ChunkCache | None, level: int,
                 workers: int, progress: Progress | None = None,
                 cipher: ChunkCipher | None = None) -> None:
        self._zstd = need("zstandard")
        super().__init__(workers, progress)
        self.client, self.cache, self.level, self.cipher = client, cache, level, cipher
        self._present: set[str] = set()  # blobs known to be in the registry

    def submit(self, data: bytes) -> Future:
        """Queue one chunk; blocks while IN_FLIGHT_BYTES are queued or being sent.
        Future -> Chunk."""
        self._give_up_if_failed()
        size = len(data)
        self.budget.acquire(size)
        if self._error is not None:  # failed while this waited for room
            self.budget.release(size)
            self._give_up_if_failed()
        # In a list the worker can take it out of: the pool's work item keeps its
        # arguments until the call returns, which would hold the raw bytes while
        # the compressed blob is uploaded.
        future = self.pool.submit(self._one, [data])
        future.add_done_callback(lambda f: self._done(f, size))
        return future

    def known(self, chunk: Chunk) -> Future:
        """A chunk whose bytes are known to be ``chunk`` (round 1's, in a
        pre-copy's final round: pages/same_pages.py): counted, not read, hashed
        or asked of the registry. Future -> Chunk, done."""
        self._count(chunk.size, 0)
        with self._lock:
            self.stats.known_bytes += chunk.size
        done: Future = Future()
        done.set_result(chunk)
        return done

    def _done(self, future: Future, size: int) -> None:
        self._note(future)  # first: the budget wakes a submit that must see it
        self.budget.release(size)

    def _has(self, blob: str) -> bool:
        if blob in self._present:
            return True
        if self.client.blob_exists(blob):
            self._present.add(blob)
            return True
        return False

    def _one(self, box: list[bytes]) -> Chunk:
        data = box.pop()
        if self._error is not None:
            del data  # not on the traceback of the error raised here
            self._give_up_if_failed()
        size = len(data)
        raw = sha256(data)
        index = self.cipher.cache_index(raw) if self.cipher else raw
        known = self.cache.blob_for(index) if self.cache else None
        if known and self._has(known[0]):
            self._count(size, 0)
            return Chunk(raw, size, known[0], known[1])
        if not hasattr(self._local, "cctx"):  # a compressor is not thread-safe
            self._local.cctx = self._zstd.ZstdCompressor(level=self.level, write_content_size=True)
        blob = self._local.cctx.compress(data)
        del data  # only the blob is needed from here on
        if self.cipher:
            blob = self.cipher.seal_chunk(raw, blob)
        digest = sha256(blob)
        sent = 0
        if self._error is not None:
            del blob
            self._give_up_if_failed()
        if not self._has(digest):
            self.client.put_blob(digest, blob)
            self._present.add(digest)
            sent = len(blob)
        if self.cache:
            self.cache.remember(index, digest, len(blob))
        self._count(size, sent)
        return Chunk(raw, size, digest, len(blob))

    def put_small(self, data: bytes) -> str:
        """A blob stored as it is (the config), unless the registry has it."""
        digest = sha256(data)
        if not self._has(digest):
            self.client.put_blob(digest, data)
        return digest


class _Once:
    """The first fetch of a blob in one pull; later occurrences wait for it."""

    def __init__(self, occurrences: int) -> None:
        self.started = False
        self.done = threading.Event()
        self.blob: bytes | bytearray | None = None  # None: not kept, fetch it again
        self.left = occurrences  # not yet served


class Downloader(_Pool):
    """With a ``cipher`` (an encrypted checkpoint, Remote.cipher), each blob is
    opened (AES-GCM, authenticated) before it is decompressed.

    A blob that occurs several times in one pull is fetched once: the first
    occurrence's worker fetches it, later ones wait for it and take it from
    memory (REPEAT_BYTES at most, dropped after its last occurrence). Two
    workers never fetch one blob at once, so (while REPEAT_BYTES has room) the
    counts do not depend on which worker ran first."""

    def __init__(self, client: RegistryClient, cache: ChunkCache | None, workers: int,
                 progress: Progress | None = None, cipher: ChunkCipher | None = None) -> None:
        self._zstd = need("zstandard")
        super().__init__(workers, progress)
        self.client, self.cache, self.cipher = client, cache, cipher
        self._once: dict[str, _Once] = {}
        self._kept = 0  # bytes of blobs held for a later occurrence

    def _load(self, chunk: Chunk) -> tuple[bytes | bytearray, str]:
        """The blob from the cache or the registry, and which ("cache", "network")."""
        blob = self.cache.get_blob(chunk.blob) if self.cache else None
        if blob is not None:
            return blob, "cache"
        self._give_up_if_failed()
        blob = self.client.get_blob(chunk.blob, chunk.blob_size)
        if self.cache:
            self.cache.put_blob(chunk.blob, blob)
        return blob, "network"

    def _blob(self, chunk: Chunk) -> tuple[bytes | bytearray, str]:
        """The blob and where it came from: "network", "cache" or "repeat"."""
        with self._lock:
            once = self._once[chunk.blob]
            first, once.started = not once.started, True
        if first:
            try:
                blob, source = self._load(chunk)
            except BaseException:
                once.done.set()  # waiters fetch for themselves (and likely fail alike)
                raise
            with self._lock:
                once.left -= 1
                if once.left and self._kept + len(blob) <= REPEAT_BYTES:
                    once.blob = blob
                    self._kept += len(blob)
            once.done.set()
            return blob, source
        once.done.wait()
        with self._lock:
            once.left -= 1
            blob = once.blob
            if blob is not None and not once.left:
                once.blob = None
                self._kept -= len(blob)
        return (blob, "repeat") if blob is not None else self._load(chunk)

    def _one(self, chunk: Chunk) -> bytes:
        blob, source = self._blob(chunk)
        if not hasattr(self._local, "dctx"):
            self._local.dctx = self._zstd.ZstdDecompressor()
        frame = self.cipher.open_chunk(chunk.digest, blob, str(self.client.ref)) \
            if self.cipher else blob
        try:
            raw = self._local.dctx.decompress(frame, max_output_size=chunk.size)
        except self._zstd.ZstdError as exc:
            raise GpusnapError(f"chunk {chunk.blob} of {self.client.ref} is not valid zstd "
                               f"({exc})", damaged(chunk.blob)) from None
        if len(raw) != chunk.size or sha256(raw) != chunk.digest:
            raise DigestMismatch(f"chunk {chunk.digest} of {self.client.ref} does not match its "
                                 "digest after decompression", damaged(chunk.blob))
        n = len(blob)
        self._count(chunk.size, n if source == "network" else 0, n if source == "cache" else 0,
                    n if source == "repeat" else 0)
        return raw

    def fetch(self, chunks: Iterable[Chunk]) -> Iterator[bytes]:
        """The raw chunks' bytes, in order, each verified. A chunk's share of the
        budget is given back as it is handed out: the caller holds one chunk
        beyond the budget while it writes it."""
        chunks = list(chunks)  # descriptors only: a few hundred bytes per chunk
        self._once = {d: _Once(n) for d, n in Counter(c.blob for c in chunks).items()}
        self._kept = 0
        pending: deque[tuple[int, Future]] = deque()
        try:
            for chunk in chunks:
                while pending and (len(pending) >= self.lookahead
                                   or not self.budget.fits(chunk.size)):
                    yield self._next(pending)
                self.budget.acquire(chunk.size)
                future = self.pool.submit(self._one, chunk)
                future.add_done_callback(self._note)
                pending.append((chunk.size, future))
            while pending:
                yield self._next(pending)
        finally:
            # a fetch that failed (or was closed) gives back what its pending
            # chunks took: a worker fetching another blob with this budget would
            # otherwise wait for bytes nothing will release (a pull that hangs)
            for size, f in pending:
                if f.cancel():
                    self.budget.release(size)
                else:  # running: its bytes are in use until it ends
                    f.add_done_callback(lambda _, n=size: self.budget.release(n))

    def _next(self, pending: deque[tuple[int, Future]]) -> bytes:
        size, future = pending.popleft()
        try:
            return future.result()
        finally:
            self.budget.release(size)
