"""pages/fill_plan.py + pages/page_fill.py: the runs left out of CRIU's restore,
checked by reading every page back the way CRIU does (present runs in order,
PE_PARENT runs from the parent folder, recursively) and adding what the fill
writes: together they must be the dumped memory, page for page, and disjoint.
The fill itself writes into real child processes."""

from __future__ import annotations

import json
import os
import random
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpusnap.criu import mm

from gpusnap.action import action, step_state

from gpusnap.pages import fill_plan, fill_plan_cache, page_fill
from gpusnap.criu import pagemap as pm
from gpusnap.criu.images import IMG_COMMON_MAGIC
from gpusnap.errors import GpusnapError
from gpusnap.proto.wire import varint
from tests.unit.test_parent_pages import _restored as criu_reads

PAGE = pm.PAGE
PLAIN = (mm.VMA_AREA_REGULAR | mm.VMA_ANON_PRIVATE, 0x3, mm.MAP_PRIVATE | mm.MAP_ANONYMOUS)
FILE_PRIVATE = (mm.VMA_AREA_REGULAR | (1 << 6), 0x3, mm.MAP_PRIVATE)
STACK = (mm.VMA_AREA_REGULAR | mm.VMA_ANON_PRIVATE | (1 << 1), 0x3,
         mm.MAP_PRIVATE | mm.MAP_ANONYMOUS | mm.MAP_GROWSDOWN)
READ_ONLY = (mm.VMA_AREA_REGULAR | mm.VMA_ANON_PRIVATE, 0x1, mm.MAP_PRIVATE | mm.MAP_ANONYMOUS)


@pytest.fixture(autouse=True)
def small(monkeypatch):
    monkeypatch.setattr(fill_plan, "MIN_RUN", 2 * PAGE)
    monkeypatch.setattr(fill_plan, "MIN_TOTAL", 8 * PAGE)
    monkeypatch.setattr(fill_plan, "HUGE_MIN", 8 * PAGE)


def _msg(fields: list[tuple[int, int | bytes]]) -> bytes:
    out = b""
    for n, v in fields:
        out += varint(n << 3 | 2) + varint(len(v)) + v if isinstance(v, bytes) \
            else varint(n << 3) + varint(v)
    return out


def _mm_image(vmas: list[tuple[int, int, tuple[int, int, int]]], madv: dict[int, int] | None = None) -> bytes:
    """``madv``: an area's madvise bits by its start (field 9, which CRIU leaves out at 0)."""
    madv = madv or {}
    body = _msg([(1, 0x400000), (2, 0x401000)] + [
        (14, _msg([(1, start), (2, end), (3, 0), (4, 0), (5, prot), (6, flags), (7, status),
                   (8, 1)] + ([(9, madv[start])] if start in madv else [])))
        for start, end, (status, prot, flags) in vmas])
    return struct.pack("<III", IMG_COMMON_MAGIC, mm.MM_MAGIC, len(body)) + body


def _task(folder: Path, vpid: int, pages_id: int, vmas, runs: list[tuple[int, int, int]],
          rnd: random.Random) -> dict[int, bytes]:
    """mm, pagemap and pages images of one task; runs: (vaddr, pages, flags). The
    memory it dumped: every page of its present runs (parent runs are the parent's)."""
    folder.mkdir(exist_ok=True)
    (folder / f"mm-{vpid}.img").write_bytes(_mm_image(vmas))
    (folder / f"pagemap-{vpid}.img").write_bytes(
        pm.serialize(pm.Pagemap(pages_id, tuple(pm.Run(v, n, f) for v, n, f in runs))))
    memory, data = {}, bytearray()
    for vaddr, n, flags in runs:
        if flags & pm.PE_PRESENT:
            for i in range(n):
                memory[vaddr + i * PAGE] = page = rnd.randbytes(PAGE)
                data += page
    (folder / f"pages-{pages_id}.img").write_bytes(bytes(data))
    return memory


def _criu_reads(folder: Path, vpid: int) -> dict[int, bytes]:
    """What CRIU writes into the task's memory from this folder and its parents."""
    image = (folder / f"pagemap-{vpid}.img").read_bytes()
    parent = _criu_reads(folder / "parent", vpid) if (folder / "parent").exists() else {}
    return criu_reads(image, (folder / pm.parse(image).pages_file).read_bytes(), parent)


def _fills(runs: list[page_fill.Run]) -> dict[int, bytes]:
    out = {}
    for r in runs:
        with open(r.path, "rb") as f:
            f.seek(r.offset)
            data = f.read(r.length)
        assert len(data) == r.length
        for i in range(0, r.length, PAGE):
            out[r.address + i] = data[i:i + PAGE]
    return out


