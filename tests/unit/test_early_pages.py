"""EarlyPages hands a growing page image's whole segments out once, in order,
and gives them back only for the file they came from (edge cases; the GPU
benchmark's content checks are the evidence that pushes built this way restore)."""

from __future__ import annotations

import json
import os
import threading
import time
from concurrent.futures import Future

from gpusnap.oci import chunker
from gpusnap.oci.bundle import Chunk
from gpusnap.pages import early_pages, same_pages

PARAMS = chunker.ChunkParams(4096, 16384, 65536)  # segment: 1 MiB
SEG = PARAMS.segment


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, int, int]] = []

    def submit(self, path, start, length, params, known=()) -> Future:
        assert params == PARAMS
        self.calls.append((path.name, start, length))
        self.known = getattr(self, "known", {})
        self.known[start] = known
        f: Future = Future()
        f.set_result((path.name, start))
        return f


def _until(cond, timeout=5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_whole_segments_go_out_as_the_file_grows_and_the_rest_is_left(tmp_path):
    rec, done = Recorder(), threading.Event()
    pages = tmp_path / "pages-1.img"
    w = early_pages.EarlyPages(tmp_path, rec.submit, lambda size: PARAMS, 2 * SEG, done.is_set)
    try:
        with open(pages, "wb") as f:
            f.write(os.urandom(SEG + 100))  # below final_from: not taken yet
            f.flush()
            time.sleep(4 * early_pages.POLL)
            assert rec.calls == []
            f.write(os.urandom(2 * SEG))  # 3 segments + 100 bytes
            f.flush()
            _until(lambda: len(rec.calls) == 3)
        have = w.take(pages, 3 * SEG + 100, PARAMS)
        assert sorted(have) == [0, SEG, 2 * SEG] and [have[k].result() for k in sorted(have)] == \
            [("pages-1.img", k * SEG) for k in range(3)]
        assert rec.calls == [("pages-1.img", k * SEG, SEG) for k in range(3)]
        assert w.take(pages, 3 * SEG + 100, PARAMS) == {}  # taken once
        with open(pages, "ab") as f:
            f.write(os.urandom(2 * SEG))
        time.sleep(4 * early_pages.POLL)
        assert len(rec.calls) == 3, "a file given to the push was read again"
    finally:
        w.stop()


def test_a_replaced_file_or_other_params_gives_nothing_back(tmp_path):
    rec = Recorder()
    pages = tmp_path / "pages-2.img"
    pages.write_bytes(os.urandom(4 * SEG))
    w = early_pages.EarlyPages(tmp_path, rec.submit, lambda size: PARAMS, SEG, lambda: False)
    try:
        _until(lambda: len(rec.calls) == 4)
        other = chunker.ChunkParams(8192, 32768, 131072)
        assert w.take(pages, 4 * SEG, other) == {}
    finally:
        w.stop()
    w = early_pages.EarlyPages(tmp_path, rec.submit, lambda size: PARAMS, SEG, lambda: False)
    try:
        _until(lambda: len(rec.calls) == 8)
        w.stop()
        new = tmp_path / "new"
        new.write_bytes(os.urandom(4 * SEG))
        new.rename(pages)  # another file under the same name
        assert w.take(pages, 4 * SEG, PARAMS) == {}
    finally:
        w.stop()


def test_a_file_cut_short_after_segments_were_read_gives_nothing_back(tmp_path):
    rec = Recorder()
    pages = tmp_path / "pages-3.img"
    pages.write_bytes(os.urandom(3 * SEG))
    w = early_pages.EarlyPages(tmp_path, rec.submit, lambda size: PARAMS, SEG, lambda: False)
    try:
        _until(lambda: len(rec.calls) == 3)
        os.truncate(pages, SEG)
        time.sleep(4 * early_pages.POLL)  # seen short (a poll cannot see what comes and goes between two)
        with open(pages, "ab") as f:
            f.write(os.urandom(3 * SEG))  # as long again, other bytes
        assert w.take(pages, 4 * SEG, PARAMS) == {}
    finally:
        w.stop()


def test_memory_read_ahead_gives_its_whole_segments_once_noted_and_back_by_inode(tmp_path):
    """dump_ahead's file at its final offsets: once its note says which ranges
    are final, the segments wholly inside them (never the last: the file grows)
    go out; take() finds them under the pages file's name the file gets."""
    rec, images, aside = Recorder(), tmp_path / "images", tmp_path / "aside"
    images.mkdir()
    aside.mkdir()
    data = aside / ".ahead-7.img"
    data.write_bytes(os.urandom(6 * SEG))
    w = early_pages.EarlyPages(images, rec.submit, lambda size: PARAMS, SEG, lambda: False,
                               aside=aside)
    try:
        time.sleep(4 * early_pages.POLL)
        assert rec.calls == []  # nothing before the note
        # final: [SEG/2, 6 SEG): segments 1..4 lie wholly in it, 0 does not, 5 is the last
        (aside / ".ahead-7.img.ready").write_text('{"size": %d, "final": [[%d, %d]]}'
                                                  % (6 * SEG, SEG // 2, 6 * SEG))
        _until(lambda: len(rec.calls) == 4)
        assert [c[1] for c in rec.calls] == [SEG, 2 * SEG, 3 * SEG, 4 * SEG]
        with open(data, "ab") as f:
            f.write(os.urandom(100))
        final = aside / "pages-3.img"
        data.rename(final)  # post-dump: whole, the same inode under CRIU's name
        os.symlink(final, images / "pages-3.img")  # as pages_aside leaves it
        _until(lambda: len(rec.calls) == 6)  # then its other whole segments, each once
        assert sorted(c[1] for c in rec.calls) == [k * SEG for k in range(6)]
        have = w.take(images / "pages-3.img", 6 * SEG + 100, PARAMS)
        assert sorted(have) == [k * SEG for k in range(6)]
        time.sleep(4 * early_pages.POLL)
        assert len(rec.calls) == 6
        assert w.take(images / "pages-3.img", 6 * SEG + 100, PARAMS) == {}  # once
    finally:
        w.stop()


def test_memory_read_ahead_rebuilt_as_another_file_gives_nothing_back(tmp_path):
    rec, aside = Recorder(), tmp_path
    data = aside / ".ahead-8.img"
    data.write_bytes(os.urandom(4 * SEG))
    (aside / ".ahead-8.img.ready").write_text('{"size": %d, "final": [[0, %d]]}'
                                              % (4 * SEG, 4 * SEG))
    w = early_pages.EarlyPages(tmp_path / "none", rec.submit, lambda size: PARAMS, SEG,
                               lambda: False, aside=aside)
    try:
        _until(lambda: len(rec.calls) == 3)
        w.stop()
        copy = aside / "pages-1.img"
        copy.write_bytes(data.read_bytes())  # compose's copy: another inode
        assert w.take(copy, 4 * SEG, PARAMS) == {}
    finally:
        w.stop()


def test_clear_stale_removes_only_page_images(tmp_path):
    for name in ("pages-1.img", "pages-12.img", "pagemap-1.img", "inventory.img"):
        (tmp_path / name).write_bytes(b"x")
    early_pages.clear_stale(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["inventory.img", "pagemap-1.img"]


def test_a_note_that_grows_while_the_read_goes_on_gives_each_new_segment_once(tmp_path):
    """dump_ahead rewrites its note as the read goes on (every GiB): each
    version hands out the segments newly inside the ranges read, none twice."""
    rec, aside = Recorder(), tmp_path
    (aside / ".ahead-9.img").write_bytes(os.urandom(8 * SEG))
    note = aside / ".ahead-9.img.ready"

    def tell(end: int) -> None:
        tmp = aside / ".tmp"
        tmp.write_text('{"size": %d, "final": [[0, %d]]}' % (8 * SEG, end))
        os.replace(tmp, note)

    w = early_pages.EarlyPages(tmp_path / "none", rec.submit, lambda size: PARAMS, SEG,
                               lambda: False, aside=aside)
    try:
        tell(2 * SEG + 10)
        _until(lambda: len(rec.calls) == 2)
        tell(5 * SEG)
        _until(lambda: len(rec.calls) == 5)
        tell(8 * SEG)  # all read: 0..6 (7, the last, waits for the pages file)
        _until(lambda: len(rec.calls) == 7)
        time.sleep(4 * early_pages.POLL)
        assert [c[1] for c in rec.calls] == [k * SEG for k in range(7)]
    finally:
        w.stop()


def _known(chunks) -> Future:
    f: Future = Future()
    f.set_result(("known", chunks[0].digest))
    return f


def _index(path, segments: int, push: str = "reg/repo zstd-3") -> list[list[Chunk]]:
    """Round 1's index beside ``path``: two chunks a segment."""
    per = [[Chunk(f"sha256:{2 * k + i:064x}", SEG // 2, f"sha256:{2 * k + i:064x}", 9)
            for i in range(2)] for k in range(segments)]
    same_pages.write_index(path, [c for seg in per for c in seg], PARAMS, push)
    return per


def test_segments_the_read_found_unchanged_are_round_ones_chunks_and_never_read(tmp_path):
    """A final round's note: segments 0-4 read, 1-2 as round 1 left them. Those
    two come back done from round 1's index, no worker reads them; the rest
    go to the workers; take() gives all back by the file's device and inode,
    and counts the known ones then, once."""
    rec, images, aside = Recorder(), tmp_path / "images", tmp_path / "aside"
    images.mkdir()
    aside.mkdir()
    data = aside / ".ahead-7.img"
    data.write_bytes(os.urandom(6 * SEG))
    per = _index(data, 6)
    counted: list[Future] = []
    w = early_pages.EarlyPages(images, rec.submit, lambda size: PARAMS, SEG, lambda: False,
                               aside=aside, known=_known, push_id="reg/repo zstd-3",
                               on_known=counted.append)
    try:
        (aside / ".ahead-7.img.ready").write_text(json.dumps(
            {"size": 6 * SEG, "final": [[0, 6 * SEG]], "same": [[SEG - 5, 3 * SEG]]}))
        _until(lambda: len(rec.calls) == 3)
        time.sleep(4 * early_pages.POLL)
        assert [c[1] for c in rec.calls] == [0, 3 * SEG, 4 * SEG]
        assert counted == []  # made, not yet handed out
        final = aside / "pages-3.img"
        data.rename(final)
        have = w.take(final, 6 * SEG, PARAMS)
        assert sorted(have) == [k * SEG for k in range(5)]  # the last one: the push submits it
        assert have[SEG].result() == ("known", per[1][0].digest)
        assert have[2 * SEG].result() == ("known", per[2][0].digest)
        assert counted == [have[SEG], have[2 * SEG]]  # 2 SEG bytes taken unhashed, once
    finally:
        w.stop()


def test_an_index_of_another_repository_leaves_every_segment_to_the_workers(tmp_path):
    rec, aside = Recorder(), tmp_path
    data = aside / ".ahead-7.img"
    data.write_bytes(os.urandom(4 * SEG))
    _index(data, 4, push="reg/other zstd-3")
    counted: list[Future] = []
    w = early_pages.EarlyPages(tmp_path / "none", rec.submit, lambda size: PARAMS, SEG,
                               lambda: False, aside=aside, known=_known, push_id="reg/repo zstd-3",
                               on_known=counted.append)
    try:
        (aside / ".ahead-7.img.ready").write_text(json.dumps(
            {"size": 4 * SEG, "final": [[0, 4 * SEG]], "same": [[0, 4 * SEG]]}))
        _until(lambda: len(rec.calls) == 3)
        w.take(data, 4 * SEG, PARAMS)
        assert counted == []
    finally:
        w.stop()


def test_a_small_file_read_ahead_gives_its_unchanged_segments_when_taken(tmp_path):
    """Below final_from nothing goes out early (its parameters are not final),
    but take() gives the segments found unchanged, with the push's parameters."""
    rec, aside = Recorder(), tmp_path
    data = aside / ".ahead-2.img"
    data.write_bytes(os.urandom(4 * SEG))
    _index(data, 4)
    counted: list[Future] = []
    w = early_pages.EarlyPages(tmp_path / "none", rec.submit, lambda size: PARAMS, 64 * SEG,
                               lambda: False, aside=aside, known=_known, push_id="reg/repo zstd-3",
                               on_known=counted.append)
    try:
        (aside / ".ahead-2.img.ready").write_text(json.dumps(
            {"size": 4 * SEG, "final": [[0, 4 * SEG]], "same": [[0, 2 * SEG], [3 * SEG, 4 * SEG]]}))
        _until(lambda: w._same)
        have = w.take(data, 4 * SEG, PARAMS)
        assert sorted(have) == [0, SEG, 3 * SEG] and rec.calls == []
        assert counted == [have[0], have[SEG], have[3 * SEG]]  # 3 SEG bytes taken unhashed
    finally:
        w.stop()


def test_segments_of_memory_that_moved_go_to_the_workers_with_round_ones_chunks_moved(tmp_path):
    """The note says [0, 4 SEG) is as round 1 left it, one page further on
    (shift +4096): no segment is round 1's whole, so each goes to a worker,
    with round 1's chunks as they lie in it once moved (those a cut may take)."""
    rec, aside = Recorder(), tmp_path
    data = aside / ".ahead-5.img"
    data.write_bytes(os.urandom(5 * SEG))
    per = _index(data, 5)
    counted: list[Future] = []
    w = early_pages.EarlyPages(tmp_path / "none", rec.submit, lambda size: PARAMS, SEG,
                               lambda: False, aside=aside, known=_known, push_id="reg/repo zstd-3",
                               on_known=counted.append)
    try:
        (aside / ".ahead-5.img.ready").write_text(json.dumps(
            {"size": 5 * SEG, "final": [[0, 5 * SEG]], "same": [[0, 4 * SEG, 4096]]}))
        _until(lambda: len(rec.calls) == 4)
        w.take(data, 5 * SEG, PARAMS)
        assert counted == []  # no segment is round 1's whole
        # round 1's chunks (two a segment) moved one page on: each segment keeps the one
        # that starts it; its second now crosses into the next segment, which a cut never does
        assert rec.known == {k * SEG: ((k * SEG + 4096, per[k][0]),) for k in range(4)}
    finally:
        w.stop()
