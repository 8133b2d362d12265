"""pages/prepared_pages.py: which prepared folder a restore takes, and what it still writes."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from gpusnap.oci import segments
from gpusnap.oci.bundle import Bundle, Chunk, FileEntry
from gpusnap.pages import page_patch
from gpusnap.pages import prepared_pages as pp
MiB = 1 << 20
SIZE = 4 * segments.FETCH_SEGMENT  # the smallest file a restore writes beside the import


def chunk(name: str, size: int) -> Chunk:
    return Chunk(f"sha256:{name}", size, f"sha256:z{name}", size // 2)


def pages(chunks: list[Chunk], path: str = "checkpoint/pages-1.img") -> FileEntry:
    return FileEntry(path=path, type="file", size=sum(c.size for c in chunks), chunks=chunks)


def bundle(*files: FileEntry) -> Bundle:
    small = FileEntry(path="checkpoint/pagemap-1.img", type="file", size=10,
                      chunks=[chunk("pm", 10)])
    return Bundle(files=[small, *files], summary={}, gpu_manifest=None, chunking={},
                  compression={})


def quarters(*names: str) -> list[Chunk]:
    return [chunk(n, SIZE // 4) for n in names]


def make_folder(root: Path, name: str, entry: FileEntry, fill: bytes = b"o") -> Path:
    folder = root / (pp.PREFIX + name)
    folder.mkdir()
    with open(folder / entry.path.rpartition("/")[2], "wb") as f:
        f.truncate(entry.size)
        f.write(fill)
    (folder / pp.INDEX).write_text(json.dumps(
        {"files": {entry.path: [[c.digest, c.size] for c in entry.chunks]}}))
    return folder


def test_plan_patch_keeps_what_lies_in_place_and_moves_what_shifted():
    old = [("a", 4), ("b", 4), ("c", 4), ("d", 4)]
    new = [Chunk("a", 4, "", 0), Chunk("x", 4, "", 0), Chunk("y", 4, "", 0),
           Chunk("d", 4, "", 0), Chunk("e", 4, "", 0)]
    patch = page_patch.plan_patch(new, old)
    assert patch.same == 8 and patch.moves == []  # a and d, at their offsets
    assert [(off, [c.digest for c in run]) for off, run in patch.runs] == \
        [(4, ["x", "y"]), (16, ["e"])]
    # two bytes more before them: every old chunk moves forward by 2
    patch = page_patch.plan_patch([Chunk("z", 2, "", 0), *[Chunk(d, 4, "", 0) for d in "abcd"]], old)
    assert patch.same == 0 and patch.moves == [(0, 2, 4), (4, 6, 4), (8, 10, 4), (12, 14, 4)]
    assert [(off, [c.digest for c in run]) for off, run in patch.runs] == [(0, ["z"])]


def _file(tmp_path: Path, data: bytes) -> int:
    path = tmp_path / "f"
    path.write_bytes(data)
    return os.open(path, os.O_RDWR)


@pytest.mark.parametrize("shift", [2, -2, 5, -7])
def test_a_shifted_file_is_moved_whole_in_place(tmp_path, shift):
    """Chunks of 4 bytes shifted by less than a chunk (each move overlaps the
    next one's source): copied in an order that reads each before it is hit."""
    old = b"".join(bytes([65 + i]) * 4 for i in range(8))
    moves = [(i * 4, i * 4 + shift + (8 if shift < 0 else 0), 4) for i in range(8)]
    fd = _file(tmp_path, old + b"\0" * 16)
    try:
        assert page_patch.apply_moves(fd, moves) == []
        data = os.pread(fd, 64, 0)
    finally:
        os.close(fd)
    start = shift + (8 if shift < 0 else 0)
    assert data[start:start + 32] == old


def test_a_move_whose_source_was_written_over_is_left_to_fetch(tmp_path):
    # a swap: each destination is the other's source
    fd = _file(tmp_path, b"aaaabbbb")
    try:
        left = page_patch.apply_moves(fd, [(0, 4, 4), (4, 0, 4)], batch=4)  # one move a batch
        data = os.pread(fd, 8, 0)
        assert left == [(4, 0, 4)] and data == b"aaaaaaaa"  # the second is fetched
        os.pwrite(fd, b"aaaabbbb", 0)
        assert page_patch.apply_moves(fd, [(0, 4, 4), (4, 0, 4)]) == []  # one batch: read, then written
        assert os.pread(fd, 8, 0) == b"bbbbaaaa"
    finally:
        os.close(fd)


@pytest.mark.parametrize("batch", [1 << 20, 64 << 20])
def test_moves_in_batches_of_a_big_shift_match_a_copy(tmp_path, batch):
    """A 24 MiB file whose 4 KiB-aligned chunks all shift by one page (and a
    few by more): moved in batches, with threads, equal to the file the
    shifted layout describes."""
    rng = __import__("random").Random(7)
    sizes = [rng.randrange(1, 64) * 4096 for _ in range(200)]
    old = os.urandom(sum(sizes))
    moves, pos, expect = [], 0, bytearray(len(old) + 4096)
    for size in sizes:
        moves.append((pos, pos + 4096, size))
        expect[pos + 4096:pos + 4096 + size] = old[pos:pos + size]
        pos += size
    fd = _file(tmp_path, old + bytes(4096))
    try:
        assert page_patch.apply_moves(fd, moves, batch=batch) == []
        assert os.pread(fd, len(expect), 0)[4096:] == bytes(expect[4096:])
    finally:
        os.close(fd)


def test_best_prefers_the_exact_file_then_the_most_in_place(tmp_path):
    final = pages(quarters("a", "b", "c", "n"))
    make_folder(tmp_path, "half", pages(quarters("a", "b", "x", "y")))
    near = make_folder(tmp_path, "near", pages(quarters("a", "b", "c", "y")))
    match = pp.best(bundle(final), [tmp_path])
    assert match.folder == near and not match.exact and match.same_bytes == 3 * SIZE // 4
    exact = make_folder(tmp_path, "exact", final)
    match = pp.best(bundle(final), [tmp_path])
    assert match.folder == exact and match.exact


def test_under_half_in_place_is_written_anew(tmp_path):
    final = bundle(pages(quarters("a", "b", "c", "d")))
    assert pp.explain(final, [tmp_path], None).startswith("no prepared folder on this host")
    make_folder(tmp_path, "far", pages(quarters("a", "x", "y", "z")))
    assert pp.best(final, [tmp_path]) is None
    assert pp.explain(final, [tmp_path], None) == (
        "1 prepared folder(s), holding at most 25% of its pages (50% needed), "
        "or taken by another restore first")
    assert pp.best(bundle(), [tmp_path]) is None  # no pages file written beside the import
    assert pp.explain(bundle(), [tmp_path], None) == "no pages file big enough to prepare"


def test_a_link_leaves_the_prepared_file_for_the_next_replica(tmp_path):
    final = pages(quarters("a", "b", "c", "d"))
    folder = make_folder(tmp_path, "r", final, b"prepared")
    out = tmp_path / "pull"
    out.mkdir()
    for n in (1, 2):
        match = pp.best(bundle(final), [tmp_path])
        assert pp.claim(match)
        assert pp.use(match, final, out / f"pages-{n}.img") == []
        pp.release(match)
        assert pp.report(match)["how"] == "linked"
        assert pp.report(match)["bytes_reused"] == SIZE
        assert pp.explain(bundle(final), [tmp_path], match) is None
    assert (folder / "pages-1.img").stat().st_nlink == 3
    assert (out / "pages-2.img").read_bytes()[:8] == b"prepared"


def test_a_patch_claims_the_folder_resizes_and_leaves_nothing(tmp_path):
    old = pages(quarters("a", "b", "c", "d"))
    new = pages([*quarters("a", "b", "c"), chunk("e", SIZE // 4 + MiB)])
    folder = make_folder(tmp_path, "pre", old)
    match = pp.best(bundle(new), [tmp_path])
    assert pp.claim(match) and not folder.exists()
    assert not pp.claim(pp.Match(folder, False, {}, 0))  # the next restore: written anew
    path = tmp_path / "pages-1.img"
    runs = pp.use(match, new, path)
    assert [(off, [c.digest for c in run]) for off, run in runs] == \
        [(3 * SIZE // 4, ["sha256:e"])]
    assert path.stat().st_size == new.size
    assert pp.report(match) == {"folder": str(folder), "how": "patched", "files": 1,
                                "bytes_reused": 3 * SIZE // 4}
    pp.release(match)
    assert not list(tmp_path.glob("*claimed*"))


def test_a_restore_that_failed_before_its_files_moved_gives_the_claimed_folder_back(tmp_path):
    # round 1's pages (GBs) are not spent by a final round's restore that failed
    # before its download began (the registry unreachable): the next try patches them
    old = pages(quarters("a", "b", "c", "d"))
    new = pages([*quarters("a", "b", "c"), chunk("e", SIZE // 4)])
    folder = make_folder(tmp_path, "pre", old)
    match = pp.best(bundle(new), [tmp_path])
    assert pp.claim(match) and not folder.exists()
    pp.release(match, untouched=True)
    assert folder.is_dir() and (folder / "pages-1.img").stat().st_size == old.size
    assert not list(tmp_path.glob("*claimed*"))
    again = pp.best(bundle(new), [tmp_path])
    assert again is not None and again.folder == folder and pp.claim(again)
    folder.mkdir()
    (folder / "another").write_bytes(b"x")  # its name taken meanwhile: spent after all
    pp.release(again, untouched=True)
    assert not list(tmp_path.glob("*claimed*")) and [p.name for p in folder.iterdir()] == ["another"]


def test_a_file_a_replica_linked_is_never_patched(tmp_path):
    """A replica's restore linked the prepared file before a patch claimed the
    folder: its CRIU, fill or mapped staging may still read those bytes."""
    old = pages(quarters("a", "b", "c", "d"))
    new = pages([*quarters("b", "c", "d"), chunk("e", SIZE // 4)])  # every chunk moves
    folder = make_folder(tmp_path, "pre", old, fill=b"replica's")
    os.link(folder / "pages-1.img", tmp_path / "replica.img")
    match = pp.best(bundle(new), [tmp_path])
    assert pp.claim(match)
    assert pp.use(match, new, tmp_path / "pages-1.img") is None  # written anew
    assert match.failed == "pages-1.img: linked by another restore"
    replica = tmp_path / "replica.img"
    assert replica.stat().st_size == old.size and replica.read_bytes()[:9] == b"replica's"
    assert not (tmp_path / "pages-1.img").exists()
    pp.release(match)
    assert replica.read_bytes()[:9] == b"replica's"


def test_a_file_gone_from_the_folder_is_written_anew(tmp_path):
    final = pages(quarters("a", "b", "c", "d"))
    folder = make_folder(tmp_path, "gone", final)
    match = pp.best(bundle(final), [tmp_path])
    os.unlink(folder / "pages-1.img")  # evicted between the choice and the link
    assert pp.use(match, final, tmp_path / "x.img") is None
    assert pp.explain(bundle(final), [tmp_path], match).startswith("pages-1.img: No such file")
    other = pages(quarters("a", "b", "c", "d"), "checkpoint/pages-2.img")
    assert pp.use(match, other, tmp_path / "y.img") is None  # not in the index


def test_folders_without_an_index_are_not_offered(tmp_path):
    (tmp_path / (pp.PREFIX + "partial")).mkdir()
    assert pp.folders([tmp_path]) == []


def test_eviction_drops_prepared_folders_in_ram_oldest_first(tmp_path, monkeypatch):
    old = make_folder(tmp_path, "old", pages(quarters("a", "b", "c", "d")))
    new = make_folder(tmp_path, "new", pages(quarters("e", "f", "g", "h")))
    os.utime(old / pp.INDEX, (1, 1))
    monkeypatch.setattr(pp.memory, "roots", lambda: (tmp_path,))
    room = iter([None, tmp_path])  # refused once, then there is room
    monkeypatch.setattr(pp.memory, "ram_dir", lambda size, held_too=0: next(room))
    monkeypatch.setattr(pp.memory, "shortfall", lambda size, held_too=0: SIZE)  # one folder's worth
    monkeypatch.setattr(pp.journal, "record", lambda *a, **k: None)
    assert pp.evict_for(SIZE) == tmp_path
    assert not old.exists() and new.exists()


def test_nothing_is_evicted_where_dropping_all_would_not_make_the_room(tmp_path, monkeypatch):
    # other restores' holds stand in the way: the folders would go and the pages to the disk anyway
    kept = [make_folder(tmp_path, n, pages(quarters("a", "b", "c", "d"))) for n in ("x", "y")]
    monkeypatch.setattr(pp.memory, "roots", lambda: (tmp_path,))
    monkeypatch.setattr(pp.memory, "ram_dir", lambda size, held_too=0: None)
    monkeypatch.setattr(pp.memory, "shortfall", lambda size, held_too=0: 3 * SIZE)
    assert pp.evict_for(SIZE) is None and all(k.exists() for k in kept)


@pytest.mark.parametrize("env", ["0"])
def test_no_eviction_where_ram_is_off(tmp_path, monkeypatch, env):
    folder = make_folder(tmp_path, "kept", pages(quarters("a", "b", "c", "d")))
    monkeypatch.setenv(pp.memory.ENV, env)
    monkeypatch.setattr(pp.memory, "roots", lambda: (tmp_path,))
    assert pp.evict_for(SIZE) is None and folder.exists()


def test_a_patch_moves_shifted_chunks_and_fetches_only_the_new_one(tmp_path):
    q = SIZE // 4
    body = {n: bytes([ord(n)]) * q for n in "abcd"}
    old = pages(quarters("a", "b", "c", "d"))
    new = pages([chunk("n", MiB), *quarters("a", "b", "c", "e")])  # a MiB more before them
    folder = make_folder(tmp_path, "shifted", old)
    (folder / "pages-1.img").write_bytes(b"".join(body[n] for n in "abcd"))
    match = pp.best(bundle(new), [tmp_path])
    assert match is not None and pp.claim(match)
    path = tmp_path / "pages-1.img"
    runs = pp.use(match, new, path)
    assert [(off, [c.digest for c in run]) for off, run in runs] == \
        [(0, ["sha256:n"]), (MiB + 3 * q, ["sha256:e"])]
    data = path.read_bytes()
    assert len(data) == new.size and data[MiB:MiB + 3 * q] == body["a"] + body["b"] + body["c"]
    assert pp.report(match)["bytes_reused"] == 3 * q
    pp.release(match)


def test_a_renumbered_pages_file_is_found_under_its_old_name(tmp_path):
    """CRIU numbers pages-N.img by task: a child process more at the dump
    renumbers the same memory; it is matched by content, not by name."""
    old = pages(quarters("a", "b", "c", "d"), "checkpoint/pages-1.img")
    folder = make_folder(tmp_path, "renumbered", old, b"first")
    new = pages(quarters("a", "b", "c", "d"), "checkpoint/pages-3.img")
    match = pp.best(bundle(new), [tmp_path])
    assert match.exact and match.sources == {"checkpoint/pages-3.img": "checkpoint/pages-1.img"}
    assert pp.use(match, new, tmp_path / "pages-3.img") == []
    assert (tmp_path / "pages-3.img").read_bytes()[:5] == b"first"
    os.unlink(tmp_path / "pages-3.img")  # that restore is done: a patch may move bytes
    near = pages(quarters("a", "b", "c", "x"), "checkpoint/pages-2.img")
    match = pp.best(bundle(near), [tmp_path])
    assert match.sources == {"checkpoint/pages-2.img": "checkpoint/pages-1.img"}
    assert pp.claim(match) and not folder.exists()
    runs = pp.use(match, near, tmp_path / "pages-2.img")
    assert [off for off, _ in runs] == [3 * SIZE // 4]
    pp.release(match)


def test_a_restore_drops_the_prepared_rounds_of_its_repository(tmp_path, monkeypatch):
    monkeypatch.setattr(pp, "roots", lambda: [tmp_path])
    entries = {n: make_folder(tmp_path, n, pages(quarters(n, "b", "c", "d"))) for n in "xyz"}
    for n, repo, pre in (("x", "reg/app", True), ("y", "reg/app", False), ("z", "reg/other", True)):
        index = json.loads((entries[n] / pp.INDEX).read_text())
        (entries[n] / pp.INDEX).write_text(json.dumps(
            {**index, "repository": repo, "pre_checkpoint": pre}))
    assert pp.drop_rounds("reg/app") == [entries["x"]]
    assert not entries["x"].exists() and entries["y"].exists() and entries["z"].exists()


class _Pool:
    """FetchPool's patch_file from a dict of chunk bodies (the real one fetches
    by worker process; tests/integration/test_segments.py runs it)."""

    def __init__(self, body: dict[str, bytes]) -> None:
        self.body = body

    def patch_file(self, runs, path, check=lambda: None, mapped=False) -> int:
        written = 0
        with open(path, "r+b") as f:
            for off, run in runs:
                f.seek(off)
                for c in run:
                    f.write(self.body[c.digest])
                    written += c.size
        return written

    def write_file(self, chunks, path, check=lambda: None, mapped=False) -> int:
        path.write_bytes(b"".join(self.body[c.digest] for c in chunks))
        return sum(c.size for c in chunks)


def test_a_prepared_folder_keeps_the_pagemaps_of_the_tasks_whose_pages_it_holds(tmp_path, monkeypatch):
    from gpusnap.criu import pagemap as pm

    synced: list[str] = []
    real_fsync = os.fsync
    monkeypatch.setattr(pp.os, "fsync", lambda fd: synced.append(os.readlink(f"/proc/self/fd/{fd}"))
                        or real_fsync(fd))

    q = SIZE // 4
    body = {f"sha256:{n}": bytes([ord(n)]) * q for n in "abcd"}
    image = lambda pages_id: pm.serialize(pm.Pagemap(pages_id, (pm.Run(0x1000, 1, 4),)))  # noqa: E731
    maps = {"checkpoint/pagemap-1.img": image(1), "checkpoint/pagemap-7.img": image(2),
            "checkpoint/pagemap-9.img": b"not an image"}
    out = pp.prepare(bundle(pages(quarters("a", "b", "c", "d"))), "sha256:" + "f" * 64,
                     _Pool(body), tmp_path, pagemaps=maps)
    folder = Path(out["folder"])
    # task 7's pages-2.img is small (not prepared) and 9's unreadable: CRIU would
    # open them in the parent folder and find no pages file there
    assert sorted(p.name for p in folder.iterdir()) == ["index.json", "pagemap-1.img",
                                                        "pages-1.img"]
    # on a disk, its files and folder synced before the rename names it whole, then the rename
    assert sorted(Path(p).name for p in synced[:3]) == ["index.json", "pagemap-1.img", "pages-1.img"]
    assert Path(synced[3]).name.startswith(".gpusnap-pull-") and synced[4:] == [str(tmp_path)]


def test_a_shifted_file_becomes_the_parent_and_only_the_new_pages_are_written(tmp_path):
    from gpusnap.criu import pagemap as pm

    q = SIZE // 4
    body = {f"sha256:{n}": bytes([ord(n)]) * q for n in "abcde"}
    body["sha256:n"] = b"n" * MiB
    old = pages(quarters("a", "b", "c", "d"))
    new = pages([chunk("n", MiB), *quarters("a", "b", "c", "e")])  # a grown mapping first
    folder = make_folder(tmp_path, "round1", old)
    (folder / "pages-1.img").write_bytes(b"".join(body[c.digest] for c in old.chunks))
    image = lambda runs: pm.serialize(pm.Pagemap(1, tuple(pm.Run(v, n, pm.PE_PRESENT)  # noqa: E731
                                                          for v, n in runs)))
    big = 0x7f0000000000
    (folder / "pagemap-1.img").write_bytes(image([(0x1000, 1), (big, SIZE // pm.PAGE - 1)]))
    final = image([(0x1000, 1 + MiB // pm.PAGE), (big, SIZE // pm.PAGE - 1)])
    match = pp.best(bundle(new), [tmp_path])
    assert pp.claim(match)
    assert pp.parent_plans(match, bundle(new), {"checkpoint/pagemap-1.img": final})
    plan = match.plans["checkpoint/pages-1.img"]
    assert plan.parent_bytes == 3 * q - pm.PAGE  # a, b, c but the page kept out of `big`
    out = tmp_path / "pull"
    out.mkdir()
    written = pp.write_parent(match, new, out / "pages-1.img", _Pool(body))
    assert written == MiB + 2 * q  # n, and the chunks holding the page before big and e
    assert (out / "pages-1.img").stat().st_size == plan.own_bytes == MiB + q + pm.PAGE
    assert os.readlink(out / "parent") == str(match.claimed)
    assert pp.rewritten(match, "checkpoint/pagemap-1.img") == plan.pagemap
    assert pp.report(match)["how"] == "parent"
    assert (match.claimed / "pages-1.img").is_file()  # the parent stays until the restore ends
    # another task's file the folder could patch is written anew: nothing leaves the parent
    match.sources["checkpoint/pages-3.img"] = "checkpoint/pages-1.img"
    assert pp.use(match, pages(new.chunks, "checkpoint/pages-3.img"), out / "pages-3.img") is None
    assert (match.claimed / "pages-1.img").is_file()
    pp.release(match)
    assert not match.claimed.exists()


def test_a_folder_without_pagemaps_is_patched_as_before(tmp_path):
    old = pages(quarters("a", "b", "c", "d"))
    make_folder(tmp_path, "older", old)
    new = pages(quarters("a", "b", "c", "e"))
    match = pp.best(bundle(new), [tmp_path])
    assert pp.claim(match)
    assert not pp.parent_plans(match, bundle(new), {"checkpoint/pagemap-1.img": b"x"}) \
        and not match.plans
    pp.release(match)


GiB = 1 << 30
ROOMY = {"MemTotal": 128 * GiB, "MemAvailable": 100 * GiB}


def _written(tmp_path: Path, monkeypatch, entry: FileEntry, name: str = "x") -> Path:
    """A restore's pull folder in a stand-in RAM root, with ``entry``'s file written whole."""
    monkeypatch.setenv(pp.KEEP_ENV, "auto")  # the test session turns it off (tests/conftest.py)
    monkeypatch.setattr(pp.memory, "roots", lambda: (tmp_path,))
    monkeypatch.setattr(pp.memory, "ram_dir", lambda size, info=None, root=None, hold=True:
                        root if info["MemAvailable"] >= 2 * size else None)
    monkeypatch.setattr(pp.journal, "record", lambda *a, **k: None)
    folder = tmp_path / f".gpusnap-pull-{name}"
    folder.mkdir()
    with open(folder / "pages-1.img", "wb") as f:
        f.truncate(entry.size)
    return folder


def test_a_restores_pages_are_kept_for_the_next_replica_which_links_them(tmp_path, monkeypatch):
    entry = pages(quarters("a", "b", "c", "d"))
    b = bundle(entry)
    folder = _written(tmp_path, monkeypatch, entry)
    (folder / "stray").write_text("x")  # nothing but the pages files stays
    kept = pp.keep(b, "sha256:0123456789abcdef0123", folder, repository="r/x", info=ROOMY)
    assert kept == {"folder": str(tmp_path / (pp.PREFIX + "0123456789abcdef")),
                    "bytes": SIZE, "in_ram": True}
    assert not folder.exists() and sorted(p.name for p in Path(kept["folder"]).iterdir()) == \
        [pp.INDEX, "pages-1.img"]
    match = pp.best(b, [tmp_path])
    assert match is not None and match.exact  # the next restore links it
    # a second replica restored at the same time keeps nothing: the name is taken
    again = _written(tmp_path, monkeypatch, entry, "y")
    assert pp.keep(b, "sha256:0123456789abcdef0123", again, info=ROOMY) is None
    assert again.exists()  # left to the caller, which discards it


@pytest.mark.parametrize("why", ["off", "cut", "share", "room"])
def test_pages_are_not_kept_when_off_partial_or_ram_is_short(tmp_path, monkeypatch, why):
    entry = pages(quarters("a", "b", "c", "d"))
    folder = _written(tmp_path, monkeypatch, entry)
    info = dict(ROOMY)
    if why == "off":
        monkeypatch.setenv(pp.KEEP_ENV, "0")
    elif why == "cut":  # linked from elsewhere or written short: not the file
        os.truncate(folder / "pages-1.img", entry.size - 1)
    elif why == "share":  # over a quarter of the RAM with the folders already kept
        info["MemTotal"] = 4 * SIZE - 1
    else:
        info["MemAvailable"] = SIZE
    assert pp.keep(bundle(entry), "sha256:feed", folder, info=info) is None
    assert folder.exists() and not list(tmp_path.glob(pp.PREFIX + "*"))
