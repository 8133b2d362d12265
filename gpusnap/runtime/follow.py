"""Read an export while Podman is still writing it (tail -f for one file).

A push from a running container starts chunking and uploading the checkpoint
as Podman writes it, instead of after: Podman writes the plain tar into a
file (runtime/stream.py, export_plain), and this reader follows that file. The
file, not a pipe, sits between the two on purpose: Podman never waits for the
network, and a failed upload leaves a complete archive to retry from.
"""

from __future__ import annotations

import io
import os
import time
from pathlib import Path
from typing import Callable

_POLL = 0.005  # seconds between looks when the reader has caught up with the writer


class GrowingFile(io.RawIOBase):
    """The bytes of ``paths[0]`` (the partial file) as they are written.

    ``finished()`` says the writer is done: then what is left is read and the
    stream ends. A writer that renamed its file on success (partial -> final)
    is found under the later names in ``paths``, when it finished before this
    reader opened the first. No file at all once finished is an empty stream:
    the caller asks the writer why.
    """

    def __init__(self, paths: list[Path], finished: Callable[[], bool],
                 head: Callable[[], bytes] | None = None) -> None:
        super().__init__()
        self._paths = paths
        self._finished = finished
        self._fd: int | None = None
        self._head = head  # asked once the file has its first byte: served before it
        self._pending = b""

    def readable(self) -> bool:
        return True

    def fileno(self) -> int:
        if self._fd is None:
            raise OSError("the file is not open yet")
        return self._fd

    def _open(self) -> bool:
        for path in self._paths:
            try:
                self._fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
                return True
            except FileNotFoundError:
                continue
        return False

    def readinto(self, buf) -> int:
        while True:
            done = self._finished()  # asked before reading: a last read follows it
            if self._fd is None and not self._open():
                if done:
                    return 0
                time.sleep(_POLL)
                continue
            if self._head is not None and not self._started(done):
                time.sleep(_POLL)
                continue
            if self._pending:
                n = min(len(buf), len(self._pending))
                buf[:n] = self._pending[:n]
                self._pending = self._pending[n:]
                return n
            n = os.readv(self._fd, [buf])
            if n or done:
                return n
            time.sleep(_POLL)

    def skip(self, n: int) -> None:
        """Move ``n`` bytes on without reading them (a member whose data is not
        needed): once the writer has written them, or has finished short of
        them (the next read then ends the stream)."""
        if self._head is not None:  # nothing read yet: the head is not even known
            scratch = bytearray(min(n, 1 << 20))
            while n > 0 and (k := self.readinto(memoryview(scratch)[:min(n, len(scratch))])):
                n -= k
        while n > 0:
            if self._pending:
                k = min(n, len(self._pending))
                self._pending = self._pending[k:]
                n -= k
                continue
            done = self._finished()
            if self._fd is not None:
                pos = os.lseek(self._fd, 0, os.SEEK_CUR)
                if os.fstat(self._fd).st_size >= pos + n or done:
                    os.lseek(self._fd, pos + n, os.SEEK_SET)
                    return
            elif self._open():
                continue
            elif done:
                return
            time.sleep(_POLL)

    def _started(self, done: bool) -> bool:
        """Has the writer begun (or ended)? Then the head is taken, once."""
        size = os.fstat(self._fd).st_size
        if not size and not done:
            return False
        if size:
            self._pending = self._head()
        self._head = None
        return True

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        super().close()


class _Buffered(io.BufferedReader):
    def skip(self, n: int) -> None:
        """What the buffer holds is dropped, the rest skipped in the file."""
        held = len(self.peek(1)) if n else 0
        self.read(min(n, held))
        if n > held:
            self.raw.skip(n - held)


def follow(paths: list[Path], finished: Callable[[], bool], head: Callable[[], bytes] | None = None,
           buffer: int = 1 << 20) -> io.BufferedReader:
    """``head``: bytes that go ahead of the file's, asked for when its writer
    has begun (a tar member made from a file that exists by then)."""
    return _Buffered(GrowingFile(paths, finished, head), buffer)
