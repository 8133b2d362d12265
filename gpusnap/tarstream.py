"""One pass over a tar archive that may be zstd- or gzip-compressed.

zstd runs as a process (multi-threaded, and faster than any Python binding at
this size); its own verdict catches a stream cut where tarfile sees a clean end
between two members, so it is asked for whenever the caller read to the end.
"""

from __future__ import annotations

import subprocess
import tarfile
from pathlib import Path
from typing import BinaryIO

from gpusnap.runtime.stream import ZSTD_MAGIC

GZIP_MAGIC = b"\x1f\x8b"
# tarfile's stream default is 10 KiB reads: far too many for gigabytes of CRIU pages.
_BUFFER = 1 << 20


class DamagedStream(Exception):
    """zstd refused the archive before tarfile saw a header (garbage after the magic)."""


class TarStream:
    """Opens ``path`` for streaming (mode ``r|``); raises OSError if it cannot be read.
    ``source``: the plain tar's bytes come from there instead (an export still
    being written, runtime/follow.py); ``path`` only names it."""

    def __init__(self, path: Path, source: BinaryIO | None = None) -> None:
        self._proc: subprocess.Popen | None = None
        if source is not None:
            self.tar = tarfile.open(fileobj=source, mode="r|", bufsize=_BUFFER)
            return
        with open(path, "rb") as f:
            magic = f.read(4)
        if magic.startswith(ZSTD_MAGIC):
            self._proc = subprocess.Popen(["zstd", "-dcq", str(path)], stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE)
            try:
                self.tar = tarfile.open(fileobj=self._proc.stdout, mode="r|", bufsize=_BUFFER)
            except tarfile.TarError:
                self._proc.stdout.close()
                err = self._proc.stderr.read().decode(errors="replace").strip()
                if self._proc.wait() > 0:
                    raise DamagedStream(err or "zstd failed") from None
                raise
        else:
            self.tar = tarfile.open(path, mode="r|gz" if magic.startswith(GZIP_MAGIC) else "r|",
                                    bufsize=_BUFFER)

    def close(self, read_to_end: bool) -> str | None:
        """Close; returns the decompressor's complaint when the stream was read
        to the end and zstd failed (closing early makes it die of SIGPIPE: not one)."""
        self.tar.close()
        if self._proc is None:
            return None
        self._proc.stdout.close()
        err = self._proc.stderr.read().decode(errors="replace").strip()
        self._proc.stderr.close()
        if self._proc.wait() > 0 and read_to_end:
            return err or "zstd failed"
        return None
