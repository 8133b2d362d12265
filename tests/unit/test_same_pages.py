"""Round 1's chunks of a pages file, kept beside it, and the read that tells
which ranges the final round left as they were (pages/same_pages.py): the
edge cases. The integration test (tests/integration/test_dump_ahead.py)
pushes, restores and compares the memory."""

from __future__ import annotations

import ctypes
import os

from gpusnap.oci import chunker
from gpusnap.oci.bundle import Chunk
from gpusnap.pages import same_pages

PARAMS = chunker.ChunkParams(4096, 16384, 65536)  # segment: 1 MiB
SEG = PARAMS.segment
PUSH = "127.0.0.1:5000/ckpt/x cdc zstd-3"


def _segments(path, params, push) -> dict:
    """Round 1's chunks by whole segment, {} where no index serves this push."""
    index = same_pages.load_index(path, push)
    return index.segments(params) if index else {}


def _chunks(sizes: list[int]) -> list[Chunk]:
    return [Chunk(f"sha256:{i:064x}", n, f"sha256:{i + 1000:064x}", n // 2)
            for i, n in enumerate(sizes)]


def test_an_index_gives_the_chunks_of_each_whole_segment_only(tmp_path):
    pages = tmp_path / "pages-1.img"
    # segment 0: four chunks; segment 1: two; then a last segment cut short
    chunks = _chunks([SEG // 4] * 4 + [SEG // 2] * 2 + [SEG // 8])
    same_pages.write_index(pages, chunks, PARAMS, PUSH)
    assert same_pages.index_path(pages).stat().st_mode & 0o777 == 0o600
    found = _segments(pages, PARAMS, PUSH)
    assert found == {0: chunks[:4], SEG: chunks[4:6]}


def test_an_index_of_another_push_or_other_parameters_gives_nothing(tmp_path):
    pages = tmp_path / "pages-1.img"
    same_pages.write_index(pages, _chunks([SEG // 2] * 4), PARAMS, PUSH)
    assert _segments(pages, PARAMS, PUSH.replace("ckpt/x", "ckpt/y")) == {}
    assert _segments(pages, chunker.ChunkParams(8192, 16384, 65536), PUSH) == {}
    assert _segments(tmp_path / "none.img", PARAMS, PUSH) == {}
    same_pages.index_path(pages).write_text("{not json")
    assert _segments(pages, PARAMS, PUSH) == {}


def test_an_index_whose_chunk_crosses_a_segment_is_not_trusted(tmp_path):
    pages = tmp_path / "pages-1.img"
    same_pages.write_index(pages, _chunks([SEG // 2, SEG, SEG // 2]), PARAMS, PUSH)
    assert _segments(pages, PARAMS, PUSH) == {}


def test_ranges_merge_where_they_touch_and_cover_only_whole():
    assert same_pages.merge([(8, 12), (0, 4), (4, 6), (11, 20)]) == [[0, 6], [8, 20]]
    ranges = [(0, 6), (8, 20)]
    assert same_pages.covered(ranges, 8, 20) and same_pages.covered(ranges, 1, 5)
    assert not same_pages.covered(ranges, 4, 9) and not same_pages.covered([], 0, 1)


def test_a_compared_read_writes_only_the_parts_that_differ(monkeypatch):
    """The process's bytes come through the buffer; the file keeps its own
    where they are equal (counted by the writes), takes the new ones elsewhere."""
    monkeypatch.setattr(same_pages, "COMPARE", 4096)
    source = bytearray(os.urandom(5 * 4096))
    target = ctypes.create_string_buffer(bytes(source), len(source))
    libc = ctypes.CDLL(None)
    libc.memcmp.restype = ctypes.c_int
    libc.memcmp.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    src = ctypes.create_string_buffer(bytes(source), len(source))
    reads: list[int] = []

    def read(dst: int, at: int, n: int) -> None:
        reads.append(n)
        ctypes.memmove(dst, ctypes.addressof(src) + at, n)

    scratch = ctypes.create_string_buffer(4096)
    base = ctypes.addressof(target)
    assert same_pages.read_compared(read, libc.memcmp, 0, base, len(source), scratch)
    assert reads == [4096] * 5 and target.raw == bytes(source)
    src[2 * 4096 + 7] = (src[2 * 4096 + 7][0] ^ 1).to_bytes(1, "little")
    assert not same_pages.read_compared(read, libc.memcmp, 0, base, len(source) - 100, scratch)
    assert target.raw[:len(source) - 100] == src.raw[:len(source) - 100]


def test_round_ones_chunks_moved_into_the_final_files_ranges(tmp_path):
    """Chunks of round 1 at 0, 10, 20, 30 (10 bytes each); the final file has
    [12, 45) as round 1 left it, moved by +5: the chunks at 10, 20 and 30 lie
    wholly in it once moved (at 15, 25, 35), the one at 0 does not (5-15); a
    segment [0, 30) keeps those wholly inside it."""
    chunks = _chunks([10, 10, 10, 10])
    same_pages.write_index(tmp_path / "p.img", chunks, PARAMS, PUSH)
    index = same_pages.load_index(tmp_path / "p.img", PUSH)
    assert index.chunks == [(0, chunks[0]), (10, chunks[1]), (20, chunks[2]), (30, chunks[3])]
    assert same_pages.load_index(tmp_path / "p.img", "another push") is None
    moved = [(12, 45, 5)]
    assert index.moved(moved, 0, 100) == (
        (15, chunks[1]), (25, chunks[2]), (35, chunks[3]))
    assert index.moved(moved, 0, 30) == ((15, chunks[1]),)
    assert index.moved([(0, 40, -10)], 0, 100) == (
        (0, chunks[1]), (10, chunks[2]), (20, chunks[3]))


def test_ranges_moved_by_the_same_shift_merge_and_others_stay_apart():
    assert same_pages.merge_moved([(0, 4, 0), (4, 8, 0), (8, 12, -4096), (12, 16, -4096)]) == \
        [[0, 8, 0], [8, 16, -4096]]


def test_a_shift_is_found_near_and_checked_twice(tmp_path, monkeypatch):
    """The run's bytes lie 3 pages later in the kept file: found by the probe
    from the middle, agreed by the one from the first quarter; a kept file
    that holds them nowhere gives None; 0 where they did not move."""
    monkeypatch.setattr(same_pages, "PROBE", 4096)
    run = os.urandom(64 * 4096)
    kept = tmp_path / "kept"
    kept.write_bytes(os.urandom(10 * 4096) + run + os.urandom(4096))
    offset = 7 * 4096  # where this round puts the run: 3 pages before round 1's

    def read(dst: int, src: int, n: int) -> None:
        ctypes.memmove(dst, run[src:src + n], n)

    fd = os.open(kept, os.O_RDONLY)
    try:
        size = kept.stat().st_size
        assert same_pages.find_shift(read, fd, size, 0, len(run), offset) == -3 * 4096
        assert same_pages.find_shift(read, fd, size, 0, len(run), 10 * 4096) == 0
        assert same_pages.find_shift(read, fd, size, 0, len(run), offset,
                                     tried=(0, -3 * 4096)) == -3 * 4096
    finally:
        os.close(fd)
    other = tmp_path / "other"
    other.write_bytes(os.urandom(80 * 4096))
    fd = os.open(other, os.O_RDONLY)
    try:
        assert same_pages.find_shift(read, fd, 80 * 4096, 0, len(run), offset) is None
    finally:
        os.close(fd)
