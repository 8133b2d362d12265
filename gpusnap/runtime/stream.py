"""Podman's checkpoint archives through a FIFO, with zstd doing the (de)compression.

Podman 4 compresses `--export` archives in-process with one thread: on an H100
host a 7.5 GB checkpoint of a 2 GiB CUDA process took 67 s to export and 58 s
to import, against about 11 s for the dump itself. Podman writes and reads the
archive with plain open(2), so a named pipe can stand in for the file:

- export: Podman writes an uncompressed tar (`--compress none`) into the FIFO
  and multi-threaded `zstd -T0` writes the archive. The result is an ordinary
  single-frame zstd tar, which unchanged Podman imports.
- import: Podman opens the archive several times (it reads the config before
  the whole archive); every open of the FIFO is served a fresh `zstd -d` stream.

Nothing half-written is left under the archive's name: zstd writes a hidden
partial file that is renamed only when every byte is in.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from gpusnap.errors import GpusnapError

ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_SPLICE = 1 << 20


def is_zstd(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == ZSTD_MAGIC
    except OSError:
        return False


def _fifo_dir(near: Path) -> tuple[Path, Path]:
    work = Path(tempfile.mkdtemp(prefix=".gpusnap-fifo-", dir=near))
    fifo = work / "archive.tar"
    os.mkfifo(fifo, 0o600)
    return work, fifo


def _unblock(fifo: Path, thread: threading.Thread, flags: int) -> None:
    """Wake a thread blocked opening the other end of ``fifo``, then wait for it."""
    while thread.is_alive():
        try:
            os.close(os.open(fifo, flags | os.O_NONBLOCK))
        except OSError:
            pass  # no one waiting yet (ENXIO), or the thread has moved on
        thread.join(0.02)


class _Pump(threading.Thread):
    """FIFO -> (optional prefix) -> zstd's stdin, zero-copy with splice(2)."""

    def __init__(self, fifo: Path, sink: int, prefix: Callable[[], bytes | None]) -> None:
        super().__init__(name="gpusnap-export", daemon=True)
        self.fifo, self.sink, self.prefix = fifo, sink, prefix
        self.cancelled = False
        self.bytes = 0
        self.error: OSError | None = None

    def run(self) -> None:
        fd = os.open(self.fifo, os.O_RDONLY)  # returns once Podman opens it to write
        try:
            if self.cancelled:
                return
            head = self.prefix()
            if head:
                os.write(self.sink, head)
            while n := os.splice(fd, self.sink, _SPLICE):
                self.bytes += n
        except OSError as exc:
            # zstd died (disk full, killed): closing our end fails Podman's write too.
            self.error = exc
        finally:
            os.close(fd)
            os.close(self.sink)


@contextmanager
def export_fifo(dest: Path, level: int = 1,
                prefix: Callable[[], bytes | None] = lambda: None) -> Iterator[Path]:
    """Yield a FIFO for `podman container checkpoint --export FIFO --compress none`.

    ``prefix`` is called once Podman starts writing (the dump is complete then)
    and may return tar members to put ahead of Podman's own. On a clean exit
    the archive is at ``dest``; on an exception nothing is left there.
    """
    work, fifo = _fifo_dir(dest.parent)
    partial = dest.with_name(f".{dest.name}.partial")
    zstd = subprocess.Popen(["zstd", "-q", "-T0", f"-{level}", "-f", "-o", str(partial)],
                            stdin=subprocess.PIPE, stderr=subprocess.PIPE)
    pump = _Pump(fifo, os.dup(zstd.stdin.fileno()), prefix)
    zstd.stdin.close()
    zstd.stdin = None  # the pump owns the write end now
    pump.start()
    ok = False
    try:
        yield fifo
        ok = True
    finally:
        if not ok:
            pump.cancelled = True
        _unblock(fifo, pump, os.O_WRONLY)
        if not ok:
            zstd.kill()
        err = zstd.communicate()[1].decode(errors="replace").strip()
        shutil.rmtree(work, ignore_errors=True)
        if ok and (zstd.returncode != 0 or pump.error):
            ok = False
            partial.unlink(missing_ok=True)
            reason = err.splitlines()[-1] if err else str(pump.error)
            raise GpusnapError(f"writing {dest} failed: {reason}",
                               "free space there or export elsewhere")
        if ok:
            os.replace(partial, dest)
        else:
            partial.unlink(missing_ok=True)


class _Server(threading.Thread):
    """Serve a fresh `zstd -dc SRC` stream to every opener of the FIFO."""

    def __init__(self, src: Path, fifo: Path) -> None:
        super().__init__(name="gpusnap-import", daemon=True)
        self.src, self.fifo = src, fifo
        self.stopped = False
        self.served = 0

    def run(self) -> None:
        while True:
            fd = os.open(self.fifo, os.O_WRONLY)  # returns once a reader opens it
            try:
                if self.stopped:
                    return
                # A reader that stops early closes its end: zstd then exits on EPIPE.
                subprocess.run(["zstd", "-dcq", str(self.src)], stdout=fd,
                               stderr=subprocess.DEVNULL, check=False)
                self.served += 1
            finally:
                os.close(fd)


@contextmanager
def import_fifo(src: Path, near: Path | None = None) -> Iterator[Path]:
    """Yield a path Podman can `restore --import`: a FIFO for zstd archives, else src."""
    if not is_zstd(src):
        yield src
        return
    work, fifo = _fifo_dir(near or Path(tempfile.gettempdir()))
    server = _Server(src.absolute(), fifo)
    server.start()
    try:
        yield fifo
    finally:
        server.stopped = True
        deadline = time.monotonic() + 30
        while server.is_alive() and time.monotonic() < deadline:
            _unblock(fifo, server, os.O_RDONLY)
        shutil.rmtree(work, ignore_errors=True)


def tar_member(name: str, data: bytes, mode: int = 0o600) -> bytes:
    """One regular-file member of a tar stream (header and padded data, no end marker)."""
    import tarfile

    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = len(data), mode, int(time.time())
    return info.tobuf(format=tarfile.PAX_FORMAT) + data + b"\0" * (-len(data) % 512)
