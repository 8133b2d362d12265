"""The read-ahead's file faulted in while the driver's checkpoint runs.

Where the host backs a VM's RAM on first touch (the GPU machines gpusnap is
measured on), pre-dump's read of the driver's copy of GPU memory runs several
times slower into fresh tmpfs pages than into pages touched before
(docs/benchmarks.md). The driver's checkpoint, seconds long at tens of GiB,
leaves the cores idle meanwhile: this faults the file in then, sized from
what NVML says the process holds on its GPUs. ``dump_ahead.take`` reads into
it in place and cuts it to its size; what was not faulted in by then the read
faults in itself, as without this step. The bytes are zeros either way, so
the images do not depend on it.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from pathlib import Path

from gpusnap.pages.page_fill import MAP_FAILED, MAP_SHARED, PROT_READ, PROT_WRITE, libc

MADV_POPULATE_WRITE = 23  # Linux 5.14: faults a range in, errors returned rather than SIGBUS
STEP = 64 << 20  # one mmap + madvise per step: stopping waits for one step at most
THREADS = 4  # beside the driver's checkpoint, which copies on threads of its own


class Prefault:
    """``size`` bytes of ``path`` (created empty) faulted in on a few threads
    until ``finish``; a file nobody reads into is removed by ``discard``."""

    def __init__(self, path: Path, size: int, threads: int = THREADS) -> None:
        self.path, self.size = path, size
        self.faulted = 0
        self.error: str | None = None
        self.used = False
        self._next = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._started = time.monotonic()
        self.seconds = 0.0
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(self._fd, size)
        except OSError:
            os.close(self._fd)
            path.unlink(missing_ok=True)
            raise
        self._calls = libc()
        self._calls.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        self._threads = [threading.Thread(target=self._run, name=f"prefault-{i}", daemon=True)
                         for i in range(max(1, threads))]
        for t in self._threads:
            t.start()

    def _claim(self) -> int | None:
        with self._lock:
            if self._stop.is_set() or self.error or self._next >= self.size:
                return None
            start, self._next = self._next, self._next + STEP
            return start

    def _run(self) -> None:
        while (start := self._claim()) is not None:
            length = min(STEP, self.size - start)
            base = self._calls.mmap(None, length, PROT_READ | PROT_WRITE, MAP_SHARED, self._fd,
                                    start)
            if base in (None, MAP_FAILED):
                self._failed(ctypes.get_errno())
                return
            try:
                if self._calls.madvise(base, length, MADV_POPULATE_WRITE) != 0:
                    self._failed(ctypes.get_errno())  # an old kernel, a full tmpfs: the read faults
                    return
            finally:
                self._calls.munmap(base, length)
            with self._lock:
                self.faulted += length

    def _failed(self, err: int) -> None:
        with self._lock:
            self.error = self.error or os.strerror(err)

    def wait(self, seconds: float) -> None:
        """Until every byte is faulted in (or ``seconds`` have passed)."""
        deadline = time.monotonic() + seconds
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))

    def finish(self) -> None:
        """Stop faulting in (each thread ends its step, 64 MiB at most) and close."""
        if self._fd < 0:
            return
        self._stop.set()
        for t in self._threads:
            t.join()
        os.close(self._fd)
        self._fd = -1
        self.seconds = round(time.monotonic() - self._started, 3)

    def discard(self) -> None:
        """Nothing was read into it: its RAM given back."""
        self.finish()
        if not self.used:
            self.path.unlink(missing_ok=True)

    def facts(self) -> dict:
        return {"bytes": self.faulted, "seconds": self.seconds,
                **({"error": self.error} if self.error else {})}


def start(path: Path, size: int, least: int) -> Prefault | None:
    """A Prefault of ``path``, or None where ``size`` (NVML's figure) is below
    ``least`` (the read-ahead would not take it) or the file cannot be made."""
    if size < least:
        return None
    try:
        return Prefault(path, size)
    except OSError:
        return None
