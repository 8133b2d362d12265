"""pages/dump_ahead.py, criu/pagescan.py, pages/remote_syscall.py: memory read out
of a process ahead of CRIU's dump, and put back into CRIU's images.

compose is checked against what CRIU itself would have written (every present
page in address order in one pages file), from synthetic images; the reads,
the scans and the remote madvise run against real child processes."""

from __future__ import annotations

import ctypes
import errno
import json
import mmap
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpusnap.criu import pagescan

from gpusnap.pages import dump_ahead, same_pages
from gpusnap.criu import pagemap as pm
from gpusnap.pages import remote_syscall
PAGE = pm.PAGE


def _pages(n: int, seed: int) -> bytes:
    return bytes((seed * 131 + i * 7) % 251 for i in range(n * PAGE))


def _images(tmp_path: Path, criu_runs: list[tuple[int, int]], linked: bool):
    """An images folder as CRIU leaves it when the runs were taken out: the task's
    pagemap, its pages file (in ``aside`` behind a link, as the push prelinks it,
    or in the folder), and the memory: {vaddr: page bytes} of everything dumped."""
    images, aside = tmp_path / "images", tmp_path / "aside"
    images.mkdir()
    aside.mkdir()
    memory, data = {}, b""
    for k, (vaddr, n) in enumerate(criu_runs):
        chunk = _pages(n, k + 1)
        data += chunk
        for i in range(n):
            memory[vaddr + i * PAGE] = chunk[i * PAGE:(i + 1) * PAGE]
    (images / "pagemap-1.img").write_bytes(pm.serialize(pm.Pagemap(7, tuple(
        pm.Run(v, n, pm.PE_PRESENT | pm.PE_LAZY) for v, n in criu_runs))))
    if linked:
        (aside / "pages-7.img").write_bytes(data)
        os.symlink(aside / "pages-7.img", images / "pages-7.img")
    else:
        (images / "pages-7.img").write_bytes(data)
    return images, aside, memory


def _task(aside: Path, runs: list[tuple[int, int]], gaps: list[int], memory: dict) -> dump_ahead.Task:
    """The runs read into their file at the offsets ``gaps`` predict."""
    path = aside / ".ahead-1.img"
    placed, pos = [], 0
    with open(path, "wb") as f:
        for k, ((vaddr, n), gap) in enumerate(zip(runs, gaps)):
            pos += gap
            chunk = _pages(n, 100 + k)
            f.seek(pos)
            f.write(chunk)
            placed.append((vaddr, n * PAGE, pos))
            for i in range(n):
                memory[vaddr + i * PAGE] = chunk[i * PAGE:(i + 1) * PAGE]
            pos += n * PAGE
    return dump_ahead.Task(os.getpid(), 1, str(path), placed, gaps)


def _as_criu_writes(memory: dict) -> bytes:
    return b"".join(memory[v] for v in sorted(memory))


def _read_back(images: Path) -> dict:
    m = pm.parse((images / "pagemap-1.img").read_bytes())
    data = (images / m.pages_file).read_bytes()
    out = {}
    for offset, vaddr, n in pm.offsets(m):
        for i in range(n):
            out[vaddr + i * PAGE] = data[offset + i * PAGE:offset + (i + 1) * PAGE]
    assert len(data) == sum(n for _, _, n in pm.offsets(m)) * PAGE
    return out


CRIU = [(0x400000, 1), (0x600000, 3), (0x7f0000000000, 2)]  # below, between and above
RUNS = [(0x500000, 5), (0x700000, 4)]


@pytest.mark.parametrize("linked", [True, False])
def test_compose_in_place_gives_the_images_criu_would_have_written(tmp_path, linked):
    images, aside, memory = _images(tmp_path, CRIU, linked)
    task = _task(aside, RUNS, [1 * PAGE, 3 * PAGE], memory)
    assert dump_ahead.compose(images, aside, task) == "in place"
    assert _read_back(images) == memory
    assert (images / "pages-7.img").is_symlink()  # the push reads it in aside
    assert os.readlink(images / "pages-7.img") == str(aside / "pages-7.img")
    assert (aside / "pages-7.img").read_bytes() == _as_criu_writes(memory)
    assert not Path(task.path).exists()


