"""Podman's checkpoint archives through a FIFO, with zstd doing the (de)compression.

Podman 4 compresses `--export` archives in-process with one thread: export and
import of a CUDA checkpoint then take several times as long as the dump itself
(docs/benchmarks.md). Podman writes and reads the
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

import contextlib
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Callable, Iterator

from gpusnap.errors import GpusnapError
from gpusnap.partial import DISK_FULL, disk_full, partial_path
from gpusnap.private import open_private, write_private
from gpusnap.tarstream import ZSTD_MAGIC
from gpusnap.waits import Bound

PUMP_PARENT_ENV = "GPUSNAP_PUMP_PARENT"  # the CLI's pid, for the pump's watchdog


def is_zstd(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == ZSTD_MAGIC
    except OSError:
        return False


# Names doctor looks for when an interrupted export or import left them behind.
FIFO_DIR_PREFIX = ".gpusnap-fifo-"
FIFO_NAME = "archive.tar"


PIPE_SIZE = 1 << 20
_F_SETPIPE_SZ = 1031  # fcntl.F_SETPIPE_SZ, named only from Python 3.10 on Linux


def widen(fd: int) -> None:
    """A 1 MiB pipe buffer instead of 64 KiB: several times the throughput
    for the gigabytes of a GPU checkpoint (pipe-max-size allows 1 MiB by default)."""
    try:
        fcntl.fcntl(fd, _F_SETPIPE_SZ, PIPE_SIZE)
    except OSError:
        pass


def _fifo_dir(near: Path) -> tuple[Path, Path]:
    work = Path(tempfile.mkdtemp(prefix=FIFO_DIR_PREFIX, dir=near))
    fifo = work / FIFO_NAME
    os.mkfifo(fifo, 0o600)
    return work, fifo


def _pump(*args: str, pass_fds: tuple[int, ...] = ()) -> subprocess.Popen:
    # Its own session: a Ctrl-C meant for the CLI must not cut Podman's stream.
    # Our pid goes along: a CLI killed before the pump has started must still be
    # seen as gone, or the pump waits in open(FIFO) for ever.
    return subprocess.Popen([sys.executable, "-m", "gpusnap.runtime.fifo_pump", *args],
                            stderr=subprocess.PIPE, start_new_session=True, pass_fds=pass_fds,
                            env={**os.environ, PUMP_PARENT_ENV: str(os.getpid())})


def _stop(proc: subprocess.Popen) -> str:
    """Kill the pump and its zstd (its session), so no late write lands anywhere.
    Its stderr, once: a second call (the watch stopped it first) returns ""."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    if proc.stderr is None or proc.stderr.closed:
        _reap(proc)
        return ""
    try:  # a pump's own child (zstd) that kept stderr open: not waited for ever
        err = proc.communicate(timeout=Bound.of("STOP").seconds)[1]
    except subprocess.TimeoutExpired:
        proc.kill()
        _reap(proc)
        err = b""
    return (err or b"").decode(errors="replace").strip()


def _reap(proc: subprocess.Popen) -> None:
    """Wait for a SIGKILLed process, within STOP's bound: one stuck in the kernel
    (a hung disk under its write) is left to exit later, not waited on for ever."""
    with suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=Bound.of("STOP").seconds)


@contextmanager
def export_plain(dest: Path) -> Iterator[Path]:
    """Yield the path for `podman container checkpoint --export PATH --compress none`.

    Podman writes the plain tar itself into ``partial_path(dest)`` (made 0600
    first: Podman truncates it and keeps the mode), which a push follows as it
    grows (follow.py); renamed to ``dest`` on a clean exit, removed on an
    exception. No FIFO: with nothing to compress, a pump would only copy every
    byte once more (system CPU a small host cannot spare). Podman 4.3
    returns "no space left on device" on a full disk, it does not hang as it
    does on a broken FIFO.
    """
    partial = partial_path(dest)
    open_private(partial, "wb").close()
    ok = False
    try:
        yield partial
        ok = True
    except GpusnapError as exc:
        if DISK_FULL.lower() in exc.message.lower():
            raise GpusnapError(f"writing {dest} failed: {disk_full(dest)}",
                               "free space there or export elsewhere") from None
        raise
    finally:
        if ok:
            os.replace(partial, dest)
        else:
            partial.unlink(missing_ok=True)