def _snapshot(folder: Path) -> dict[str, bytes | str]:
    return {str(p.relative_to(folder)): (os.readlink(p) if p.is_symlink() else p.read_bytes())
            for p in sorted(folder.rglob("*")) if p.is_symlink() or p.is_file()}


def _restored(folder: Path, vpid: int, p: fill_plan.Plan) -> dict[int, bytes]:
    by_criu, filled = _criu_reads(folder, vpid), _fills(p.tasks.get(vpid, []))
    assert not by_criu.keys() & filled.keys()  # a page is CRIU's or the fill's, never both
    return {**by_criu, **filled}


A, B, C, D = 0x10000000, 0x20000000, 0x30000000, 0x7ff000000000


def _one_task(folder: Path, rnd: random.Random) -> dict[int, bytes]:
    vmas = [(A, A + 16 * PAGE, PLAIN), (B, B + 8 * PAGE, FILE_PRIVATE),
            (C, C + 64 * PAGE, PLAIN), (D, D + 8 * PAGE, STACK), (D + 64 * PAGE, D + 72 * PAGE, READ_ONLY)]
    # one run across both ends of A (1 page in it: too short to fill), B whole, C in three runs
    runs = [(A + 15 * PAGE, 1, pm.PE_PRESENT), (B, 8, pm.PE_PRESENT), (C, 10, pm.PE_PRESENT),
            (C + 12 * PAGE, 40, pm.PE_PRESENT), (C + 60 * PAGE, 1, pm.PE_PRESENT),
            (D, 8, pm.PE_PRESENT), (D + 64 * PAGE, 8, pm.PE_PRESENT)]
    return _task(folder, 1, 1, vmas, runs, rnd)


def test_big_runs_of_plain_memory_are_left_to_the_fill_and_the_rest_to_criu(tmp_path):
    folder = tmp_path / "images"
    memory = _one_task(folder, random.Random(1))
    before = _snapshot(folder)
    kept: list[fill_plan.Plan] = []
    p = fill_plan.prepare(folder, kept.append)
    assert p is not None and kept == [p]
    assert [(r.address, r.length) for r in p.tasks[1]] == [(C, 10 * PAGE), (C + 12 * PAGE, 40 * PAGE)]
    assert p.bytes == 50 * PAGE
    assert _restored(folder, 1, p) == memory
    assert os.readlink(folder / "parent") == fill_plan.FOLDER
    fill_plan.undo(folder)
    assert _snapshot(folder) == before  # CRIU's folder exactly as it was
    assert not fill_plan.undo(folder)


def test_a_folder_with_a_parent_is_read_through_it_and_the_fill_reads_the_parents_file(tmp_path):
    rnd = random.Random(2)
    round1 = tmp_path / "prepared"
    vmas = [(C, C + 64 * PAGE, PLAIN), (B, B + 8 * PAGE, FILE_PRIVATE)]
    old = _task(round1, 1, 1, vmas, [(B, 8, pm.PE_PRESENT), (C, 64, pm.PE_PRESENT)], rnd)
    folder = tmp_path / "images"
    # the final round: C's first 60 pages unchanged (the parent's), the last 4 and B anew
    new = _task(folder, 1, 3, vmas, [(B, 8, pm.PE_PRESENT), (C, 60, pm.PE_PARENT),
                                     (C + 60 * PAGE, 4, pm.PE_PRESENT)], rnd)
    (folder / "pages-2.img").write_bytes(b"")  # another task's pages id: the new one must differ
    os.symlink("../prepared", folder / "parent")
    memory = {**{a: old[a] for a in old if C <= a < C + 60 * PAGE}, **new}
    before = _snapshot(folder)
    p = fill_plan.prepare(folder, lambda p: None)
    assert p is not None
    assert {r.path for r in p.tasks[1]} == {os.path.realpath(round1 / "pages-1.img"),
                                            os.path.realpath(folder / "pages-3.img")}
    assert pm.parse((folder / "pagemap-1.img").read_bytes()).pages_id == 4
    assert os.readlink(folder / fill_plan.FOLDER / "parent") == "../../prepared"
    assert _restored(folder, 1, p) == memory
    fill_plan.undo(folder)
    assert _snapshot(folder) == before


