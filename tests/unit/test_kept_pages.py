"""A pre-copy's round-1 pages kept on the source (gpusnap/pages/kept_pages.py):
what is kept, when the host cannot spare it, and how it goes."""

from __future__ import annotations

import os
import time

import pytest

from gpusnap.pages import kept_pages, memory, prepared_pages

GIB = 1 << 30
PLENTY = {"MemTotal": 256 * GIB, "MemAvailable": 200 * GIB}


@pytest.fixture
def root(tmp_path, monkeypatch):
    monkeypatch.setattr(memory, "roots", lambda: (tmp_path,))
    monkeypatch.setattr(kept_pages, "MIN_FILE", 1024)
    monkeypatch.setattr(kept_pages.journal, "record", lambda *a, **k: None)
    return tmp_path


def _aside(root, sizes: dict[str, int]):
    aside = root / ".gpusnap-push-x"
    aside.mkdir()
    for name, size in sizes.items():
        (aside / name).write_bytes(b"p" * size)
    return aside


def test_keep_moves_the_big_pages_files_largest_first(root):
    aside = _aside(root, {"pages-1.img": 10, "pages-2.img": 4096, "pages-3.img": 8192,
                          "pagemap-2.img": 4096})
    kept = kept_pages.keep(aside, "c1", held_too=100 * GIB, info=PLENTY)
    assert kept == {"folder": str(root / "gpusnap-kept-c1"), "files": 2, "bytes": 12288}
    assert [os.path.getsize(f) for f in kept_pages.files("c1")] == [8192, 4096]
    assert (aside / "pages-1.img").exists() and (aside / "pagemap-2.img").exists()
    assert kept_pages.held("c1") == (root / "gpusnap-kept-c1", 12288)
    assert kept_pages.files("other") == [] and kept_pages.held("other") == (None, 0)


def test_nothing_is_kept_where_the_final_round_would_not_fit_beside_it(root):
    aside = _aside(root, {"pages-2.img": 4096})
    tight = {"MemTotal": 128 * GIB, "MemAvailable": 40 * GIB}
    assert kept_pages.keep(aside, "c1", held_too=36 * GIB, info=tight) is None
    assert (aside / "pages-2.img").exists() and kept_pages.files("c1") == []


def test_nothing_is_kept_when_switched_off(root, monkeypatch):
    monkeypatch.setenv(kept_pages.ENV, "0")
    aside = _aside(root, {"pages-2.img": 4096})
    assert kept_pages.keep(aside, "c1", held_too=0, info=PLENTY) is None


def test_a_new_round_one_replaces_the_last_and_drop_gives_it_back(root):
    kept_pages.keep(_aside(root, {"pages-2.img": 4096}), "c1", held_too=0, info=PLENTY)
    second = root / "second"
    second.mkdir()
    (second / "pages-5.img").write_bytes(b"q" * 2048)
    kept_pages.keep(second, "c1", held_too=0, info=PLENTY)
    assert [os.path.getsize(f) for f in kept_pages.files("c1")] == [2048]
    kept_pages.drop("c1")
    assert kept_pages.folders() == []


def test_sweep_gives_back_only_what_is_older_than_the_bound(root):
    kept_pages.keep(_aside(root, {"pages-2.img": 4096}), "old", held_too=0, info=PLENTY)
    (root / "new").mkdir()
    (root / "new" / "pages-2.img").write_bytes(b"n" * 4096)
    kept_pages.keep(root / "new", "new", held_too=0, info=PLENTY)
    past = time.time() - kept_pages.KEEP_S - 5
    os.utime(root / "gpusnap-kept-old", (past, past))
    assert kept_pages.stale() == [root / "gpusnap-kept-old"]
    kept_pages.sweep()
    assert kept_pages.folders() == [root / "gpusnap-kept-new"]


def test_a_push_that_needs_the_memory_evicts_kept_pages_but_not_its_own(root, monkeypatch):
    kept_pages.keep(_aside(root, {"pages-2.img": 4096}), "a", held_too=0, info=PLENTY)
    (root / "b").mkdir()
    (root / "b" / "pages-2.img").write_bytes(b"b" * 4096)
    kept_pages.keep(root / "b", "b", held_too=0, info=PLENTY)
    os.utime(root / "gpusnap-kept-b", (1, 1))  # the oldest: evicted first, were it not spared
    monkeypatch.setattr(prepared_pages.journal, "record", lambda *a, **k: None)
    # room appears once round 1's pages of "a" are gone
    monkeypatch.setattr(memory, "ram_dir", lambda size, held_too=0:
                        None if (root / "gpusnap-kept-a").exists() else root)
    assert prepared_pages.evict_for(4096, spare=root / "gpusnap-kept-b") == root
    assert kept_pages.folders() == [root / "gpusnap-kept-b"]
