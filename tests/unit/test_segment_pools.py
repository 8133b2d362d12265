"""oci/segments.py: a worker process killed (the OOM killer's way) is one line
whenever it is noticed, also when handing out the next segment (the CI of
2026-11-26 13:35 printed BrokenProcessPool's traceback from FetchPool.pieces)."""

from __future__ import annotations

from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import pytest

from gpusnap.errors import GpusnapError
from gpusnap.oci import chunker, segments
from gpusnap.oci.bundle import Chunk


class _BrokenPool:
    def submit(self, *args, **kwargs):
        raise BrokenProcessPool("A child process terminated abruptly")


def test_a_pull_that_finds_its_pool_broken_when_handing_out_a_segment(tmp_path):
    pool = object.__new__(segments.FetchPool)
    pool._pool, pool.window, pool.dir, pool._n = _BrokenPool(), 2, tmp_path, 0
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