def test_memory_two_tasks_map_at_the_same_range_stays_with_criu(tmp_path):
    """Forked memory: CRIU shares its pages copy-on-write between the two tasks."""
    rnd = random.Random(3)
    folder = tmp_path / "images"
    vmas = [(C, C + 64 * PAGE, PLAIN)]
    _task(folder, 1, 1, vmas, [(C, 64, pm.PE_PRESENT)], rnd)
    _task(folder, 7, 2, vmas, [(C, 64, pm.PE_PRESENT)], rnd)
    before = _snapshot(folder)
    assert fill_plan.prepare(folder, lambda p: None) is None
    assert _snapshot(folder) == before


def test_too_little_to_fill_leaves_the_folder_alone(tmp_path, monkeypatch):
    folder = tmp_path / "images"
    _one_task(folder, random.Random(4))
    monkeypatch.setattr(fill_plan, "MIN_TOTAL", 51 * PAGE)
    before = _snapshot(folder)
    assert fill_plan.prepare(folder, lambda p: None) is None
    assert _snapshot(folder) == before


def test_a_rewrite_cut_short_is_put_back_and_a_leftover_one_undone_first(tmp_path, monkeypatch):
    folder = tmp_path / "images"
    memory = _one_task(folder, random.Random(5))
    before = _snapshot(folder)
    real_replace, failed = os.replace, []

    def broken(src, dst):  # the new pagemap cannot take its place; putting back still works
        if str(src).endswith(".gpusnap-tmp") and not failed:
            failed.append(dst)
            raise OSError(28, "No space left on device")
        return real_replace(src, dst)
    monkeypatch.setattr(fill_plan.os, "replace", broken)
    with pytest.raises(OSError):
        fill_plan.prepare(folder, lambda p: None)
    monkeypatch.setattr(fill_plan.os, "replace", real_replace)
    assert _snapshot(folder) == before
    p = fill_plan.prepare(folder, lambda p: None)  # a restore that then never reached pre-resume
    p = fill_plan.prepare(folder, lambda p: None)  # the next restore of the same folder
    assert _restored(folder, 1, p) == memory
    fill_plan.undo(folder)
    assert _snapshot(folder) == before


def test_settings_file(tmp_path):
    path = tmp_path / "page-fill.json"
    assert fill_plan.settings(path) == fill_plan.Settings(True, 0, True, True)
    path.write_text('{"enabled": false, "threads": 4, "huge_pages": false, "agent": false}')
    assert fill_plan.settings(path) == fill_plan.Settings(False, 4, False, False)
    for bad in ('{"threads": "many"}', '{"huge_pages": 1}', '{"agent": "no"}'):
        path.write_text(bad)
        with pytest.raises(ValueError, match="page-fill.json"):
            fill_plan.settings(path)


def test_a_plan_survives_its_json():
    p = fill_plan.Plan("/x", {1: [page_fill.Run(C, 4 * PAGE, "/x/pages-1.img", 8192)]},
                       {1: [(C, C + 4 * PAGE)]})
    assert fill_plan.Plan.from_json(p.to_json()) == p


E, F = 0x40000000, 0x50000000
DONTFORK = 1 << 10


def _dense_task(folder: Path, rnd: random.Random) -> dict[int, bytes]:
    """C filled to 50 of 64 pages; E whole (and MADV_DONTFORK already); F whole but
    the application said MADV_NOHUGEPAGE; A too small for a huge page."""
    vmas = [(A, A + 4 * PAGE, PLAIN), (C, C + 64 * PAGE, PLAIN), (E, E + 32 * PAGE, PLAIN),
            (F, F + 16 * PAGE, PLAIN)]
    runs = [(A, 4, pm.PE_PRESENT), (C, 50, pm.PE_PRESENT), (E, 32, pm.PE_PRESENT),
            (F, 16, pm.PE_PRESENT)]
    memory = _task(folder, 1, 1, vmas, runs, rnd)
    (folder / "mm-1.img").write_bytes(
        _mm_image(vmas, {E: DONTFORK, F: 1 << mm.MADV_NOHUGEPAGE}))
    return memory


def test_areas_the_fill_writes_almost_whole_get_huge_pages_and_undo_puts_the_mm_image_back(tmp_path):
    folder = tmp_path / "images"
    memory = _dense_task(folder, random.Random(15))
    before = _snapshot(folder)
    p = fill_plan.prepare(folder, lambda p: None, huge_pages=True)
    assert p is not None and p.huge == {1: [(E, E + 32 * PAGE)]} and p.huge_bytes == 32 * PAGE
    by_start = {v.start: v for v in mm.parse((folder / "mm-1.img").read_bytes())}
    assert by_start[E].madv == DONTFORK | 1 << mm.MADV_HUGEPAGE
    assert by_start[F].madv == 1 << mm.MADV_NOHUGEPAGE
    assert by_start[A].madv == by_start[C].madv == 0
    assert _restored(folder, 1, p) == memory  # which pages the fill writes does not change
    fill_plan.undo(folder)
    assert _snapshot(folder) == before


