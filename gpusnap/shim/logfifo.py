"""Shim logs into the bundle's `log` FIFO, which containerd copies to its own log.

containerd reopens its end after a restart; while nobody reads, lines are
dropped rather than block the shim (writes are non-blocking, opened per
failure).
"""

from __future__ import annotations

import logging
import os


class FifoHandler(logging.Handler):
    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path
        self.fd: int | None = None

    def emit(self, record: logging.LogRecord) -> None:
        try:
            data = (self.format(record) + "\n").encode(errors="replace")
        except Exception:
            return
        for _ in range(2):
            if self.fd is None:
                try:
                    self.fd = os.open(self.path, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
                except OSError:
                    return  # no reader (containerd down) or no FIFO
            try:
                os.write(self.fd, data)
                return
            except BlockingIOError:
                return
            except OSError:  # EPIPE: the reader went away; reopen once
                os.close(self.fd)
                self.fd = None


def setup_logging(path: str, debug: bool) -> None:
    h = FifoHandler(path)
    h.setFormatter(logging.Formatter('time="%(asctime)s" level=%(levelname)s msg="%(message)s" runtime=gpusnap'))
    root = logging.getLogger("gpusnap.shim")
    root.addHandler(h)
    root.setLevel(logging.DEBUG if debug else logging.INFO)
    root.propagate = False
