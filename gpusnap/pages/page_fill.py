"""Memory pages written into a restored process by many threads instead of CRIU's one.

CRIU restores every page of a process on one thread: it reads the pages file
into the new process's memory, page after page (criu/mem.c,
restore_priv_vma_content). After the driver's checkpoint a CUDA process holds
its whole GPU memory in host memory, so that one thread moves a little more
than the process used on the GPU: at tens of GiB, the largest part of the
stop (docs/benchmarks.md).

Here the big runs are written by a pool of threads with process_vm_writev(2)
while the restored tasks wait in CRIU's restorer (its post-restore step): the
pages files are mapped read-only into this process and each thread hands the
kernel a batch of runs (up to 8 MiB, one call), which it copies from the page
cache to their addresses in the process (one copy, no buffers), then drops
those source pages from its own page tables (the RSS stays small). Which
runs, and how CRIU is told to leave them alone, is fill_plan.py's part; this
module only moves bytes, and checks that every byte arrived.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

PIECE = 8 << 20  # one call of one thread: its cost still vanishes (16 GiB in 0.75 s on 16
# threads as with 64 MiB, bench/page_fill.py), and each thread maps at most this much
IOV_MAX = 1024  # iovecs one process_vm_writev takes (UIO_MAXIOV)


@dataclass(frozen=True)
class Run:
    """``length`` bytes at ``address`` in the process, found at ``offset`` of ``path``."""

    address: int
    length: int
    path: str
    offset: int


class IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


PROT_READ, PROT_WRITE, MAP_SHARED = 0x1, 0x2, 0x01
MADV_DONTNEED = 4
PAGE = os.sysconf("SC_PAGE_SIZE")
MAP_FAILED = ctypes.c_void_p(-1).value


def libc() -> ctypes.CDLL:
    """libc with process_vm_writev/readv (this module's fill, dump_ahead's read),
    mmap/munmap and memcmp declared for ctypes."""
    # The libc this process has loaded: find_library("c") would run ldconfig -p.
    libc = ctypes.CDLL(None, use_errno=True)
    for call in (libc.process_vm_writev, libc.process_vm_readv):
        call.restype = ctypes.c_ssize_t
        call.argtypes = [ctypes.c_int, ctypes.POINTER(IoVec), ctypes.c_ulong,
                         ctypes.POINTER(IoVec), ctypes.c_ulong, ctypes.c_ulong]
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.memcmp.restype = ctypes.c_int
    libc.memcmp.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    return libc


def vm_reader(calls, pid: int) -> Callable[[int, int, int], None]:
    """read(dst, src, n): n bytes of ``pid`` at ``src`` into this process at ``dst``."""
    def vm_read(dst: int, src: int, length: int) -> None:
        done = 0
        while done < length:
            n = length - done
            got = calls.process_vm_readv(pid, ctypes.byref(IoVec(dst + done, n)), 1,
                                         ctypes.byref(IoVec(src + done, n)), 1, 0)
            if got <= 0:
                err = ctypes.get_errno()
                raise OSError(err, f"process {pid}: cannot read {n} bytes at "
                                   f"{src + done:#x}: {os.strerror(err)}")
            done += got
    return vm_read


def map_shared(calls, fd: int, path: str, length: int, offset: int, prot: int) -> int:
    """``length`` bytes of ``fd`` from ``offset`` mapped shared; OSError naming ``path``."""
    base = calls.mmap(None, length, prot, MAP_SHARED, fd, offset)
    if base in (None, MAP_FAILED):
        err = ctypes.get_errno()
        raise OSError(err, f"cannot map {path}: {os.strerror(err)}")
    return base


def pieces(runs: Sequence[Run], piece: int = PIECE) -> Iterator[Run]:
    """Each run cut into pieces of at most ``piece`` bytes, in order."""
    for run in runs:
        done = 0
        while done < run.length:
            n = min(piece, run.length - done)
            yield Run(run.address + done, n, run.path, run.offset + done)
            done += n


def merged(runs: Sequence[Run]) -> list[Run]:
    """Runs that continue one another in memory and in their file made one: CRIU
    caps a pagemap entry at its pipe's size (1 MiB), so a GPU process's memory
    comes as thousands of runs that are mostly one stretch."""
    out: list[Run] = []
    for r in runs:
        last = out[-1] if out else None
        if last and last.path == r.path and last.address + last.length == r.address \
                and last.offset + last.length == r.offset:
            out[-1] = Run(last.address, last.length + r.length, r.path, last.offset)
        else:
            out.append(r)
    return out


def batches(runs: Sequence[Run], piece: int = PIECE, most: int = IOV_MAX) -> Iterator[list[Run]]:
    """The runs (merged, cut at ``piece``) grouped for one process_vm_writev each:
    at most ``piece`` bytes and ``most`` runs a call. Few calls, so the threads
    spend their time in the kernel's copy, not in Python taking turns at the
    interpreter (one call per 1 MiB run leaves the threads queueing for the
    GIL: docs/benchmarks.md)."""
    group: list[Run] = []
    size = 0
    for p in pieces(merged(runs), piece):
        if group and (size + p.length > piece or len(group) == most):
            yield group
            group, size = [], 0
        group.append(p)
        size += p.length
    if group:
        yield group


class _Files:
    """Each pages file mapped read-only into this process: the kernel copies
    from the page cache straight into the target, one copy, no buffers."""

    def __init__(self, libc: ctypes.CDLL, runs: Sequence[Run]):
        self.libc, self.maps = libc, {}
        try:
            for run in runs:
                if run.path not in self.maps:
                    self._map(run.path)
                base, size = self.maps[run.path]
                if run.offset + run.length > size:
                    raise OSError(f"{run.path} ends before offset {run.offset + run.length}")
        except BaseException:
            self.close()
            raise

    def _map(self, path: str) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            base = self.libc.mmap(None, size, PROT_READ, MAP_SHARED, fd, 0) if size else 0
            if base in (None, MAP_FAILED):
                err = ctypes.get_errno()
                raise OSError(err, f"cannot map {path}: {os.strerror(err)}")
            self.maps[path] = (base or 0, size)
        finally:
            os.close(fd)

    def address(self, run: Run) -> int:
        return self.maps[run.path][0] + run.offset

    def let_go(self, group: list[Run]) -> None:
        """The group's pages out of this process's page tables once written (the
        file keeps them): process_vm_writev maps every source page it copies, so
        without this the filling process would end with the whole pages file
        counted in its RSS, the first pick of the OOM killer in the middle of
        a restore. At most a group per thread stays mapped."""
        for run in group:
            start = self.address(run)
            aligned = start - start % PAGE
            self.libc.madvise(aligned, start + run.length - aligned, MADV_DONTNEED)

    def close(self) -> None:
        for base, size in self.maps.values():
            if size:
                self.libc.munmap(base, size)
        self.maps = {}


def _write(libc: ctypes.CDLL, pid: int, files: _Files, run: Run) -> int:
    done, local = 0, files.address(run)
    while done < run.length:  # a partial write stops at the first page it could not write
        n = run.length - done
        src, dst = IoVec(local + done, n), IoVec(run.address + done, n)
        got = libc.process_vm_writev(pid, ctypes.byref(src), 1, ctypes.byref(dst), 1, 0)
        if got <= 0:
            err = ctypes.get_errno()
            raise OSError(err, f"process {pid}: cannot write {n} bytes at "
                               f"{run.address + done:#x}: {os.strerror(err)}")
        done += got
    return run.length


def _write_group(libc: ctypes.CDLL, pid: int, files: _Files, group: list[Run]) -> int:
    """One call for the whole group; where it stops short (a page it could not
    write), the rest run by run, which names the failing address."""
    if len(group) == 1:
        return _write(libc, pid, files, group[0])
    src, dst = (IoVec * len(group))(), (IoVec * len(group))()
    for i, r in enumerate(group):
        src[i] = IoVec(files.address(r), r.length)
        dst[i] = IoVec(r.address, r.length)
    total = sum(r.length for r in group)
    got = max(0, libc.process_vm_writev(pid, src, len(group), dst, len(group), 0))
    if got == total:
        return total
    for r in group:
        if got >= r.length:
            got -= r.length
            continue
        rest = Run(r.address + got, r.length - got, r.path, r.offset + got)
        _write(libc, pid, files, rest)
        got = 0
    return total


def _written(libc: ctypes.CDLL, pid: int, files: _Files, group: list[Run]) -> int:
    try:
        return _write_group(libc, pid, files, group)
    finally:
        files.let_go(group)


def fill(pid: int, runs: Sequence[Run], threads: int, piece: int = PIECE) -> int:
    """Write every run into process ``pid``; the bytes written. Raises OSError
    (the first failure) when any byte could not be written: the process must
    then not run (its memory is not what was dumped)."""
    calls = libc()
    files = _Files(calls, runs)
    try:
        with ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="page-fill") as pool:
            return sum(pool.map(lambda g: _written(calls, pid, files, g), batches(runs, piece)))
    finally:
        files.close()


def default_threads() -> int:
    """As many threads as this process may run on, at most 16: the copy scales with
    cores until the memory bus is full (bench/page_fill.py)."""
    try:
        n = len(os.sched_getaffinity(0))
    except OSError:
        n = os.cpu_count() or 1
    return max(1, min(16, n))
