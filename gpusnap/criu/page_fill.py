"""Memory pages written into a restored process by many threads instead of CRIU's one.

CRIU restores every page of a process on one thread: it reads the pages file
into the new process's memory, page after page (criu/mem.c,
restore_priv_vma_content). After the driver's checkpoint a CUDA process holds
its whole GPU memory in host memory, so at 32 GiB that one thread moves
36.7 GB, ~17-19 s of the stop on an H200 host (docs/benchmarks.md).

Here the big runs are written by a pool of threads with process_vm_writev(2)
while the restored tasks are still stopped (CRIU's pre-resume step): each
thread reads a piece of the pages file and writes it at its address in the
process. Which runs, and how CRIU is told to leave them alone, is
fill_plan.py's part; this module only moves bytes, and checks that every
byte arrived.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

PIECE = 64 << 20  # one thread's read and write: big enough that a call's cost vanishes


@dataclass(frozen=True)
class Run:
    """``length`` bytes at ``address`` in the process, found at ``offset`` of ``path``."""

    address: int
    length: int
    path: str
    offset: int


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    fn = libc.process_vm_writev
    fn.restype = ctypes.c_ssize_t
    fn.argtypes = [ctypes.c_int, ctypes.POINTER(_IoVec), ctypes.c_ulong,
                   ctypes.POINTER(_IoVec), ctypes.c_ulong, ctypes.c_ulong]
    return libc


def pieces(runs: Sequence[Run], piece: int = PIECE) -> Iterator[Run]:
    """Each run cut into pieces of at most ``piece`` bytes, in order."""
    for run in runs:
        done = 0
        while done < run.length:
            n = min(piece, run.length - done)
            yield Run(run.address + done, n, run.path, run.offset + done)
            done += n


class _Writer:
    """One thread's buffer and the process it writes into."""

    def __init__(self, libc: ctypes.CDLL, pid: int, fds: dict[str, int], piece: int):
        self.libc, self.pid, self.fds, self.piece = libc, pid, fds, piece
        self.local = threading.local()

    def _buffer(self) -> tuple[bytearray, int]:
        buf = getattr(self.local, "buf", None)
        if buf is None:
            buf = self.local.buf = bytearray(self.piece)
        return buf, ctypes.addressof(ctypes.c_char.from_buffer(buf))

    def write(self, run: Run) -> int:
        buf, base = self._buffer()
        view = memoryview(buf)[:run.length]
        got = 0
        while got < run.length:  # preadv returns short at a file's end only: then the file is short
            n = os.preadv(self.fds[run.path], [view[got:]], run.offset + got)
            if n <= 0:
                raise OSError(f"{run.path} ends before offset {run.offset + got}")
            got += n
        done = 0
        while done < run.length:  # a partial write stops at the first page it could not write
            local = _IoVec(base + done, run.length - done)
            remote = _IoVec(run.address + done, run.length - done)
            n = self.libc.process_vm_writev(self.pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
            if n <= 0:
                err = ctypes.get_errno()
                raise OSError(err, f"process {self.pid}: cannot write {run.length - done} bytes "
                                   f"at {run.address + done:#x}: {os.strerror(err)}")
            done += n
        return run.length


def fill(pid: int, runs: Sequence[Run], threads: int, piece: int = PIECE) -> int:
    """Write every run into process ``pid``; the bytes written. Raises OSError
    (the first failure) when any byte could not be written: the process must
    then not run (its memory is not what was dumped)."""
    fds: dict[str, int] = {}
    try:
        for run in runs:
            if run.path not in fds:
                fds[run.path] = os.open(run.path, os.O_RDONLY)
        writer = _Writer(_libc(), pid, fds, piece)
        with ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="page-fill") as pool:
            return sum(pool.map(writer.write, pieces(runs, piece)))
    finally:
        for fd in fds.values():
            os.close(fd)


def default_threads() -> int:
    """As many threads as this process may run on, at most 16: the copy scales with
    cores until the memory bus is full (bench/page_fill.py)."""
    try:
        n = len(os.sched_getaffinity(0))
    except OSError:
        n = os.cpu_count() or 1
    return max(1, min(16, n))
