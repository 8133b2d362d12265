"""The driver's copy of a CUDA process's GPU memory, read out on many threads before CRIU dumps it.

After the driver's checkpoint a CUDA process holds its whole GPU memory in host
memory: one new anonymous mapping as large as what it used on the GPU. CRIU
then copies it out page by page on one thread, through its parasite, into the
pages file: at tens of GiB, a large part of a migration's stop, even into
gpusnap's huge-page tmpfs (docs/benchmarks.md). For a push that stops
the container and whose pages go to RAM, pre-dump instead, right after the
driver's checkpoint:

1. finds the memory the checkpoint mapped (``staging``: private anonymous
   ranges the process did not have before it);
2. predicts where those runs will lie in the task's pages file (``layout``:
   CRIU writes pages in address order, so a run's offset is what CRIU dumps
   below it, which pagescan.py asks the kernel the way CRIU does);
3. reads them on many threads (process_vm_readv) straight to those offsets of
   a file in the push's RAM folder (several times CRIU's one-thread rate:
   docs/benchmarks.md);
4. hands that file and the runs to the guardian, which writes them back into
   any process that lives on (--leave-running, a failed dump) before the
   driver restores it;
5. drops them from the process (madvise MADV_DONTNEED inside it, through
   ptrace: remote_syscall.py). CRIU finds nothing there.

post-dump (``compose``, the tree still frozen): CRIU's own pages, a few hundred
MB, are written around the runs, the runs go back into the task's pagemap,
and the file takes the place of CRIU's pages file. The images are then what
CRIU would have written itself, byte for byte. Where CRIU dumped other pages
below a run than predicted (the process changed its memory in between), the
file is built anew by copying: slower, the same result.

Only memory nothing but the driver touches is taken: the process is locked
(its CUDA calls wait) from before the checkpoint until the guardian or the
target restores it. A page of a run that CRIU nevertheless found present fails
the dump (the container runs on, its memory written back).
"""

from __future__ import annotations

import ctypes
import json
import os
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from gpusnap.criu import pagemap, pagescan
from gpusnap.pages import kept_pages, same_pages
from gpusnap.pages.page_fill import (PROT_READ, PROT_WRITE, Run, default_threads, fill,
                                    libc, map_shared, pieces, vm_reader)

MIN_RUN = 1 << 20  # smaller new mappings stay with CRIU (the driver's own bookkeeping)
MIN_TOTAL = 256 << 20  # below this CRIU is about as quick as starting the threads
PAGE = 4096
PREFIX = ".ahead-"  # the runs' file in the push's folder, until it becomes a pages file
READ_PIECE = 8 << 20  # mapped by one thread at a time: 16 threads hold at most 128 MiB
COMPOSE_PIECE = 64 << 20  # one copy_file_range job of the compose: nothing mapped
# Threads of the process that free its copy at once: one frees 36 GB of 4 KiB
# pages in ~1.9 s (docs/benchmarks.md), all of it in the stop.
DROP_THREADS = 8
NOTE_EVERY = 1 << 30  # the push is told what is read every GiB: it hashes while the read goes on


class AheadError(Exception):
    """The dump must fail: the images cannot be made whole, or memory taken out
    of a process could not be put back (the message says which)."""


@dataclass
class Task:
    """The runs read out of one process, and where they lie in ``path``."""

    pid: int  # on the host
    vpid: int  # in the container: CRIU's image names
    path: str
    runs: list[tuple[int, int, int]]  # (address, length, offset in path)
    gaps: list[int]  # bytes CRIU is predicted to dump before each run, after the previous one
    reused: int = 0  # bytes of a kept round-1 file the read wrote over (kept_pages.py)
    layout_s: float = 0.0  # of the read-ahead's time: predicting the layout (the rest: the read)
    unchanged: int = 0  # of ``reused``, bytes found as round 1 left them (same_pages.py)
    # the file's first bytes that held round 1's until the read: only there may
    # compose compare (past it, the read's cut or growth left zeros)
    compared: int = 0
    shifts: list[int | None] = field(default_factory=list)  # each run's against round 1's file

    @property
    def bytes(self) -> int:
        return sum(length for _, length, _ in self.runs)

    def fill_runs(self, path: str | None = None) -> list[Run]:
        return [Run(a, n, path or self.path, o) for a, n, o in self.runs]

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Task:
        return cls(int(d["pid"]), int(d["vpid"]), str(d["path"]),
                   [tuple(map(int, r)) for r in d["runs"]], [int(g) for g in d["gaps"]],
                   int(d.get("reused", 0)), float(d.get("layout_s", 0.0)),
                   int(d.get("unchanged", 0)), int(d.get("compared", 0)),
                   list(d.get("shifts", [])))


