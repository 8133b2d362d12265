"""A pre-copy's round-1 pages kept on the source (gpusnap/pages/kept_pages.py):
what is kept, when the host cannot spare it or the folder is not private,
how the final round claims it, and how it goes."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from gpusnap.pages import kept_pages, memory, prepared_pages

GIB = 1 << 30
PLENTY = {"MemTotal": 256 * GIB, "MemAvailable": 200 * GIB}


@pytest.fixture
def root(tmp_path, monkeypatch):
    tmp_path.chmod(0o700)  # gpusnap's tmpfs: only root may add names
    monkeypatch.setattr(memory, "roots", lambda: (tmp_path,))
    monkeypatch.setattr(kept_pages, "MIN_FILE", 1024)
    monkeypatch.setattr(kept_pages.journal, "record", lambda *a, **k: None)
    monkeypatch.setattr(kept_pages, "_expire", lambda folder: None)
    return tmp_path


def _aside(root: Path, sizes: dict[str, int], name: str = ".gpusnap-push-x") -> Path:
    aside = root / name
    aside.mkdir()
    for file, size in sizes.items():
        (aside / file).write_bytes(b"p" * size)
    return aside


def _keep(root: Path, container: str, sizes: dict[str, int], count: int = 1) -> Path:
    kept = kept_pages.keep(_aside(root, sizes, f".push-{container}"), container, count,
                           held_too=0, info=PLENTY)
    return Path(kept["folder"])


def test_keep_moves_the_largest_pages_files_one_per_process_read_ahead(root):
    aside = _aside(root, {"pages-1.img": 10, "pages-2.img": 4096, "pages-3.img": 8192,
                          "pages-4.img": 2048, "pagemap-2.img": 4096})
    kept = kept_pages.keep(aside, "c1", 2, held_too=100 * GIB, info=PLENTY)
    folder = Path(kept["folder"])
    assert folder.parent == root and folder.name.startswith("gpusnap-kept-c1.")
    assert (kept["files"], kept["bytes"]) == (2, 12288)
    assert sorted(os.path.getsize(f) for f in folder.iterdir()) == [4096, 8192]
    assert all((aside / n).exists() for n in ("pages-1.img", "pages-4.img", "pagemap-2.img"))


def test_nothing_is_kept_where_the_final_round_would_not_fit_beside_it(root):
    aside = _aside(root, {"pages-2.img": 4096})
    tight = {"MemTotal": 128 * GIB, "MemAvailable": 40 * GIB}
    assert kept_pages.keep(aside, "c1", 1, held_too=36 * GIB, info=tight) is None
    assert (aside / "pages-2.img").exists() and kept_pages.folders() == []


def test_nothing_is_kept_when_switched_off_or_nothing_would_read_it(root, monkeypatch):
    aside = _aside(root, {"pages-2.img": 4096})
    assert kept_pages.keep(aside, "c1", 0, held_too=0, info=PLENTY) is None
    monkeypatch.setenv(kept_pages.ENV, "0")
    assert kept_pages.keep(aside, "c1", 1, held_too=0, info=PLENTY) is None
    assert kept_pages.folders() == []


def test_nothing_is_kept_or_claimed_where_others_may_add_names(root):
    """/dev/shm: anyone could plant a folder of that name, or a link in it."""
    root.chmod(0o1777)
    try:
        assert kept_pages.keep(_aside(root, {"pages-2.img": 4096}), "c1", 1, held_too=0,
                               info=PLENTY) is None
        planted = root / "gpusnap-kept-c1.1"
        planted.mkdir()
        (planted / "000.img").write_bytes(b"x" * 4096)
        into = root / ".gpusnap-push-final"
        into.mkdir()
        assert kept_pages.claim("c1", into, 1) == [] and planted.exists()
    finally:
        root.chmod(0o700)


def test_a_linked_kept_folder_or_file_is_not_claimed(root, tmp_path_factory):
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    (elsewhere / "000.img").write_bytes(b"x" * 4096)
    (root / "gpusnap-kept-c1.1").symlink_to(elsewhere)
    into = root / ".gpusnap-push-final"
    into.mkdir()
    assert kept_pages.folders() == [] and kept_pages.claim("c1", into, 1) == []
    folder = _keep(root, "c2", {"pages-2.img": 4096})
    (folder / "001.img").symlink_to(elsewhere / "000.img")
    assert kept_pages.claim("c2", into, 2) == [str(into / "kept" / "000.img")]


def test_the_final_round_claims_the_newest_and_the_older_go(root):
    old = _keep(root, "c1", {"pages-2.img": 4096})
    os.utime(old, (1, 1))
    newer_aside = _aside(root, {"pages-5.img": 2048}, ".push-c1-again")
    newer = root / "gpusnap-kept-c1.2"
    newer.mkdir()
    os.rename(newer_aside / "pages-5.img", newer / "000.img")
    other = _keep(root, "c10", {"pages-2.img": 4096})  # another container, its id a prefix-match
    into = root / ".gpusnap-push-final"
    into.mkdir()
    claimed = kept_pages.claim("c1", into, 1)
    assert claimed == [str(into / "kept" / "000.img")] and os.path.getsize(claimed[0]) == 2048
    assert kept_pages.folders() == [other]  # claimed moved away, the older dropped
    assert kept_pages.claim("c1", into, 1) == []  # nothing left to take twice


def test_a_claim_takes_one_file_per_process_read_ahead_and_frees_the_rest(root):
    folder = _keep(root, "c1", {"pages-2.img": 8192, "pages-3.img": 4096}, count=2)
    into = root / ".gpusnap-push-final"
    into.mkdir()
    assert kept_pages.claim("c1", into, 1) == [str(into / "kept" / "000.img")]
    assert [p.name for p in (into / "kept").iterdir()] == ["000.img"] and not folder.exists()


def test_a_folder_about_to_expire_is_left_to_its_expiry(root):
    folder = _keep(root, "c1", {"pages-2.img": 4096})
    near = time.time() - kept_pages.KEEP_S + kept_pages.CLAIM_MARGIN_S / 2
    os.utime(folder, (near, near))
    into = root / ".gpusnap-push-final"
    into.mkdir()
    assert kept_pages.claim("c1", into, 1) == [] and folder.exists()


def test_release_unlinks_what_the_read_did_not_take(tmp_path):
    a, b = tmp_path / "000.img", tmp_path / "001.img"
    a.write_bytes(b"a")
    kept_pages.release([str(a), str(b)])
    assert not a.exists()


def test_sweep_gives_back_only_what_is_older_than_the_bound(root):
    old = _keep(root, "old", {"pages-2.img": 4096})
    new = _keep(root, "new", {"pages-2.img": 4096})
    past = time.time() - kept_pages.KEEP_S - 5
    os.utime(old, (past, past))
    assert kept_pages.stale() == [old]
    kept_pages.sweep()
    assert kept_pages.folders() == [new]


def test_kept_pages_expire_on_their_own(tmp_path, monkeypatch):
    """No gpusnap need run again: a detached process removes them at the bound."""
    monkeypatch.setattr(kept_pages, "KEEP_S", 0.2)
    folder = tmp_path / "gpusnap-kept-x.1"
    folder.mkdir()
    (folder / "000.img").write_bytes(b"k")
    kept_pages._expire(folder)
    deadline = time.monotonic() + 10
    while folder.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not folder.exists()


def test_a_push_that_needs_the_memory_evicts_kept_pages_oldest_first(root, monkeypatch):
    a = _keep(root, "a", {"pages-2.img": 4096})
    b = _keep(root, "b", {"pages-2.img": 4096})
    os.utime(a, (1, 1))
    monkeypatch.setattr(prepared_pages.journal, "record", lambda *a, **k: None)
    # room appears once the oldest kept folder is gone
    monkeypatch.setattr(memory, "ram_dir", lambda size, held_too=0: None if a.exists() else root)
    assert prepared_pages.evict_for(4096) == root
    assert kept_pages.folders() == [b]