def test_without_huge_pages_the_mm_images_are_left_alone(tmp_path):
    folder = tmp_path / "images"
    _dense_task(folder, random.Random(16))
    mm_before = (folder / "mm-1.img").read_bytes()
    p = fill_plan.prepare(folder, lambda p: None, huge_pages=False)
    assert p is not None and p.huge == {} and (folder / "mm-1.img").read_bytes() == mm_before


def test_an_mm_image_gets_one_bit_and_keeps_every_other_byte():
    image = _mm_image([(A, A + 4 * PAGE, PLAIN), (E, E + 32 * PAGE, PLAIN)], {E: DONTFORK})
    once = mm.with_advice(image, [(E, E + 32 * PAGE)], mm.MADV_HUGEPAGE)
    assert mm.with_advice(once, [(E, E + 32 * PAGE)], mm.MADV_HUGEPAGE) == once
    assert [v.madv for v in mm.parse(once)] == [0, DONTFORK | 1 << mm.MADV_HUGEPAGE]
    assert mm.with_advice(image, [], mm.MADV_HUGEPAGE) == image
    with pytest.raises(ValueError, match="no area"):
        mm.with_advice(image, [(F, F + PAGE)], mm.MADV_HUGEPAGE)


def test_huge_pages_only_where_the_host_has_them(tmp_path):
    path = tmp_path / "enabled"
    assert not fill_plan.thp_available(path)  # no such file: a kernel without THP
    for text, ok in (("always [madvise] never", True), ("[always] madvise never", True),
                     ("always madvise [never]", False)):
        path.write_text(text + "\n")
        assert fill_plan.thp_available(path) is ok


# -- the fill, into real processes ----------------------------------------------------------

CHILD = r"""
import ctypes, mmap, sys, time
n = int(sys.argv[1])
m = mmap.mmap(-1, n + (4 << 12), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
base = ctypes.addressof(ctypes.c_char.from_buffer(m))
ctypes.CDLL(None).munmap(ctypes.c_void_p(base + n), 4 << 12)  # a hole after it, for sure
print(base, flush=True)
time.sleep(600)
"""


@pytest.fixture
def child():
    size = 3 << 20
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(size)], stdout=subprocess.PIPE,
                            text=True)
    base = int(proc.stdout.readline())
    yield proc, base, size
    proc.kill()
    proc.wait()


def _memory_of(pid: int, address: int, length: int) -> bytes:
    with open(f"/proc/{pid}/mem", "rb", buffering=0) as mem:
        mem.seek(address)
        return mem.read(length)


def test_fill_writes_every_piece_at_its_address(tmp_path, child):
    proc, base, size = child
    data = random.Random(6).randbytes(size)
    src = tmp_path / "pages.img"
    src.write_bytes(b"\0" * PAGE + data)
    runs = [page_fill.Run(base, 1 << 20, str(src), PAGE),
            page_fill.Run(base + (1 << 20), size - (1 << 20), str(src), PAGE + (1 << 20))]
    assert page_fill.fill(proc.pid, runs, threads=3, piece=256 << 10) == size
    assert _memory_of(proc.pid, base, size) == data


def _status_kib(field: str) -> int:
    line = next(x for x in open("/proc/self/status") if x.startswith(field + ":"))
    return int(line.split()[1])


def test_the_filling_process_maps_at_most_a_piece_per_thread_of_the_pages_file(tmp_path):
    """process_vm_writev maps each source page it copies into the filling
    process: kept, a whole pages file would count in its RSS (the OOM killer's
    first pick, in the middle of a restore)."""
    size = 32 << 20
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(size)], stdout=subprocess.PIPE,
                            text=True)
    try:
        base = int(proc.stdout.readline())
        data = random.Random(9).randbytes(size)
        src = tmp_path / "pages.img"
        src.write_bytes(data)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM back to the RSS now
        before = _status_kib("VmRSS")
        assert page_fill.fill(proc.pid, [page_fill.Run(base, size, str(src), 0)], threads=1,
                              piece=1 << 20) == size
        assert _status_kib("VmHWM") - before < 8 << 10  # KiB: a 1 MiB piece and Python's own
        assert _memory_of(proc.pid, base, size) == data
    finally:
        proc.kill()
        proc.wait()