class ExportStream:
    """The FIFO Podman `checkpoint --export`s into, and the CLI's watch over the
    pump that reads it (``check``: podman.checkpoint's watch)."""

    def __init__(self, path: Path, pump: subprocess.Popen) -> None:
        self.path = path
        self._pump = pump
        self._drain: threading.Thread | None = None

    def __str__(self) -> str:
        return str(self.path)

    def check(self) -> None:
        """A pump gone leaves Podman waiting in open(2) for a reader, or on a full
        pipe, for ever. The CLI then reads the stream into nothing, so Podman
        ends as it would (its dump kept: --keep) and the pump's failure is
        raised when the export ends. Podman is not killed mid-dump."""
        if self._drain is None and self._pump.poll() is not None:
            self._drain = threading.Thread(target=_discard_stream, args=(self.path,),
                                           name="gpusnap-export-drain", daemon=True)
            self._drain.start()

    @property
    def drained(self) -> bool:
        """Whether the pump was gone and the CLI read the stream into nothing."""
        return self._drain is not None

    def close(self) -> None:
        if self._drain is not None:
            unblock_reader(self.path)  # a drain still in open(2): Podman never wrote
            self._drain.join(Bound.of("STOP").seconds)


def _discard_stream(fifo: Path) -> None:
    try:
        with open(fifo, "rb", buffering=0) as f:
            while f.read(1 << 20):
                pass
    except OSError:
        pass


@contextmanager
def export_fifo(dest: Path, level: int = 1, head: Path | None = None) -> Iterator[ExportStream]:
    """Yield a FIFO for `podman container checkpoint --export FIFO --compress none`.

    ``head``, if the file exists once Podman starts writing (the dump is
    complete then), goes ahead of Podman's own members. On a clean exit the
    archive is at ``dest``; on an exception nothing is left there. (A plain
    tar needs no FIFO: export_plain.)
    """
    if shutil.which("zstd") is None:
        raise GpusnapError("zstd is not installed; it compresses checkpoint archives",
                           "install zstd (`make deps`)")
    work, fifo = _fifo_dir(dest.parent)
    partial = partial_path(dest)
    pump = _pump("export", str(fifo), str(partial), str(level),
                 *(["--head", str(head)] if head else []))
    stream, ok = ExportStream(fifo, pump), False
    try:
        yield stream
        ok = True
    finally:
        stream.close()
        if ok:
            try:  # Podman is done writing: the pump ends with its zstd
                err = pump.communicate(timeout=Bound.of("STOP").seconds + 60)[1]
                rc, err = pump.returncode, err.decode(errors="replace").strip()
            except subprocess.TimeoutExpired:  # Podman never opened it, say
                rc, err = None, (_stop(pump) or "the export stream never ended")
        else:
            rc, err = None, _stop(pump)
        shutil.rmtree(work, ignore_errors=True)
        if ok and rc == 0:
            os.replace(partial, dest)
        else:
            partial.unlink(missing_ok=True)
        # zstd's own words come first (e.g. "No space left on device"); when the
        # writing side failed, that is the cause, and Podman's broken pipe the effect.
        if err or (ok and rc != 0):
            reason = err.splitlines()[0] if err else f"zstd exited with {rc}"
            if DISK_FULL in reason:  # zstd says "error 70 : Write error : ..."
                reason = disk_full(dest)
            elif stream.drained:
                raise GpusnapError(f"writing {dest} failed: its stream stopped while Podman "
                                   f"wrote it ({err.splitlines()[-1] if err else f'exit status {rc}'})",
                                   "run the export again, and report the line above if it "
                                   "repeats")
            raise GpusnapError(f"writing {dest} failed: {reason.removeprefix('zstd: ')}",
                               "free space there or export elsewhere")