def test_compose_over_round_ones_file_compares_crius_pieces_and_tells_the_push_all(
        tmp_path, monkeypatch):
    """The read wrote over round 1's file, which held round 1's bytes up to
    ``compared``: CRIU's pieces there are compared with what the file holds,
    and the note then says the whole file is final, with the ranges found the
    same: the read's, and CRIU's pieces that round 1 had too. A piece past
    ``compared`` is only written, whatever the file holds there (the read cut
    round 1's bytes off or grew the file with zeros): here the last one."""
    monkeypatch.setattr(same_pages, "COMPARE", PAGE)
    images, aside, memory = _images(tmp_path, CRIU, True)
    task = _task(aside, RUNS, [1 * PAGE, 3 * PAGE], memory)
    with open(task.path, "r+b") as f:  # round 1's bytes, where CRIU's pieces go now
        f.write(_pages(1, 1))
        f.seek(13 * PAGE)
        f.write(_pages(2, 3))  # equal too, but past what the read left of round 1
    task.compared = 13 * PAGE
    Path(task.path + ".ready").write_text(json.dumps(
        {"size": 13 * PAGE, "final": [[PAGE, 6 * PAGE], [9 * PAGE, 13 * PAGE]],
         "same": [[PAGE, 6 * PAGE]]}))
    assert dump_ahead.compose(images, aside, task) == "in place"
    assert _read_back(images) == memory
    note = json.loads(Path(task.path + ".ready").read_text())
    assert note == {"size": 15 * PAGE, "final": [[0, 15 * PAGE]], "same": [[0, 6 * PAGE, 0]]}


def test_compose_builds_the_file_anew_where_criu_dumped_other_pages_than_predicted(tmp_path):
    images, aside, memory = _images(tmp_path, CRIU, True)
    task = _task(aside, RUNS, [2 * PAGE, 3 * PAGE], memory)  # one page too many below
    how = dump_ahead.compose(images, aside, task)
    assert how.startswith("copied") and "[4096, 12288]" in how, how
    assert _read_back(images) == memory


def test_compose_refuses_a_page_criu_found_inside_a_run(tmp_path):
    images, aside, memory = _images(tmp_path, CRIU + [(0x501000, 1)], True)
    task = _task(aside, RUNS, [1 * PAGE, 3 * PAGE], memory)
    before = (images / "pagemap-1.img").read_bytes()
    with pytest.raises(dump_ahead.AheadError, match="touched memory"):
        dump_ahead.compose(images, aside, task)
    assert (images / "pagemap-1.img").read_bytes() == before  # nothing half done


def test_minus_cuts_holes_out_of_ranges():
    assert pagescan.minus([(0, 100)], [(10, 20), (50, 60)]) == [(0, 10), (20, 50), (60, 100)]
    assert pagescan.minus([(0, 10), (30, 40)], [(5, 35)]) == [(0, 5), (35, 40)]
    assert pagescan.minus([(0, 10)], [(0, 10)]) == []
    # holes that overlap each other: the wider one starts first
    assert pagescan.minus([(330, 371)], [(295, 364), (320, 341)]) == [(364, 371)]


def test_minus_agrees_with_cutting_hole_by_hole():
    import random

    rng = random.Random(7)
    for _ in range(3000):
        ranges = [(a, a + rng.randint(1, 50)) for a in rng.sample(range(0, 1000, 3), rng.randint(0, 8))]
        holes = [(a, a + rng.randint(1, 80)) for a in rng.sample(range(0, 1000, 5), rng.randint(0, 8))]
        want = []
        for start, end in ranges:
            pieces = [(start, end)]
            for h0, h1 in holes:
                pieces = [p for a, b in pieces for p in ((a, min(b, h0)), (max(a, h1), b))
                          if p[0] < p[1]]
            want += pieces
        assert pagescan.minus(ranges, holes) == sorted(want)


# -- real processes ---------------------------------------------------------------------

CHILD = r"""
import ctypes, mmap, os, sys, threading, time
for _ in range(int(sys.argv[3])):  # threads asleep in a wait, as a CUDA process has
    threading.Thread(target=threading.Event().wait, daemon=True).start()
n = int(sys.argv[1]) * 4096
m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
for i in range(0, n, 4096):
    m[i:i + 8] = (i // 4096).to_bytes(8, "little")
addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
print(addr, flush=True)
r = int(sys.argv[2])
while True:
    got = os.read(r, 64)  # blocks while the test works on this process
    if not got or got == b"q":
        break
    if got == b"sum":
        print(sum(m[i] for i in range(0, n, 4096)), [m[i] for i in range(0, n, 4096)][:3], flush=True)
    if got == b"sleep":
        t = time.monotonic(); time.sleep(0.3); print(round(time.monotonic() - t, 1), flush=True)
"""