def test_fill_into_memory_the_process_lacks_is_an_error(tmp_path, child):
    proc, base, size = child
    src = tmp_path / "pages.img"
    src.write_bytes(b"x" * (2 * size))
    with pytest.raises(OSError, match="cannot write"):
        page_fill.fill(proc.pid, [page_fill.Run(base, 2 * size, str(src), 0)], threads=2)
    with pytest.raises(OSError, match="ends before"):
        page_fill.fill(proc.pid, [page_fill.Run(base, size, str(src), 2 * size - PAGE)], threads=2)


def test_runs_that_continue_one_another_are_one_call_and_the_rest_are_batched():
    r = page_fill.Run
    runs = [r(0x10000, PAGE, "/a", 0), r(0x11000, PAGE, "/a", PAGE),  # one stretch
            r(0x12000, PAGE, "/a", 5 * PAGE),  # next in memory, not in its file
            r(0x20000, PAGE, "/a", 6 * PAGE),  # next in its file, not in memory
            r(0x21000, PAGE, "/b", 7 * PAGE)]  # another file
    assert page_fill.merged(runs) == [r(0x10000, 2 * PAGE, "/a", 0)] + runs[2:]
    assert list(page_fill.batches(runs)) == [page_fill.merged(runs)]
    groups = list(page_fill.batches(runs, piece=2 * PAGE, most=2))
    assert groups == [[r(0x10000, 2 * PAGE, "/a", 0)], runs[2:4], runs[4:]]
    big = [r(0x100000, 5 * PAGE, "/a", 0)]  # longer than a piece: cut
    assert [[(p.address, p.length) for p in g] for g in page_fill.batches(big, piece=2 * PAGE)] \
        == [[(0x100000, 2 * PAGE)], [(0x102000, 2 * PAGE)], [(0x104000, PAGE)]]