class ImportStream:
    """The path Podman `restore --import`s, and the CLI's watch over the pump
    that serves it (``check``, called while Podman runs: podman.restore's watch)."""

    def __init__(self, path: Path, pump: subprocess.Popen | None = None,
                 work: Path | None = None, progress: Callable[[], int] | None = None) -> None:
        self.path = path
        self._pump = pump
        self._work = work
        self.progress = progress  # bytes fed to the stream so far, where it is fed as it comes
        self._since = time.monotonic()
        self._open_bound = Bound.of("IMPORT_OPEN")

    def __str__(self) -> str:
        return str(self.path)

    @property
    def pump_pid(self) -> int | None:
        return self._pump.pid if self._pump is not None else None

    def check(self) -> None:
        """Raise where Podman would otherwise wait for ever: the pump is gone
        (a reader in open(2) then has no writer), or Podman never opened the
        stream within its bound."""
        if self._pump is None:
            return
        rc = self._pump.poll()
        if rc is not None:
            err = _stop(self._pump)
            unblock_reader(self.path)
            why = err.splitlines()[-1] if err else f"exit status {rc}"
            raise GpusnapError(f"the import stream of {self.path.name} stopped before Podman "
                               f"had read it ({why})",
                               "nothing was restored and the checkpoint is unchanged; "
                               "run the restore again, and report the line above if it repeats")
        if time.monotonic() - self._since > self._open_bound.seconds and not self.opened():
            raise self._open_bound.expired("Podman opening the checkpoint stream")

    def opened(self) -> bool:
        return self._work is None or (self._work / OPENED).exists()


OPENED = "opened"  # made by the pump at a reader's first open (ImportStream.check)
PUMP_ERROR = "pump.error"  # why the pump ended a stream broken (a rewrite, a zstd checksum)
# Ends a stream that must not pass for a whole tar: a reader cut at a member
# boundary would take it for one. Go's tar (Podman's) and GNU tar fail on a
# header whose checksum is wrong, or on the byte past it where it lands in a
# member's data (one byte more than a block: never a clean end).
BROKEN_END = b"gpusnap: the stream broke off here\n".ljust(tarfile.BLOCKSIZE + 1, b"\xff")


def decompression_failed(proc: subprocess.Popen, bound_s: float = 60.0) -> str | None:
    """Once a zstd's (or gzip's) output has ended: None where it exited 0, else
    why, in its own words where it said any. Any other status counts (a
    signal's is negative), and so does no exit within ``bound_s``: a frame's
    checksum is checked after its last byte is written."""
    try:
        _, err = proc.communicate(timeout=bound_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        # SIGKILLed it ends at once; its stderr is ours alone (it forks no child)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.communicate(timeout=5)
        return f"{Path(proc.args[0]).name} did not end within {bound_s:.0f} s of its output"
    if proc.returncode == 0:
        return None
    return (err or b"").decode(errors="replace").strip() or "decompression failed"


def unblock_reader(fifo: Path) -> None:
    """A reader blocked in open(2) on ``fifo`` gets its writer, and at once EOF."""
    try:
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)  # ENXIO: no reader there
    except OSError:
        return
    os.close(fd)


@contextmanager
def import_fifo(src: Path, near: Path | None = None, retarget: dict | None = None,
                head: bytes | None = None, head_opens: int = 0) -> Iterator[ImportStream]:
    """Yield what Podman can `restore --import`: a FIFO, or src itself.

    ``retarget`` ({"remap": DeviceRemap dict, "plan": Plan dict}) always goes
    through the FIFO: every reader gets the archive rewritten for other GPUs
    (runtime/retarget.py). A rewrite that failed leaves its reason in
    GpusnapError raised on leaving, when Podman has failed too. ``head`` (a tar
    of config.dump and spec.dump, see config_only_opens; with ``retarget``, as
    rewritten) serves the first ``head_opens`` opens instead of the whole
    archive; any open after them gets the whole archive, however many come.
    """
    short = head is not None and head_opens > 0
    zstd = is_zstd(src)
    if retarget is None and not short and (not zstd or shutil.which("zstd") is None):
        yield ImportStream(src)  # Podman reads it itself, slower
        return
    if zstd and shutil.which("zstd") is None:
        raise GpusnapError("zstd is not installed; it decompresses checkpoint archives",
                           "install zstd (`make deps`)")
    work, fifo = _fifo_dir(near or Path(tempfile.gettempdir()))
    args = ["import", str(fifo), str(src.absolute())]
    if retarget is not None:
        write_private(work / "retarget.json", json.dumps(retarget))
        args += ["--retarget", str(work / "retarget.json")]
    if short:
        write_private(work / "head.tar", head)
        args += ["--head", str(work / "head.tar"), "--head-opens", str(head_opens)]
    server = _pump(*args)
    try:
        yield ImportStream(fifo, server, work)
    except GpusnapError as exc:
        failed = (work / PUMP_ERROR).read_text().strip() \
            if (work / PUMP_ERROR).exists() else ""
        if failed:
            raise GpusnapError(f"{exc.message} ({failed})", exc.hint) from None
        raise
    finally:
        _stop(server)
        shutil.rmtree(work, ignore_errors=True)