class Child:
    def __init__(self, pages: int = 64, helpers: int = 0) -> None:
        self.r, self.w = os.pipe()
        self.proc = subprocess.Popen([sys.executable, "-c", CHILD, str(pages), str(self.r),
                                      str(helpers)],
                                     stdout=subprocess.PIPE, text=True, pass_fds=(self.r,))
        self.addr, self.pages = int(self.proc.stdout.readline()), pages
        time.sleep(0.1)  # in its read(2) by now

    def ask(self, what: bytes) -> str:
        os.write(self.w, what)
        return self.proc.stdout.readline().strip()

    def present(self, page: int) -> bool:
        with open(f"/proc/{self.proc.pid}/pagemap", "rb") as f:
            f.seek((self.addr // PAGE + page) * 8)
            return bool(int.from_bytes(f.read(8), "little") >> 63)

    def close(self) -> None:
        os.write(self.w, b"q")
        self.proc.wait(5)
        os.close(self.r)
        os.close(self.w)


@pytest.fixture
def child():
    c = Child()
    yield c
    if c.proc.poll() is None:
        c.close()


def _slept_whole(child) -> bool:
    """Its 0.3 s sleep was not cut short (a remote call's EINTR); a loaded host
    may make it longer."""
    return 0.3 <= float(child.ask(b"sleep")) < 5


needs_ptrace = pytest.mark.skipif(not remote_syscall.supported(), reason="x86-64 only")


@needs_ptrace
def test_a_remote_madvise_drops_pages_and_the_blocked_call_goes_on(child):
    assert child.present(10)
    remote_syscall.madvise_dontneed(child.proc.pid, [(child.addr + 8 * PAGE, 16 * PAGE)])
    assert not child.present(10) and child.present(7) and child.present(24)
    # the read(2) it was blocked in was made again, not failed with EINTR: it answers
    assert child.ask(b"sum").split()[0] == str(sum(range(64)) - sum(range(8, 24)))
    assert _slept_whole(child)


@needs_ptrace
def test_a_refused_remote_call_says_why_and_leaves_the_process_running(child):
    with pytest.raises(remote_syscall.RemoteSyscallError) as err:
        remote_syscall.madvise_dontneed(child.proc.pid, [(child.addr + 1, PAGE)])  # unaligned
    assert err.value.errno == errno.EINVAL
    assert child.present(0) and _slept_whole(child)


@needs_ptrace
def test_a_thread_that_does_not_stop_is_given_up_at_the_bound_and_runs_on(child, monkeypatch):
    """A thread in an uninterruptible wait (a vfork parent, a driver call) does not
    stop for PTRACE_INTERRUPT: the pre-dump gives up within PTRACE, and the
    thread runs on once the tracer (the action script) has exited."""
    monkeypatch.setenv("GPUSNAP_WAIT_PTRACE", "0.3")
    r, w = os.pipe()
    tracer = os.fork()
    if tracer == 0:
        os.close(r)
        real, traced = os.waitpid, child.proc.pid
        # its stop never comes (ctypes.util's own children are waited for as ever)
        remote_syscall.os.waitpid = lambda pid, flags: (0, 0) if pid == traced else real(pid, flags)
        try:
            remote_syscall.madvise_dontneed(child.proc.pid, [(child.addr + 8 * PAGE, PAGE)])
            os.write(w, b"no error")
        except remote_syscall.RemoteSyscallError as exc:
            os.write(w, f"{exc.errno} {exc}".encode())
        os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        said = f.read()
    os.waitpid(tracer, 0)
    assert said.startswith(f"{errno.ETIMEDOUT} ") and "did not stop within" in said, said
    assert child.present(8)  # nothing was dropped
    assert _slept_whole(child)  # and it answers: detached by the tracer's exit


def test_pagescan_finds_what_criu_dumps_and_holds_still_across_vector_sizes(monkeypatch):
    m = mmap.mmap(-1, 64 * PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
    for page in (0, 1, 2, 10, 11, 40):
        m[page * PAGE] = 1
    _ = m[20 * PAGE]  # read only: the zero page, which CRIU does not dump
    area = [(addr, addr + 64 * PAGE)]
    want = [(addr, addr + 3 * PAGE), (addr + 10 * PAGE, addr + 12 * PAGE),
            (addr + 40 * PAGE, addr + 41 * PAGE)]
    assert pagescan.dumped(os.getpid(), area) == want
    monkeypatch.setattr(pagescan, "REGIONS", 1)  # a full vector every call: resumed right
    assert pagescan.dumped(os.getpid(), area) == want
    # clipped to what was asked, even where a region began before it
    assert pagescan.dumped(os.getpid(), [(addr + PAGE, addr + 11 * PAGE)]) == \
        [(addr + PAGE, addr + 3 * PAGE), (addr + 10 * PAGE, addr + 11 * PAGE)]


def test_take_reads_runs_to_their_offsets_and_the_guardian_writes_them_back(child, tmp_path,
                                                                           monkeypatch):
    monkeypatch.setattr(dump_ahead, "MIN_TOTAL", 0)
    pid, a = child.proc.pid, child.addr
    runs = [(a + 4 * PAGE, a + 20 * PAGE), (a + 30 * PAGE, a + 34 * PAGE)]
    gaps, offsets = dump_ahead.layout(pid, runs)
    # CRIU's pages between the two runs: the 10 touched pages of the mapping there
    assert gaps[1] == 10 * PAGE and offsets[1] == offsets[0] + gaps[1] + 16 * PAGE
    task = dump_ahead.take(pid, 1, runs, tmp_path, threads=3)
    data = Path(task.path).read_bytes()
    for (address, length, offset), (start, end) in zip(task.runs, runs):
        for k in range(length // PAGE):
            page = (address - a) // PAGE + k
            assert data[offset + k * PAGE:offset + k * PAGE + 8] == page.to_bytes(8, "little")
    if not remote_syscall.supported():
        return
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    with ours, theirs:
        dump_ahead.hand_over(ours, [task])
        dump_ahead.drop(task)
        assert not child.present(5) and not child.present(31)
        Path(task.path).unlink()  # the push's folder gone: the guardian's descriptor holds it
        (got, fd), = dump_ahead.received(theirs)
        try:
            dump_ahead.write_back(got, fd, threads=2)
        finally:
            os.close(fd)
    assert child.ask(b"sum").split()[0] == str(sum(range(64)))


def test_progress_tells_only_the_pieces_read_without_a_gap_before_them():
    """Pieces finish out of order on the threads: what the push is told is
    final is the prefix read so far, merged into ranges, every ``every`` bytes
    and at the end."""
    pieces = [dump_ahead.Run(0, 4, "f", 0), dump_ahead.Run(4, 4, "f", 4),
              dump_ahead.Run(100, 4, "f", 20), dump_ahead.Run(104, 4, "f", 24)]
    told: list[list[list[int]]] = []
    same: list[list[list[int]]] = []
    prefix = dump_ahead._Prefix(pieces, lambda f, s: (told.append(f), same.append(s)), every=4)
    prefix.finished(1, True)
    assert told == []  # piece 0 not read: nothing is final yet
    prefix.finished(0)
    assert told == [[[0, 8]]] and same == [[[4, 8, 0]]]
    prefix.finished(3, True, -4096)
    assert told == [[[0, 8]]]
    prefix.finished(2, True, -4096)
    assert told[-1] == [[0, 8], [20, 28]]  # two runs of the file, a gap (CRIU's pages) between
    # of those, the pieces found as round 1 left them, and where: the second run moved
    assert same[-1] == [[4, 8, 0], [20, 28, -4096]]


def test_take_with_notes_leaves_a_note_of_every_run_read(child, tmp_path, monkeypatch):
    monkeypatch.setattr(dump_ahead, "MIN_TOTAL", 0)
    monkeypatch.setattr(dump_ahead, "READ_PIECE", PAGE)
    monkeypatch.setattr(dump_ahead, "NOTE_EVERY", 2 * PAGE)
    pid, a = child.proc.pid, child.addr
    runs = [(a + 4 * PAGE, a + 20 * PAGE), (a + 30 * PAGE, a + 34 * PAGE)]
    task = dump_ahead.take(pid, 1, runs, tmp_path, threads=3, notes=True)
    note = json.loads(Path(task.path + ".ready").read_text())
    assert note == {"size": Path(task.path).stat().st_size,
                    "final": [[o, o + n] for _, n, o in task.runs], "same": []}


def _round_one(child, tmp_path: Path, monkeypatch):
    """Small pieces, blocks and probes; round 1's file of the child's pages 4-11,
    as a push would have kept it: (pid, runs, its task, the run's offset)."""
    monkeypatch.setattr(dump_ahead, "MIN_TOTAL", 0)
    monkeypatch.setattr(dump_ahead, "READ_PIECE", 2 * PAGE)
    monkeypatch.setattr(same_pages, "COMPARE", PAGE)
    monkeypatch.setattr(same_pages, "PROBE", PAGE)
    runs = [(child.addr + 4 * PAGE, child.addr + 12 * PAGE)]
    first = dump_ahead.take(child.proc.pid, 1, runs, tmp_path)
    return child.proc.pid, runs, first, first.runs[0][2]


def test_a_kept_file_with_round_ones_index_is_compared_and_its_equal_pieces_noted(
        child, tmp_path, monkeypatch):
    """Round 1's kept file holds the runs' bytes except one page: the read
    compares piece by piece, notes the others as unchanged, writes the one
    that differs; the index follows the file to its new name."""
    pid, runs, first, offset = _round_one(child, tmp_path, monkeypatch)
    donor = tmp_path / "000.img"
    os.rename(first.path, donor)
    data = bytearray(donor.read_bytes())
    data[offset + 5 * PAGE] ^= 1  # one page of round 1 differs from the process now
    donor.write_bytes(bytes(data))
    same_pages.index_path(donor).write_text("{}")
    task = dump_ahead.take(pid, 2, runs, tmp_path, threads=2, notes=True, donors=[str(donor)])
    assert task.unchanged == 6 * PAGE and task.reused == Path(task.path).stat().st_size
    assert same_pages.index_path(task.path).exists() and not same_pages.index_path(donor).exists()
    note = json.loads(Path(task.path + ".ready").read_text())
    assert note["same"] == [[offset, offset + 4 * PAGE, 0], [offset + 6 * PAGE, offset + 8 * PAGE, 0]]
    assert task.shifts == [0] and task.compared == task.reused
    got = Path(task.path).read_bytes()
    for k in range(8):
        page = 4 + k
        assert got[offset + k * PAGE:offset + (k + 1) * PAGE] == \
            page.to_bytes(8, "little") + bytes(PAGE - 8)


def test_a_kept_file_whose_layout_moved_is_compared_where_its_bytes_lie_then_written(
        child, tmp_path, monkeypatch):
    """Round 1's kept file holds the run's bytes three pages further on (a
    process's memory below it was three pages larger then): the read finds the
    shift, compares there first and writes after; every piece is found
    unchanged, noted with its shift, and the file holds the process's bytes
    at this round's offsets; compose may compare nothing (compared 0)."""
    pid, runs, first, offset = _round_one(child, tmp_path, monkeypatch)
    donor = tmp_path / "000.img"
    donor.write_bytes(b"\x5a" * (3 * PAGE) + Path(first.path).read_bytes() + b"\x5a" * PAGE)
    same_pages.index_path(donor).write_text("{}")
    task = dump_ahead.take(pid, 2, runs, tmp_path, threads=2, notes=True, donors=[str(donor)])
    assert task.shifts == [-3 * PAGE] and task.compared == 0
    assert task.unchanged == 8 * PAGE, task
    note = json.loads(Path(task.path + ".ready").read_text())
    assert note["same"] == [[offset, offset + 8 * PAGE, -3 * PAGE]]
    got = Path(task.path).read_bytes()
    assert len(got) == offset + 8 * PAGE
    for k in range(8):
        assert got[offset + k * PAGE:offset + (k + 1) * PAGE] == \
            (4 + k).to_bytes(8, "little") + bytes(PAGE - 8)


def test_take_writes_over_a_kept_file_and_leaves_none_of_its_bytes_in_the_runs(child, tmp_path,
                                                                              monkeypatch):
    """A kept round-1 file (pages/kept_pages.py), larger than this round's and
    full of other bytes, is renamed to the read's file: the runs hold the
    process's bytes, the file is cut to this round's size, the memory reused
    is counted, and the kept name is gone."""
    monkeypatch.setattr(dump_ahead, "MIN_TOTAL", 0)
    pid, a = child.proc.pid, child.addr
    runs = [(a + 4 * PAGE, a + 20 * PAGE), (a + 30 * PAGE, a + 34 * PAGE)]
    donor = tmp_path / "kept.img"
    donor.write_bytes(b"\xaa" * (1024 * PAGE))
    donors = [str(donor)]
    task = dump_ahead.take(pid, 1, runs, tmp_path, threads=3, donors=donors)
    assert donors == [] and not donor.exists()
    data = Path(task.path).read_bytes()
    assert len(data) == task.runs[-1][2] + task.runs[-1][1]
    assert task.reused == len(data)
    for address, length, offset in task.runs:
        for k in range(length // PAGE):
            page = (address - a) // PAGE + k
            assert data[offset + k * PAGE:offset + (k + 1) * PAGE] == \
                page.to_bytes(8, "little") + bytes(PAGE - 8)


def test_a_kept_file_linked_elsewhere_is_not_written_over(child, tmp_path, monkeypatch):
    """Its other name would change with it: the read takes a new file."""
    monkeypatch.setattr(dump_ahead, "MIN_TOTAL", 0)
    donor, other = tmp_path / "kept.img", tmp_path / "other.img"
    donor.write_bytes(b"\xaa" * (8 * PAGE))
    os.link(donor, other)
    pid, a = child.proc.pid, child.addr
    task = dump_ahead.take(pid, 1, [(a, a + 4 * PAGE)], tmp_path, threads=1, donors=[str(donor)])
    assert task.reused == 0
    assert other.read_bytes() == b"\xaa" * (8 * PAGE)
    assert Path(task.path).read_bytes()[:8] == (0).to_bytes(8, "little")


def test_a_missing_kept_file_leaves_the_read_a_new_one(child, tmp_path, monkeypatch):
    """Given up to memory pressure between the plan and the read (evicted)."""
    monkeypatch.setattr(dump_ahead, "MIN_TOTAL", 0)
    pid, a = child.proc.pid, child.addr
    task = dump_ahead.take(pid, 1, [(a, a + 4 * PAGE)], tmp_path, threads=1,
                           donors=[str(tmp_path / "gone.img")])
    assert task.reused == 0 and Path(task.path).stat().st_size == task.runs[0][2] + 4 * PAGE
    assert dump_ahead.Task.from_dict(task.to_dict()) == task


def test_split_shares_the_bytes_and_cuts_only_at_aligned_addresses():
    mb = 1 << 20
    ranges = [(64 * mb, 10 * mb), (100 * mb, 30 * mb), (200 * mb, 2 * mb)]
    for parts in (1, 2, 3, 4, 8, 40):
        shares = remote_syscall.split(ranges, parts)
        assert 1 <= len(shares) <= parts
        flat = [r for share in shares for r in share]
        merged: list[tuple[int, int]] = []
        for a, n in flat:  # the pieces, in order, put back together, are the ranges
            if merged and merged[-1][0] + merged[-1][1] == a:
                merged[-1] = (merged[-1][0], merged[-1][1] + n)
            else:
                merged.append((a, n))
        assert merged == ranges
        starts = {a for a, _ in ranges}
        assert all(a in starts or a % (2 * mb) == 0 for a, _ in flat)
    sizes = [sum(n for _, n in s) for s in remote_syscall.split(ranges, 4)]
    assert len(sizes) == 4 and max(sizes) <= 42 * mb // 4 + 2 * mb, sizes  # a cut is 2 MiB-aligned


@needs_ptrace
def test_a_drop_on_several_threads_frees_every_range(tmp_path):
    """The child runs helper threads asleep in a wait: each takes a share."""
    c = Child(pages=512, helpers=3)
    try:
        assert len(remote_syscall._helper_threads(c.proc.pid, 7, c.proc.pid)) == 3
        remote_syscall.madvise_dontneed(c.proc.pid, [(c.addr, 256 * PAGE), (c.addr + 300 * PAGE,
                                                                           200 * PAGE)], threads=4)
        assert not any(c.present(p) for p in (0, 100, 255, 300, 499))
        assert c.present(260) and c.present(510)
        assert _slept_whole(c)  # it runs on
    finally:
        c.close()