def test_a_batch_of_many_runs_lands_each_at_its_address(tmp_path, child):
    proc, base, size = child
    data = random.Random(17).randbytes(size)
    src = tmp_path / "pages.img"
    src.write_bytes(data)
    # every other page from the file's start, the pages between from its end backwards
    n = size // PAGE
    runs = [page_fill.Run(base + i * PAGE, PAGE, str(src), (i // 2 if i % 2 == 0 else n - 1 - i // 2) * PAGE)
            for i in range(n)]
    assert page_fill.fill(proc.pid, runs, threads=2, piece=64 * PAGE) == size
    got = _memory_of(proc.pid, base, size)
    assert all(got[i * PAGE:(i + 1) * PAGE] == data[runs[i].offset:runs[i].offset + PAGE]
               for i in range(n))


def test_a_batch_that_stops_short_names_the_page_it_could_not_write(tmp_path, child):
    proc, base, size = child
    src = tmp_path / "pages.img"
    src.write_bytes(b"y" * (size + 2 * PAGE))
    runs = [page_fill.Run(base + size - PAGE, PAGE, str(src), 0),  # the mapping's last page
            page_fill.Run(base + size + PAGE, PAGE, str(src), PAGE)]  # beyond it
    with pytest.raises(OSError, match=f"cannot write {PAGE} bytes at {base + size + PAGE:#x}"):
        page_fill.fill(proc.pid, runs, threads=1)
    assert _memory_of(proc.pid, base + size - PAGE, PAGE) == b"y" * PAGE


@pytest.fixture
def state(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUSNAP_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setattr(fill_plan, "SETTINGS", tmp_path / "page-fill.json")
    return tmp_path / "state"


def _planned(tmp_path: Path, pid: int, base: int, size: int, criu_pid: int) -> tuple[Path, bytes]:
    """An images folder rewritten as pre-restore does, whose one task is the child."""
    folder = tmp_path / "images"
    rnd = random.Random(7)
    memory = _task(folder, pid, 1, [(base, base + size, PLAIN)], [(base, size // PAGE, pm.PE_PRESENT)],
                   rnd)
    assert step_state.fill(criu_pid).parent.is_dir()
    fill_plan.prepare(folder, lambda p: action.write_private(step_state.fill(criu_pid), p.to_json()))
    return folder, b"".join(memory[a] for a in sorted(memory))


def test_post_restore_fills_the_restored_task_and_puts_the_folder_back(tmp_path, state, child):
    proc, base, size = child
    folder, data = _planned(tmp_path, proc.pid, base, size, criu_pid=4242)
    action.post_restore(init_pid=proc.pid, criu_pid=4242)
    assert _memory_of(proc.pid, base, size) == data
    assert not (folder / fill_plan.FOLDER).exists() and not (folder / "parent").exists()
    assert not step_state.fill(4242).exists()
    event = json.loads((state / "journal.jsonl").read_text().splitlines()[-1])
    assert event["event"] == "pages-filled" and event["bytes"] == size


def test_post_restore_that_cannot_fill_fails_the_step_and_puts_the_folder_back(
        tmp_path, state, child, monkeypatch):
    """CRIU kills the restored tasks and fails the restore when post-restore fails
    (criu/cr-restore.c): the step must fail, as the script's exit code."""
    proc, base, size = child
    folder, _ = _planned(tmp_path, proc.pid, base, size, criu_pid=4243)
    os.truncate(folder / "pages-1.img", PAGE)  # the pages went missing under the restore
    with pytest.raises(GpusnapError, match="could not write the restored memory"):
        action.post_restore(init_pid=proc.pid, criu_pid=4243)
    assert not (folder / fill_plan.FOLDER).exists()
    (tmp_path / "again").mkdir()  # the same through the script's entry (CRIU: its parent)
    _planned(tmp_path / "again", proc.pid, base, size, criu_pid=os.getppid())
    os.truncate(tmp_path / "again" / "images" / "pages-1.img", PAGE)
    monkeypatch.setenv("CRTOOLS_INIT_PID", str(proc.pid))
    monkeypatch.setenv("CRTOOLS_IMAGE_DIR", str(tmp_path / "again" / "images"))
    assert action._run("post-restore") == 1


def test_a_stale_plan_of_another_restore_is_never_used(tmp_path, state, child):
    proc, base, size = child
    stale = step_state.fill(4244)
    action.write_private(stale, fill_plan.Plan("/gone", {1: []}).to_json())
    folder = tmp_path / "images"
    _task(folder, 1, 1, [(C, C + 4 * PAGE, PLAIN)], [(C, 4, pm.PE_PRESENT)], random.Random(10))
    # nothing worth filling here: the old plan must go
    action.pre_restore(str(folder), 4244, action.fill_settings())
    assert not stale.exists()


def test_a_folder_a_failed_restore_left_rewritten_is_put_back_first(tmp_path, state, monkeypatch):
    """Even with the fill turned off since: CRIU must never read its holes."""
    folder = tmp_path / "images"
    _one_task(folder, random.Random(11))
    before = _snapshot(folder)
    fill_plan.prepare(folder, lambda p: None)  # and that restore never reached post-restore
    fill_plan.SETTINGS.write_text('{"enabled": false}')
    monkeypatch.setenv("CRTOOLS_IMAGE_DIR", str(folder))
    assert action._run("pre-restore") == 0
    assert _snapshot(folder) == before


def test_a_rewrite_that_cannot_be_put_back_refuses_the_restore(tmp_path, state, monkeypatch, capsys):
    folder = tmp_path / "images"
    _one_task(folder, random.Random(12))
    fill_plan.prepare(folder, lambda p: None)
    (folder / fill_plan.FOLDER / fill_plan.UNDO).write_text("")  # lost in a crash
    monkeypatch.setenv("CRTOOLS_IMAGE_DIR", str(folder))
    assert action._run("pre-restore") == 1
    assert "cannot be put back" in capsys.readouterr().err
    assert (folder / fill_plan.FOLDER / "pagemap-1.img").exists()  # the original kept


def test_hugetlb_memory_leaves_the_folder_to_criu(tmp_path):
    """CRIU reads hugetlb pages in its restorer at its own pages file's offsets."""
    folder = tmp_path / "images"
    _one_task(folder, random.Random(13))
    huge = (mm.VMA_AREA_REGULAR | mm.VMA_ANON_PRIVATE, 0x3,
            mm.MAP_PRIVATE | mm.MAP_ANONYMOUS | mm.MAP_HUGETLB)
    (folder / "mm-1.img").write_bytes(_mm_image([(C, C + 64 * PAGE, PLAIN), (A, A + 512 * PAGE, huge)]))
    assert fill_plan.prepare(folder, lambda p: None) is None


def test_a_stretch_made_of_short_pieces_of_two_files_is_filled_whole(tmp_path, monkeypatch):
    """The final round of a pre-copy reads most pages from its parent, in runs cut
    wherever a chunk changed: each piece is short, the stretch they make is not."""
    monkeypatch.setattr(fill_plan, "MIN_RUN", 6 * PAGE)
    rnd = random.Random(8)
    round1 = tmp_path / "prepared"
    vmas = [(C, C + 16 * PAGE, PLAIN)]
    old = _task(round1, 1, 1, vmas, [(C, 16, pm.PE_PRESENT)], rnd)
    folder = tmp_path / "images"
    runs = [(C + i * PAGE, 1, pm.PE_PARENT if i % 2 else pm.PE_PRESENT) for i in range(12)]
    new = _task(folder, 1, 2, vmas, runs, rnd)
    os.symlink("../prepared", folder / "parent")
    p = fill_plan.prepare(folder, lambda p: None)
    assert p is not None and len(p.tasks[1]) == 12 and p.bytes == 12 * PAGE
    assert _restored(folder, 1, p) == {**{a: old[a] for a in old if a < C + 12 * PAGE}, **new}


def test_pagemaps_and_pages_that_are_links_to_ram_stay_links(tmp_path):
    """Pages in RAM, the folder on disk: pre-restore left relative links
    (pages_aside.bring_back); the rewrite reads through them and undo puts the
    same links back."""
    ram, folder = tmp_path / "ram", tmp_path / "disk" / "images"
    memory = _one_task(ram, random.Random(9))
    folder.mkdir(parents=True)
    (ram / "mm-1.img").rename(folder / "mm-1.img")
    for name in ("pagemap-1.img", "pages-1.img"):
        os.symlink(f"../../ram/{name}", folder / name)
    before = _snapshot(folder)
    p = fill_plan.prepare(folder, lambda p: None)
    assert p is not None and not (folder / "pagemap-1.img").is_symlink()
    assert _restored(folder, 1, p) == memory
    fill_plan.undo(folder)
    assert _snapshot(folder) == before
    assert pm.parse((ram / "pagemap-1.img").read_bytes()).pages_id == 1  # the RAM file untouched


def test_a_rewrite_cut_short_that_cannot_be_put_back_refuses_the_restore(tmp_path, state, monkeypatch):
    folder = tmp_path / "images"
    _one_task(folder, random.Random(14))

    def broken(p):  # the rewrite fails after the pagemaps moved, and so does putting it back
        raise OSError(5, "Input/output error")
    real_rewrite = fill_plan.rewrite

    def half(p):
        real_rewrite(p)
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(fill_plan, "rewrite", half)
    monkeypatch.setattr(fill_plan, "undo", lambda f: broken(f) if (Path(f) / fill_plan.FOLDER).exists() else False)
    with pytest.raises(GpusnapError, match="cannot be put back"):
        action.pre_restore(str(folder), 4245, action.fill_settings())
    assert not step_state.fill(4245).exists()


def test_entries_that_continue_one_another_are_located_as_one_stretch(tmp_path):
    """CRIU caps a pagemap entry at 1 MiB: a GPU process's memory comes as
    thousands of them. Located, they are the stretches they make (a new one
    where the address jumps), each at its offset in the pages file."""
    P = pm.PAGE
    folder = tmp_path / "images"
    folder.mkdir()
    runs = [(0x100000 + i * 256 * P, 256, pm.PE_PRESENT) for i in range(40)]  # 40 MiB in a row
    runs += [(0x4000000, 8, pm.PE_PRESENT), (0x4000000 + 8 * P, 8, pm.PE_PRESENT)]  # a jump
    (folder / "pagemap-1.img").write_bytes(
        pm.serialize(pm.Pagemap(3, tuple(pm.Run(v, n, f) for v, n, f in runs))))
    (folder / "pages-3.img").write_bytes(b"")
    path = os.path.realpath(folder / "pages-3.img")
    assert fill_plan.locate(folder, 1) == [
        page_fill.Run(0x100000, 40 << 20, path, 0),
        page_fill.Run(0x4000000, 16 * P, path, 40 << 20)]


def test_a_plan_kept_for_the_same_images_serves_the_next_folder(tmp_path):
    """Replicas of one checkpoint hand CRIU the same images: the second folder's
    plan and new images come from the first's (fill_plan_cache.py), each run in
    its own folder's pages file, and restore what a fresh plan restores."""
    cache = tmp_path / "plans"
    first, second, fresh = tmp_path / "r1", tmp_path / "r2", tmp_path / "r3"
    memory = _dense_task(first, random.Random(15))
    for other in (second, fresh):
        assert _dense_task(other, random.Random(15)) == memory
    p1 = fill_plan.prepare(first, lambda p: None, huge_pages=True, cache=cache)
    assert p1 is not None and not p1.kept
    before = _snapshot(second)
    p2 = fill_plan.prepare(second, lambda p: None, huge_pages=True, cache=cache)
    p3 = fill_plan.prepare(fresh, lambda p: None, huge_pages=True)  # no cache: planned afresh
    assert p2 is not None and p2.kept and not p3.kept
    assert {r.path for rs in p2.tasks.values() for r in rs} == {str(second / "pages-1.img")}
    assert [(r.address, r.length, r.offset) for r in p2.tasks[1]] == \
        [(r.address, r.length, r.offset) for r in p3.tasks[1]] and p2.huge == p3.huge
    assert _snapshot(second) == _snapshot(fresh)  # the same new images, byte for byte
    assert _restored(second, 1, p2) == memory
    fill_plan.undo(second)
    assert _snapshot(second) == before


def test_images_that_differ_in_one_byte_are_planned_afresh(tmp_path):
    cache = tmp_path / "plans"
    first, second = tmp_path / "r1", tmp_path / "r2"
    _dense_task(first, random.Random(15))
    memory = _dense_task(second, random.Random(15))
    assert not fill_plan.prepare(first, lambda p: None, cache=cache).kept
    image = second / "mm-1.img"
    data = bytearray(image.read_bytes())
    data[-1] ^= 1  # the last area's madvise bits: a plan of other images
    image.write_bytes(bytes(data))
    p = fill_plan.prepare(second, lambda p: None, cache=cache)
    assert p is not None and not p.kept and _restored(second, 1, p) == memory
    assert len(list(cache.iterdir())) == 2  # each kept under its own images


def test_a_kept_plan_that_cannot_be_read_is_planned_afresh(tmp_path):
    cache = tmp_path / "plans"
    first, second = tmp_path / "r1", tmp_path / "r2"
    _dense_task(first, random.Random(15))
    memory = _dense_task(second, random.Random(15))
    third = tmp_path / "r3"
    _dense_task(third, random.Random(15))
    fill_plan.prepare(first, lambda p: None, cache=cache)
    (kept,) = cache.iterdir()
    image = kept / "pagemap-1.img"
    image.write_bytes(image.read_bytes()[:-8])  # cut short, and still a pagemap that parses
    p = fill_plan.prepare(second, lambda p: None, cache=cache)
    assert p is not None and not p.kept and _restored(second, 1, p) == memory
    (kept / fill_plan_cache.PLAN).write_text("{")
    p = fill_plan.prepare(third, lambda p: None, cache=cache)
    assert p is not None and not p.kept and _restored(third, 1, p) == memory
    # each damaged entry was dropped and the fresh plan kept in its place
    fourth = tmp_path / "r4"
    _dense_task(fourth, random.Random(15))
    p = fill_plan.prepare(fourth, lambda p: None, cache=cache)
    assert p is not None and p.kept and _restored(fourth, 1, p) == memory
    (kept / "pagemap-1.img").unlink()  # a kept image gone: the same
    for n in (5, 6):
        again = tmp_path / f"r{n}"
        _dense_task(again, random.Random(15))
        p = fill_plan.prepare(again, lambda p: None, cache=cache)
        assert p is not None and p.kept is (n == 6) and _restored(again, 1, p) == memory


def test_a_folder_with_a_parent_is_never_kept(tmp_path):
    cache = tmp_path / "plans"
    rnd = random.Random(2)
    vmas = [(C, C + 64 * PAGE, PLAIN)]
    _task(tmp_path / "prepared", 1, 1, vmas, [(C, 64, pm.PE_PRESENT)], rnd)
    folder = tmp_path / "images"
    _task(folder, 1, 3, vmas, [(C, 60, pm.PE_PARENT), (C + 60 * PAGE, 4, pm.PE_PRESENT)], rnd)
    os.symlink("../prepared", folder / "parent")
    assert fill_plan.prepare(folder, lambda p: None, cache=cache) is not None
    assert not cache.exists() or not list(cache.iterdir())


def test_only_the_newest_plans_are_kept(tmp_path, monkeypatch):
    monkeypatch.setattr(fill_plan_cache, "KEEP", 2)
    cache = tmp_path / "plans"
    for seed in range(4):
        folder = tmp_path / f"r{seed}"
        _dense_task(folder, random.Random(seed))
        image = folder / "mm-1.img"
        data = bytearray(image.read_bytes())
        data[-1] ^= seed  # the last area's madvise bits: other images each time
        image.write_bytes(bytes(data))
        assert not fill_plan.prepare(folder, lambda p: None, cache=cache).kept
        time.sleep(0.01)  # mtimes that order them
    assert len(list(cache.iterdir())) == 2
