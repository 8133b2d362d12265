"""The Downloader with a dict for a registry: a blob that occurs several times in
one pull is fetched once, whatever order the workers run in, and the counts say
where each byte came from; the repeat memory is given back after the last use."""

from __future__ import annotations

import hashlib
import threading
import time

import pytest
import zstandard

from gpusnap.oci import transfer
from gpusnap.oci.bundle import Chunk
from gpusnap.oci.cache import ChunkCache
from gpusnap.oci.reference import parse as parse_ref


def sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


class DictRegistry:
    """get_blob from a dict; slow, so that workers overlap."""

    def __init__(self) -> None:
        self.ref = parse_ref("reg.io/ckpt/app:v1")
        self.blobs: dict[str, bytes] = {}
        self.gets: dict[str, int] = {}
        self._lock = threading.Lock()

    def add(self, raw: bytes) -> Chunk:
        blob = zstandard.ZstdCompressor().compress(raw)
        self.blobs[sha(blob)] = blob
        return Chunk(sha(raw), len(raw), sha(blob), len(blob))

    def get_blob(self, digest: str, size: int) -> bytes:
        with self._lock:
            self.gets[digest] = self.gets.get(digest, 0) + 1
        time.sleep(0.01)
        return self.blobs[digest]


def pull(reg: DictRegistry, chunks: list[Chunk], cache: ChunkCache | None = None,
         workers: int = 8) -> tuple[list[bytes], transfer.Stats, transfer.Downloader]:
    d = transfer.Downloader(reg, cache, workers)
    try:
        return list(d.fetch(chunks)), d.stats, d
    finally:
        d.close()


@pytest.fixture
def layout() -> tuple[DictRegistry, list[Chunk], list[bytes]]:
    reg = DictRegistry()
    zero = bytes(256 << 10)
    raws = [zero, *(hashlib.sha256(b"%d" % i).digest() * 2048 for i in range(6)), zero, zero]
    raws.insert(3, zero)
    return reg, [reg.add(r) for r in raws], raws


def test_a_repeated_blob_is_fetched_once_and_counted_as_repeated(layout):
    reg, chunks, raws = layout
    out, stats, d = pull(reg, chunks)
    assert out == raws
    assert all(n == 1 for n in reg.gets.values()) and len(reg.gets) == 7
    zero_blob = chunks[0].blob_size
    distinct = sum(c.blob_size for c in {c.blob: c for c in chunks}.values())
    assert stats.network_bytes == distinct
    assert stats.repeated_bytes == 3 * zero_blob
    assert stats.cached_bytes == 0
    assert d._kept == 0 and all(o.blob is None for o in d._once.values())


def test_with_a_cache_the_second_pull_reads_what_the_first_fetched(layout, tmp_path):
    reg, chunks, raws = layout
    cache = ChunkCache(tmp_path / "cache")
    _, first, _ = pull(reg, chunks, cache)
    out, second, _ = pull(reg, chunks, cache)
    assert out == raws
    assert first.cached_bytes == 0
    assert second.network_bytes == 0 and second.cached_bytes == first.network_bytes
    assert second.repeated_bytes == first.repeated_bytes
    assert all(n == 1 for n in reg.gets.values())


def test_repeats_beyond_the_memory_bound_are_fetched_again(layout, monkeypatch):
    reg, chunks, raws = layout
    monkeypatch.setattr(transfer, "REPEAT_BYTES", 0)
    out, stats, d = pull(reg, chunks, workers=1)
    assert out == raws
    assert reg.gets[chunks[0].blob] == 4 and stats.repeated_bytes == 0
    assert d._kept == 0


def test_a_failed_first_fetch_fails_the_pull_without_hanging(layout):
    reg, chunks, _ = layout
    del reg.blobs[chunks[0].blob]
    with pytest.raises(KeyError):
        pull(reg, chunks)


def test_a_failed_fetch_gives_its_budget_back_for_the_next_one(layout):
    """A pull worker keeps one Downloader for every segment it serves: a blob
    the registry lost must not leave the next segment's chunks waiting for
    bytes no one will release (the pull hung, the CLI with it). That next
    segment belongs to the pull that failed: it ends at once, with the
    first failure, and asks the registry nothing."""
    reg, chunks, _ = layout
    broken = reg.add(b"gone" * 1000)
    del reg.blobs[broken.blob]
    d = transfer.Downloader(reg, None, 4)
    d.budget = transfer.ByteBudget(3 * chunks[1].size)
    try:
        with pytest.raises(KeyError):
            list(d.fetch([broken, *chunks[1:7]]))
        deadline = time.monotonic() + 5
        while d.budget.used and time.monotonic() < deadline:
            time.sleep(0.01)
        assert d.budget.used == 0
        done, ended = threading.Event(), []

        def next_segment() -> None:
            try:
                list(d.fetch(chunks[1:7]))
            except KeyError as e:
                ended.append(e)
            done.set()
        gets = dict(reg.gets)
        threading.Thread(target=next_segment, daemon=True).start()
        assert done.wait(10), "the next fetch waited for bytes the failed one kept"
        assert ended and reg.gets == gets, (ended, reg.gets, gets)
    finally:
        d.close()


class DeadRegistry(DictRegistry):
    """Every fetch fails after ``seconds`` (its tries and bounds, shortened)."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def get_blob(self, digest: str, size: int) -> bytes:
        with self._lock:
            self.gets[digest] = self.gets.get(digest, 0) + 1
        time.sleep(self.seconds)
        raise transfer.GpusnapError("cannot reach registry reg.io: no connection within 10 s")


def test_chunks_queued_behind_a_failed_fetch_do_not_ask_the_registry(layout):
    """A registry gone dead: the chunks in flight fail; those queued behind
    them fail at once with the same words, each its own copy of the error."""
    _, chunks, _ = layout
    reg = DeadRegistry(0.3)
    for c in chunks:
        reg.blobs[c.blob] = b""
    d = transfer.Downloader(reg, None, 2)
    d._once = {c.blob: transfer._Once(1) for c in chunks[1:7]}  # as fetch() sets it
    errors = []
    try:
        for chunk in chunks[1:7]:  # six distinct blobs, two workers
            f = d.pool.submit(d._one, chunk)
            f.add_done_callback(d._note)
            errors.append(f)
        errors = [f.exception(timeout=10) for f in errors]
    finally:
        d.close()
    assert sum(reg.gets.values()) == 2, reg.gets
    assert all("no connection within 10 s" in str(e) for e in errors), errors
    assert len({id(e) for e in errors}) == len(errors)  # copies: no traceback gathers them all