# Podman 4.3 opens an import archive three times; the first two opens read only
# config.dump and spec.dump (seen with 4.3.1: opens 1 and 2 served a tar of those
# two files alone, open 3 the whole archive, restored). Versions not seen doing
# so get the whole archive on every open: correct, with less overlap.
def config_only_opens(podman_version: str) -> int:
    return 2 if podman_version.startswith("4.3.") else 0


class PipeSink:
    """The CLI's end of the pipe a streamed import reads (import_piped):
    write() the tar, done() before its end marker, close()."""

    def __init__(self, fd: int, done: Path) -> None:
        self._out = open(fd, "wb", buffering=0)
        self._done = done
        self.written = 0  # the restore's progress (waits.run's bound restarts as it moves)

    def write(self, data) -> None:
        view = memoryview(data)
        while view:  # a pipe takes what fits; BrokenPipeError once the pump gave up
            n = self._out.write(view)
            self.written += n
            view = view[n:]

    def done(self) -> None:
        """Every member is in: from here a cut stream is still a whole archive."""
        write_private(self._done, b"")

    def close(self) -> None:
        try:
            self._out.close()
        except OSError:
            pass


@contextmanager
def import_piped(near: Path, head: bytes, head_opens: int,
                 name: str | None = None) -> Iterator[tuple[ImportStream, PipeSink]]:
    """Yield a FIFO Podman can `restore --import` and the sink its archive is
    written into as it is downloaded: no staged copy on disk. ``head`` (a tar
    of config.dump and spec.dump) serves the first ``head_opens`` opens, so
    Podman starts before the download ends; the next open gets the pipe. A pipe
    closed before ``PipeSink.done()`` (a failed download, the CLI killed) makes
    the pump kill the importing Podman rather than end its stream: a tar cut
    between members would read as complete. ``name``: the container being
    restored, removed by the pump if the CLI dies mid-way."""
    work, fifo = _fifo_dir(near)
    write_private(work / "head.tar", head)  # config.dump and spec.dump: the environment
    read, write = os.pipe()
    try:
        widen(write)
        server = _pump("pipe", str(fifo), "--fd", str(read), "--done", str(work / "done"),
                       "--head", str(work / "head.tar"), "--head-opens", str(head_opens),
                       *(["--name", name] if name else []), pass_fds=(read,))
    except BaseException:
        os.close(write)
        raise
    finally:
        os.close(read)  # the pump has its own
    sink = PipeSink(write, work / "done")
    try:
        yield ImportStream(fifo, server, work, progress=lambda: sink.written), sink
    finally:
        _stop(server)  # first: a write blocked on the full pipe fails, the read end gone
        sink.close()
        shutil.rmtree(work, ignore_errors=True)


CONFIG_FILES = ("config.dump", "spec.dump")


def config_tar(files: dict[str, bytes]) -> bytes | None:
    """The tar Podman's config-only opens are served: config.dump and spec.dump
    (None when one is missing: then every open gets the whole archive)."""
    if any(name not in files for name in CONFIG_FILES):
        return None
    return b"".join(tar_member(name, files[name]) for name in CONFIG_FILES) + b"\0" * 1024


def tar_member(name: str, data: bytes, mode: int = 0o600) -> bytes:
    """One regular-file member of a tar stream (header and padded data, no end marker)."""
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = len(data), mode, int(time.time())
    return info.tobuf(format=tarfile.PAX_FORMAT) + data + b"\0" * (-len(data) % 512)