def mapped(pid: int) -> list[tuple[int, int]]:
    """Every range the process maps now (taken before the driver's checkpoint)."""
    return [(v.start, v.end) for v in pagescan.vmas(pid)]


def staging(pid: int, before: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The private anonymous writable ranges the process did not map ``before``:
    where the driver's checkpoint put its copy of the GPU memory."""
    now = [(v.start, v.end) for v in pagescan.vmas(pid)
           if v.private and v.anonymous and v.perms.startswith("rw") and not v.name.startswith("[")]
    return [r for r in pagescan.minus(now, sorted(before)) if r[1] - r[0] >= MIN_RUN]


def big_anonymous(pid: int, min_bytes: int) -> list[tuple[int, int]]:
    """Tests only (a CPU container whose big memory holds still): the private
    anonymous writable areas of at least ``min_bytes`` stand in for the staging."""
    return [(v.start, v.end) for v in pagescan.vmas(pid)
            if v.private and v.anonymous and v.perms.startswith("rw") and v.end - v.start >= min_bytes]


def layout(pid: int, runs: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
    """(gaps, offsets): the bytes CRIU will dump before each run (after the one
    before it) and so each run's offset in the task's pages file."""
    found = pagescan.vmas(pid)
    areas = pagescan.minus(pagescan.dumped_areas(found), runs)
    whole = pagescan.whole(found)
    dumped = sorted(pagescan.dumped(pid, pagescan.minus(areas, whole)) + pagescan.minus(whole, runs))
    gaps, offsets, pos, i = [], [], 0, 0
    for start, end in runs:
        gap = 0
        while i < len(dumped) and dumped[i][1] <= start:
            gap += dumped[i][1] - dumped[i][0]
            i += 1
        gaps.append(gap)
        pos += gap
        offsets.append(pos)
        pos += end - start
    return gaps, offsets


class _Prefix:
    """The file ranges of the pieces read so far without a gap before them
    (pieces finish out of order): what ``progress`` may be told is final, and
    of those the ranges found as round 1 left them, each with its shift
    (same_pages.py)."""

    def __init__(self, pieces: list[Run],
                 progress: Callable[[list[list[int]], list[list[int]]], None],
                 every: int = NOTE_EVERY) -> None:
        self.pieces, self.progress, self.every = pieces, progress, every
        self.done = [False] * len(pieces)
        self.same: list[int | None] = [None] * len(pieces)  # the shift of a piece found the same
        self.next = self.told = 0
        self.lock = threading.Lock()

    def finished(self, i: int, same: bool = False, shift: int = 0) -> None:
        with self.lock:
            self.done[i], self.same[i] = True, shift if same else None
            while self.next < len(self.done) and self.done[self.next]:
                self.next += 1
            read = sum(p.length for p in self.pieces[self.told:self.next])
            if self.next < len(self.done) and read < self.every:
                return
            self.told = self.next
            final = [(p.offset, p.offset + p.length) for p in self.pieces[:self.next]]
            self.progress(same_pages.merge(final), same_pages.merge_moved(
                [(a, b, s) for (a, b), s in zip(final, self.same) if s is not None]))


def _shifts(vm_read, fd: int, had: int, runs: list[tuple[int, int, int]]) -> list[int]:
    """Each run's shift against the kept file (same_pages.find_shift); the
    shifts found for runs before are tried first for the next. Where none is
    found (the probes fell on memory that changed), 0: compared in place, as
    where the layout held."""
    found: list[int] = []
    for address, length, offset in runs:
        tried = tuple(dict.fromkeys([0, *found]))
        shift = same_pages.find_shift(vm_read, fd, had, address, length, offset, tried)
        found.append(0 if shift is None else shift)
    return found


def read(pid: int, runs: list[tuple[int, int, int]], path: str, size: int, threads: int,
         progress: Callable[[list[list[int]], list[list[int]]], None] | None = None,
         donor: str | None = None, compare: bool = False
         ) -> tuple[int, int, int, list[int | None]]:
    """Each run (address, length, offset) of ``pid`` into ``path`` at its offset.
    Each thread maps one piece of the file at a time and has the kernel copy
    the process's bytes into it (one copy); unmapped after, so the pages stay
    in the file, not in this process (its RSS stays at the pieces in flight).
    ``progress(final, same)``: the file ranges read so far, and of those the
    ones found unchanged ([start, end, shift]), every NOTE_EVERY bytes and at
    the end (the push hashes them meanwhile: _note). ``donor``: a file whose
    memory the read writes over (kept_pages.open_over); with ``compare``, each
    run's bytes are compared with the donor's where they lie there
    (same_pages.find_shift): in place, only what differs is written; moved,
    everything is compared first and written after: a second read of memory
    that must hold still in between, as the whole read-ahead needs (the
    process is locked; nothing but the driver wrote it). Returns the bytes of
    memory reused, the bytes found unchanged, how far from the start the file
    still holds the donor's bytes where compose may compare (0: nowhere), and
    each run's shift (None: not compared: no donor)."""
    fd, held = kept_pages.open_over(path, donor)
    try:
        had = os.fstat(fd).st_size if compare else 0  # the donor's bytes: what can be compared
        calls = libc()
        vm_read = vm_reader(calls, pid)
        shifts = _shifts(vm_read, fd, had, runs) if had else [None] * len(runs)
        moved = any(shift not in (None, 0) for shift in shifts)
        todo, shift_of = [], []
        for (a, n, o), shift in zip(runs, shifts):
            for piece in pieces([Run(a, n, path, o)], READ_PIECE):
                todo.append(piece)
                shift_of.append(shift)
        if not moved:
            os.ftruncate(fd, size)
        local = threading.local()

        def compared(i: int, write: bool) -> bool | None:
            """Piece ``i`` compared with the donor's bytes (None: they are not there)."""
            piece, shift = todo[i], shift_of[i]
            old = piece.offset - (shift or 0)
            if shift is None or old < 0 or old + piece.length > min(had, size if write else had):
                return None
            if not hasattr(local, "scratch"):
                local.scratch = ctypes.create_string_buffer(same_pages.COMPARE)
            base = map_shared(calls, fd, path, piece.length, old,
                              PROT_READ | (PROT_WRITE if write else 0))
            try:
                return same_pages.read_compared(vm_read, calls.memcmp, piece.address, base,
                                                piece.length, local.scratch, write)
            finally:
                calls.munmap(base, piece.length)

        with ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="dump-ahead") as pool:
            same = [bool(x) for x in pool.map(lambda i: compared(i, False), range(len(todo)))] \
                if moved else [False] * len(todo)
            if moved:
                os.ftruncate(fd, size)
            prefix = _Prefix(todo, progress) if progress is not None else None

            def one(i: int) -> int:
                piece = todo[i]
                got = None if moved else compared(i, True)  # in place: only what differs written
                same[i] = same[i] or bool(got)
                if got is None:
                    base = map_shared(calls, fd, path, piece.length, piece.offset,
                                      PROT_READ | PROT_WRITE)
                    try:
                        vm_read(base, piece.address, piece.length)
                    finally:
                        calls.munmap(base, piece.length)
                if prefix is not None:
                    prefix.finished(i, same[i], shift_of[i] or 0)
                return piece.length if same[i] else 0

            unchanged = sum(pool.map(one, range(len(todo))))
    finally:
        os.close(fd)
    return min(held, size), unchanged, 0 if moved else min(had, size), shifts


def take(pid: int, vpid: int, runs: list[tuple[int, int]], folder: Path,
         threads: int | None = None, notes: bool = False,
         donors: list[str] | None = None) -> Task | None:
    """Read ``runs`` of ``pid`` into a file in ``folder`` at the offsets CRIU's
    pages file will have them; None where there is too little to gain.
    ``notes``: a note for the push (early_pages.py) of the ranges read,
    kept up to date while they are read. ``donors``: kept files, one of
    which (taken off the list: kept_pages.pick) the read writes over."""
    runs = sorted(runs)
    if sum(end - start for start, end in runs) < MIN_TOTAL:
        return None
    started = time.monotonic()
    gaps, offsets = layout(pid, runs)
    layout_s = round(time.monotonic() - started, 3)
    placed = [(start, end - start, off) for (start, end), off in zip(runs, offsets)]
    path = str(folder / f"{PREFIX}{vpid}.img")
    size = offsets[-1] + runs[-1][1] - runs[-1][0]
    donor = kept_pages.pick(donors, size) if donors else None
    try:
        reused, unchanged, compared, shifts = read(
            pid, placed, path, size, threads or default_threads(),
            progress=(lambda final, same: _note(path, size, final, same)) if notes else None,
            donor=donor, compare=donor is not None and same_pages.index_path(donor).exists())
    except BaseException:
        Path(path).unlink(missing_ok=True)
        same_pages.index_path(path).unlink(missing_ok=True)
        raise
    return Task(pid, vpid, path, placed, gaps, reused, layout_s, unchanged, compared, shifts)


def _note(path: str, size: int, final: list[list[int]], same: list[list[int]]) -> None:
    """Tell the push (early_pages.py) which ranges of ``path`` are read: the
    segments wholly in them may be hashed now, and those wholly in ``same``
    are round 1's (same_pages.py). The note holds its size and those ranges,
    replaced whole each time. The bytes read are final (the
    process is locked, nothing but the driver ever wrote them), even before
    the drop: where the drop fails, the file goes and the push's inode check
    drops what was hashed of it."""
    try:
        ready = Path(path + ".ready")
        tmp = ready.with_name(f".{ready.name}.tmp")
        tmp.write_text(json.dumps({"size": size, "final": final, "same": same}))
        os.replace(tmp, ready)
    except OSError:
        pass  # only lets the push start early


def _note_whole(path: str, size: int, same: list[tuple[int, int]]) -> None:
    """Composed in place: the push may take every segment of ``path`` now, and
    those in the ranges the read and compose found unchanged are round 1's."""
    try:
        told = json.loads(Path(path + ".ready").read_text())
    except (OSError, ValueError):
        return  # no push reads this file as it is written
    earlier = [(int(r[0]), int(r[1]), int(r[2]) if len(r) > 2 else 0)
               for r in told.get("same", [])]
    _note(path, size, [[0, size]],
          same_pages.merge_moved(earlier + [(a, b, 0) for a, b in same]))


def drop(task: Task) -> None:
    """Take the runs out of the process (they are in ``task.path``).
    RemoteSyscallError where it refused: what was dropped is back by then.
    AheadError where it could not be put back."""
    # start-up: post-dump and the guardian load this module, only pre-dump drops memory
    from gpusnap.pages.remote_syscall import RemoteSyscallError, madvise_dontneed

    try:
        madvise_dontneed(task.pid, [(a, n) for a, n, _ in task.runs], threads=DROP_THREADS)
    except RemoteSyscallError:
        try:
            fill(task.pid, task.fill_runs(), default_threads())
        except OSError as exc:
            raise AheadError(f"process {task.pid}: its memory could not be put back after "
                             f"a failed madvise ({exc})") from None
        raise


# -- the guardian's part: the file and the runs, handed over with the file itself

def hand_over(sock: socket.socket, tasks: list[Task]) -> None:
    """Send the guardian the tasks and an open descriptor of each file: it
    writes the runs back from those, whatever becomes of the names."""
    fds = [os.open(t.path, os.O_RDONLY) for t in tasks]
    try:
        socket.send_fds(sock, [json.dumps([t.to_dict() for t in tasks]).encode()], fds)
    finally:
        for fd in fds:
            os.close(fd)


def received(sock: socket.socket) -> list[tuple[Task, int]]:
    """What pre-dump handed over (nothing, where it took nothing): (task, fd)."""
    sock.setblocking(False)
    try:
        data, fds, _, _ = socket.recv_fds(sock, 1 << 20, 64)
    except (BlockingIOError, OSError):
        return []
    if not data:
        return []
    return list(zip((Task.from_dict(d) for d in json.loads(data)), fds))


def write_back(task: Task, fd: int, threads: int | None = None) -> None:
    """The runs back into a process that lives on, from the file handed over."""
    fill(task.pid, task.fill_runs(f"/proc/self/fd/{fd}"), threads or default_threads())


# -- post-dump: the images made whole

def compose(images: Path, aside: Path, task: Task) -> str:
    """Put the runs back into the task's pagemap and make ``task.path`` its
    pages file (in ``aside``, where the push reads it; a link in ``images``).
    "in place" where CRIU dumped the predicted pages around the runs, "copied"
    where the file had to be built anew. AheadError where the images cannot be
    made whole."""
    pm_path = images / f"pagemap-{task.vpid}.img"
    try:
        pm = pagemap.parse(pm_path.read_bytes())
    except (OSError, ValueError) as exc:
        raise AheadError(f"cannot read CRIU's pagemap of task {task.vpid}: {exc}") from None
    own = images / pm.pages_file
    criu_pages = os.path.realpath(own)
    for r in pm.runs:
        end = r.vaddr + r.pages * PAGE
        if any(a < end and r.vaddr < a + n for a, n, _ in task.runs):
            raise AheadError(f"task {task.vpid} touched memory gpusnap had read out "
                             f"({r.vaddr:#x}, {r.pages} pages): the dump stops, the "
                             "memory goes back")
    # (run, its offset in task.path) for ours; (run, None) for CRIU's
    merged = sorted([(r, None) for r in pm.runs]
                    + [(pagemap.Run(a, n // PAGE, pagemap.PE_PRESENT), o) for a, n, o in task.runs],
                    key=lambda x: x[0].vaddr)
    crius = iter(pagemap.offsets(pm))
    moves, gaps, pos, gap = [], [], 0, 0  # moves: (from CRIU's file?, source offset, offset, bytes)
    for r, offset in merged:
        if not r.present:
            continue
        n = r.pages * PAGE
        if offset is None:
            moves.append((True, next(crius)[0], pos, n))
            gap += n
        else:
            moves.append((False, offset, pos, n))
            gaps.append(gap)
            gap = 0
        pos += n
    in_place = gaps == task.gaps
    target = task.path if in_place else task.path + ".new"
    # round 1's bytes lie under CRIU's pieces too (same_pages.py): compared, not just written
    compared = task.compared if in_place else 0
    same = _assemble(moves, criu_pages, task.path, target, pos, in_place, compared)
    if not in_place:
        os.replace(target, task.path)
    elif compared:
        _note_whole(task.path, pos, same)
    _write_pagemap(pm_path, pagemap.Pagemap(pm.pages_id, tuple(r for r, _ in merged)))
    final = aside / pm.pages_file
    os.replace(task.path, final)
    if os.path.realpath(own) != os.path.realpath(final):
        if own.is_symlink() and Path(criu_pages).parent == aside:
            Path(criu_pages).unlink(missing_ok=True)
        own.unlink(missing_ok=True)
        os.symlink(final, own)
    if in_place:
        return "in place"
    return (f"copied: CRIU dumped {gaps} bytes around the runs, not {task.gaps}; "
            f"where: {pagescan.disagreements(task.pid, [(a, a + n) for a, n, _ in task.runs], pm)}")


def _assemble(moves, criu_pages: str, runs_path: str, target: str, size: int, in_place: bool,
              compared: int = 0) -> list[tuple[int, int]]:
    """Write the file: CRIU's pieces from its pages file and, unless the runs
    already lie where they belong (``in_place``), the runs from theirs. CRIU's
    pieces within the first ``compared`` bytes (round 1's there) are written
    only where they differ from what the file holds; the ranges that did not
    are returned."""
    src_criu = os.open(criu_pages, os.O_RDONLY)
    src_runs = os.open(runs_path, os.O_RDONLY)
    dst = os.open(target, os.O_RDWR | (0 if in_place else os.O_CREAT | os.O_TRUNC), 0o600)
    try:
        os.ftruncate(dst, size)
        jobs = [(src_criu if criu else src_runs, src, at, n)
                for criu, src, at, n in moves if criu or not in_place]

        def copy(job) -> tuple[int, int] | None:
            fd, src, at, n = job
            if fd == src_criu and at + n <= compared:
                return (at, at + n) if same_pages.copy_compared(fd, dst, src, at, n) else None
            done = 0
            while done < n:
                got = os.copy_file_range(fd, dst, n - done, src + done, at + done)
                if got <= 0:
                    raise AheadError(f"short copy into {target} at {at + done}")
                done += got
            return None

        split = [(fd, src + k, at + k, min(COMPOSE_PIECE, n - k)) for fd, src, at, n in jobs
                 for k in range(0, n, COMPOSE_PIECE)]
        with ThreadPoolExecutor(max_workers=default_threads(), thread_name_prefix="compose") as pool:
            return [r for r in pool.map(copy, split) if r is not None]
    finally:
        os.close(src_criu)
        os.close(src_runs)
        os.close(dst)


def _write_pagemap(path: Path, pm: pagemap.Pagemap) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    st = path.stat()
    tmp.write_bytes(pagemap.serialize(pm))
    os.chmod(tmp, st.st_mode & 0o7777)
    os.chown(tmp, st.st_uid, st.st_gid)
    os.replace(tmp, path)
