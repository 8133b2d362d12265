"""One pass over a tar archive that may be zstd- or gzip-compressed.

zstd runs as a process (multi-threaded, and faster than any Python binding at
this size); its own verdict catches a stream cut where tarfile sees a clean end
between two members, so it is asked for whenever the caller read to the end.

tarfile parses the headers; a member's data is read by `data()` straight from
the underlying file into the caller's buffer. tarfile's own stream mode (`r|`)
copies every byte four times on its way to the chunker (joins and slices of
its read-ahead buffer), the largest cost of a push on a small host. Plain and
zstd archives are opened in tarfile's seekable mode over `_Forward`, which
allows only forward seeks (a skip reads through, or lseeks in a regular file).
"""

from __future__ import annotations

import io
import subprocess
import tarfile
from pathlib import Path
from typing import BinaryIO


GZIP_MAGIC = b"\x1f\x8b"
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
# tarfile's stream default is 10 KiB reads: far too many for gigabytes of CRIU pages.
_BUFFER = 1 << 20


class DamagedStream(Exception):
    """zstd refused the archive before tarfile saw a header (garbage after the magic)."""


class _Forward(io.RawIOBase):
    """A pipe or a growing file as tarfile's seekable mode wants it: full reads
    (short ones only at the end), tell(), and seek() forward only: a skip
    reads through, except in a regular file (``lseek``) or a source that can
    ``skip(n)`` itself (a followed file, runtime/follow.py)."""

    def __init__(self, raw: BinaryIO, can_lseek: bool = False) -> None:
        super().__init__()
        self._raw = raw
        self._lseek = can_lseek
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        if whence == io.SEEK_CUR:
            pos += self._pos
        elif whence != io.SEEK_SET:
            raise io.UnsupportedOperation("seek from the end of a stream")
        if pos < self._pos:
            raise io.UnsupportedOperation(f"cannot seek back in a stream ({self._pos} -> {pos})")
        if self._lseek:
            self._raw.seek(pos)
            self._pos = pos
            return pos
        skip = getattr(self._raw, "skip", None)
        if skip is not None:
            skip(pos - self._pos)
            self._pos = pos
            return pos
        scratch = bytearray(min(pos - self._pos, _BUFFER))
        while self._pos < pos:
            if not self.readinto(memoryview(scratch)[:pos - self._pos]):
                break  # the end: tarfile sees a short read next
        return self._pos

    def readinto(self, b) -> int:
        """Fill ``b`` unless the stream ends first."""
        view = memoryview(b).cast("B")
        done = 0
        while done < len(view):
            n = self._raw.readinto(view[done:])
            if not n:
                break
            done += n
        self._pos += done
        return done

    def close(self) -> None:
        self._raw.close()
        super().close()


class _Member(io.RawIOBase):
    """One member's bytes, read from the archive's stream into the caller's buffer."""

    def __init__(self, stream: _Forward, offset: int, size: int) -> None:
        super().__init__()
        self._stream, self._offset, self._left = stream, offset, size

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        if self._left <= 0:
            return 0
        self._stream.seek(self._offset)  # a no-op when read in order
        view = memoryview(b).cast("B")[:self._left]
        n = self._stream.readinto(view)
        if n < len(view):
            raise tarfile.ReadError("unexpected end of data")
        self._offset += n
        self._left -= n
        return n


class TarStream:
    """Opens ``path`` for one pass; raises OSError if it cannot be read.
    ``source``: the plain tar's bytes come from there instead (an export still
    being written, runtime/follow.py); ``path`` only names it."""

    def __init__(self, path: Path, source: BinaryIO | None = None) -> None:
        self._proc: subprocess.Popen | None = None
        self._forward: _Forward | None = None
        if source is not None:
            self._open_forward(_Forward(source))
            return
        with open(path, "rb") as f:
            magic = f.read(4)
        if magic.startswith(ZSTD_MAGIC):
            self._proc = subprocess.Popen(["zstd", "-dcq", str(path)], stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE)
            try:
                self._open_forward(_Forward(self._proc.stdout))
            except tarfile.TarError:
                self._proc.stdout.close()
                err = self._proc.stderr.read().decode(errors="replace").strip()
                if self._proc.wait() > 0:
                    raise DamagedStream(err or "zstd failed") from None
                raise
        elif magic.startswith(GZIP_MAGIC):
            self.tar = tarfile.open(path, mode="r|gz", bufsize=_BUFFER)
        else:
            f = open(path, "rb", buffering=_BUFFER)
            try:
                self._open_forward(_Forward(f, can_lseek=True))
            except BaseException:
                f.close()
                raise

    def _open_forward(self, stream: _Forward) -> None:
        self._forward = stream
        self.tar = tarfile.open(fileobj=stream, mode="r:")

    def data(self, info: tarfile.TarInfo) -> BinaryIO | None:
        """The data of regular file ``info``; read it before the next member."""
        if self._forward is None or info.sparse is not None:
            return self.tar.extractfile(info)
        return _Member(self._forward, info.offset_data, info.size)  # type: ignore[return-value]

    def ended(self) -> bool:
        """Whether the tar's end (a zero block) was read after its last member:
        to tarfile, a tar cut exactly between two members is complete, one short."""
        if self._forward is not None:
            read = self._forward.tell()
        else:
            read = self.tar.fileobj.pos  # type: ignore[union-attr]  # r|gz: tarfile's _Stream
        return read >= self.tar.offset + tarfile.BLOCKSIZE

    def close(self, read_to_end: bool) -> str | None:
        """Close; returns the decompressor's complaint when the stream was read
        to the end and zstd failed (closing early makes it die of SIGPIPE: not one)."""
        self.tar.close()
        if self._forward is not None:
            self._forward.close()
        if self._proc is None:
            return None
        self._proc.stdout.close()
        err = self._proc.stderr.read().decode(errors="replace").strip()
        self._proc.stderr.close()
        if self._proc.wait() > 0 and read_to_end:
            return err or "zstd failed"
        return None
