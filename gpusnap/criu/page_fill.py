"""Memory pages written into a restored process by many threads instead of CRIU's one.

CRIU restores every page of a process on one thread: it reads the pages file
into the new process's memory, page after page (criu/mem.c,
restore_priv_vma_content). After the driver's checkpoint a CUDA process holds
its whole GPU memory in host memory, so at 32 GiB that one thread moves
36.7 GB, ~17-19 s of the stop on an H200 host (docs/benchmarks.md).

Here the big runs are written by a pool of threads with process_vm_writev(2)
while the restored tasks wait in CRIU's restorer (its post-restore step): the
pages files are mapped read-only into this process and each thread hands the
kernel one piece, which it copies from the page cache to its address in the
process (one copy, no buffers: the script's memory stays small). Which runs, and how CRIU is told to leave them alone, is
fill_plan.py's part; this module only moves bytes, and checks that every
byte arrived.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

PIECE = 64 << 20  # one call of one thread: big enough that the call's cost vanishes


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
MAP_FAILED = ctypes.c_void_p(-1).value


def libc() -> ctypes.CDLL:
    """libc with process_vm_writev/readv (this module's fill, dump_ahead's read)
    and mmap/munmap declared for ctypes."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    for call in (libc.process_vm_writev, libc.process_vm_readv):
        call.restype = ctypes.c_ssize_t
        call.argtypes = [ctypes.c_int, ctypes.POINTER(IoVec), ctypes.c_ulong,
                         ctypes.POINTER(IoVec), ctypes.c_ulong, ctypes.c_ulong]
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return libc


def pieces(runs: Sequence[Run], piece: int = PIECE) -> Iterator[Run]:
    """Each run cut into pieces of at most ``piece`` bytes, in order."""
    for run in runs:
        done = 0
        while done < run.length:
            n = min(piece, run.length - done)
            yield Run(run.address + done, n, run.path, run.offset + done)
            done += n


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


def fill(pid: int, runs: Sequence[Run], threads: int, piece: int = PIECE) -> int:
    """Write every run into process ``pid``; the bytes written. Raises OSError
    (the first failure) when any byte could not be written: the process must
    then not run (its memory is not what was dumped)."""
    calls = libc()
    files = _Files(calls, runs)
    try:
        with ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="page-fill") as pool:
            return sum(pool.map(lambda r: _write(calls, pid, files, r), pieces(runs, piece)))
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
