"""oci/segments.py: a worker process killed (the OOM killer's way) is one line
whenever it is noticed, also when handing out the next segment (the CI of
2026-11-26 13:35 printed BrokenProcessPool's traceback from FetchPool.pieces)."""

from __future__ import annotations

import os
from concurrent.futures import Future
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import pytest

from gpusnap.errors import GpusnapError
from gpusnap.oci import chunker, segments
from gpusnap.oci.bundle import Chunk
from gpusnap.oci.transfer import Stats, sha256


class _BrokenPool:
    def submit(self, *args, **kwargs):
        raise BrokenProcessPool("A child process terminated abruptly")


def test_a_pull_that_finds_its_pool_broken_when_handing_out_a_segment(tmp_path):
    pool = object.__new__(segments.FetchPool)
    pool._pool, pool.window, pool.dir, pool._n = _BrokenPool(), 2, tmp_path, 0
    pool._initargs = ("reg.io/ckpt/app:v1", None, str(tmp_path / "cache"))
    pool._count = lambda counts: None
    with pytest.raises(GpusnapError, match="download worker process died"):
        list(pool.pieces([Chunk("sha256:a", 10, "sha256:b", 5)]))
    with pytest.raises(GpusnapError, match="download worker process died"):
        pool.patch_file([(0, [Chunk("sha256:a", 10, "sha256:b", 5)])], tmp_path / "f")


def test_a_push_that_finds_its_pool_broken_when_handing_out_a_segment():
    pool = object.__new__(segments.SegmentPool)
    pool._pool = _BrokenPool()
    with pytest.raises(GpusnapError, match="push worker process died") as err:
        pool.submit(Path("/x"), 0, 1, chunker.ChunkParams())
    assert err.value.hint == "push again: chunks already sent are skipped"


class _Uploader:
    """The worker's uploader, recording what it was given to hash."""

    def __init__(self) -> None:
        self.stats, self.hashed = Stats(), []

    def submit(self, data) -> Future:
        raw = bytes(data)
        self.hashed.append(len(raw))
        f: Future = Future()
        f.set_result(Chunk(sha256(raw), len(raw), sha256(raw), len(raw)))
        return f

    def known(self, chunk: Chunk) -> Future:
        f: Future = Future()
        f.set_result(chunk)
        return f


def test_a_worker_takes_a_known_chunk_where_its_cut_lands_on_one(tmp_path, monkeypatch):
    """A segment handed with round 1's chunks moved into it: where the cut
    produces a piece at a known chunk's offset and of its size, that chunk is
    taken as it is (not hashed); a known chunk whose size the cut does not
    reproduce, and every other piece, is hashed."""
    params = chunker.ChunkParams(4096, 16384, 65536)
    data = bytes(range(256)) * 4096 + os.urandom(1 << 20)
    path = tmp_path / "pages-1.img"
    path.write_bytes(b"\0" * 8192 + data)
    cuts = list(chunker.chunks_of(memoryview(data), params))
    offsets, pos = [], 8192
    for c in cuts:
        offsets.append((pos, len(c)))
        pos += len(c)
    taken = Chunk("sha256:" + "a" * 64, offsets[2][1], "sha256:" + "b" * 64, 7)
    wrong = Chunk("sha256:" + "c" * 64, offsets[4][1] + 1, "sha256:" + "d" * 64, 7)
    up = _Uploader()
    monkeypatch.setitem(segments._worker, "uploader", up)
    result = segments._run(segments.Segment(str(path), 8192, len(data), params,
                                            ((offsets[2][0], taken), (offsets[4][0], wrong))))
    assert result.chunks[2] == taken and result.chunks[4] != wrong
    assert len(result.chunks) == len(cuts) and len(up.hashed) == len(cuts) - 1
    assert sum(c.size for c in result.chunks) == len(data)


def _ctrl_c_in_a_worker() -> None:
    import os
    import signal
    import time
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(5)


def _noop() -> None:
    pass


def test_a_pool_worker_leaves_ctrl_c_to_the_cli_and_dies_with_it(tmp_path):
    import os
    import subprocess
    import sys
    import time

    from gpusnap.oci import segments

    from concurrent.futures.process import BrokenProcessPool

    # Ctrl-C ends a worker at once, without a traceback of its own
    pool = segments._process_pool(1, _noop, ())
    try:
        started = time.monotonic()
        with pytest.raises(BrokenProcessPool):
            pool.submit(_ctrl_c_in_a_worker).result(60)
        assert time.monotonic() - started < 4
    finally:
        pool.shutdown()
    # a CLI killed (SIGKILL) with its pool up: the worker does not wait on its queue forever
    script = ("import os, sys; from gpusnap.oci import segments; from tests.unit import test_segment_pools as t; "
              "p = segments._process_pool(1, t._noop, ()); p.submit(t._noop).result(60); "
              "print(*[q.pid for q in p._processes.values()], flush=True); os._exit(0)")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                         cwd=os.getcwd(), env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    worker = int(out.stdout.split()[0])
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{worker}") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not os.path.exists(f"/proc/{worker}"), "the worker outlived its CLI"


def test_a_dead_download_worker_points_at_the_cache_only_where_there_is_one():
    from gpusnap.oci import segments
    assert segments.worker_died("pull").hint.endswith("are in the cache")
    assert segments.worker_died("pull", cached=False).hint == "run the command again"
