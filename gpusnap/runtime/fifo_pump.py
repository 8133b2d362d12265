"""The process at the other end of an export or import FIFO (see stream.py).

It runs apart from the gpusnap CLI, in its own session, because Podman blocks
in open(2) on a FIFO until someone opens the other end: were the CLI killed
mid-checkpoint, Podman would hang for ever. This process outlives the CLI and
ends when no process refers to the FIFO any more.

    python -m gpusnap.runtime.fifo_pump export FIFO PARTIAL LEVEL [--head HEAD]
    python -m gpusnap.runtime.fifo_pump import FIFO ARCHIVE [--retarget R | --head H --head-opens N]
    python -m gpusnap.runtime.fifo_pump pipe FIFO --fd FD --done DONE --head H --head-opens N [--name NAME]

export: FIFO -> (HEAD as a tar member, if the file exists then) -> zstd -T0
        -> PARTIAL. The exit status is zstd's. Renaming PARTIAL is the
        CLI's job, once Podman has succeeded: an orphaned pump leaves it.
        (A plain export needs no pump: Podman writes it, stream.export_plain.)
import: every open of FIFO gets a fresh `zstd -dc ARCHIVE` stream (a plain
        ARCHIVE as it is), or with --retarget R (JSON: remap and plan) the
        archive rewritten for other GPUs; a stream that fails (a rewrite, a
        zstd checksum) ends broken and leaves its reason beside FIFO, in pump.error. With --head, the first N opens get
        HEAD instead (config.dump and spec.dump: all Podman 4.3 reads on them).
        Every open is served whatever its number, so no count of Podman's
        opens can leave a reader waiting.
pipe:   a restore streamed from a registry: the first N opens get HEAD, the
        next one what the CLI writes into the pipe FD (the pump's copy of its
        read end), spliced on as it comes. The CLI creates DONE once the whole
        tar is in the pipe; a pipe that ends without it (a failed download, a
        CLI gone) is never handed on as an archive: the reader is killed
        before its stream ends, and once Podman is done, the container NAME it
        half-made is removed. A pipe can be read once: an open after it gets
        bytes that are no tar, so the reader fails at once instead of waiting.

The pump never ends on its own while the CLI lives: the CLI stops it, and
watches it (stream.ImportStream.check): a pump that exits early is reported
and its reader unblocked, never left in open(2).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

from gpusnap.errors import GpusnapError
from gpusnap.private import open_private
from gpusnap.runtime.stream import (BROKEN_END, OPENED, PIPE_SIZE, PUMP_ERROR, PUMP_PARENT_ENV,
                                    decompression_failed, is_zstd, tar_member)
from gpusnap.runtime.stream import widen as _widen

_SPLICE = PIPE_SIZE


def referrers(path: str) -> list[int]:
    """Processes whose command line names ``path`` (Podman's --export/--import)."""
    needle = path.encode()
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if needle in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def referenced(path: str) -> bool:
    return bool(referrers(path))


def _watchdog(fifo: str, parent: int, on_orphaned_exit=lambda: None) -> None:
    """While the CLI lives it decides; once it is gone, leave with the last user."""
    while True:
        time.sleep(0.5)
        if os.getppid() != parent and not referenced(fifo):
            on_orphaned_exit()
            os._exit(3)


def export(fifo: str, partial: str, level: str, head: str | None) -> int:
    src = os.open(fifo, os.O_RDONLY)  # returns once Podman opens it to write
    _widen(src)
    # PARTIAL is 0600 from the start (a checkpoint is process memory); zstd
    # writes to its stdout: with `-o` it would make the file itself, 0644.
    out = open_private(partial, "wb")
    with out:
        zstd = subprocess.Popen(["zstd", "-q", "-T0", f"-{level}", "-c"],
                                stdin=subprocess.PIPE, stdout=out)
    sink = zstd.stdin.fileno()
    _widen(sink)
    failed = False
    try:
        if head and os.path.isfile(head):  # written by the CRIU action script during the dump
            with open(head, "rb") as f:
                os.write(sink, tar_member(os.path.basename(head), f.read()))
        while os.splice(src, sink, _SPLICE):
            pass
    except OSError as exc:
        failed = True
        # zstd died or the disk is full. Podman 4.3 deadlocks when its export
        # write fails (its tar goroutine blocks for ever), so read on to the end
        # and let the CLI report the failure: the dump itself is kept locally.
        print(f"gpusnap export pump: {exc}", file=sys.stderr)
        _drain(src)
    finally:
        os.close(src)
        zstd.stdin.close()
    return zstd.wait() or (1 if failed else 0)


def _drain(src: int) -> None:
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        while os.splice(src, null, _SPLICE):
            pass
    except OSError:
        pass
    finally:
        os.close(null)


def _serve_one(fd: int, archive: str, error: Path) -> None:
    if not is_zstd(Path(archive)):  # a plain tar: straight from the page cache
        src = os.open(archive, os.O_RDONLY | os.O_CLOEXEC)
        try:
            while os.splice(src, fd, _SPLICE):
                pass
        except OSError:
            pass  # the reader had what it wanted and closed its end
        finally:
            os.close(src)
            os.close(fd)
        return
    _serve_zstd(fd, archive, error)


# The tail of a decompressed stream held back until zstd has checked the frame's
# checksum, which it does after writing everything: a bit flipped in a raw block
# shows only there, and a reader given the tar's end blocks first would restore it.
# The end blocks may be followed by any length of zero padding, so a run of zeros
# before the last 64 KiB is held too, as a count (memory stays bounded).
_HOLD = 64 << 10
_ZEROS = bytes(1 << 20)


class _Held:
    """What the pump has read and not yet given its reader: ``zeros`` zero bytes,
    then ``tail`` (at most _HOLD bytes)."""

    def __init__(self, fd: int) -> None:
        self.fd, self.zeros, self.tail = fd, 0, b""

    def add(self, data: bytes) -> None:
        data = self.tail + data
        cut = len(data) - _HOLD
        if cut > 0:
            # the usual read ends in data: no copy to find where its zeros start
            body = cut if data[cut - 1] else len(data[:cut].rstrip(b"\0"))
            if body:  # more than padding: what was held goes before it
                self._zeros_out()
                _write_all(self.fd, memoryview(data)[:body])
            self.zeros += cut - body
        self.tail = data[max(cut, 0):]

    def release(self) -> None:
        self._zeros_out()
        _write_all(self.fd, memoryview(self.tail))

    def _zeros_out(self) -> None:
        while self.zeros:
            n = min(self.zeros, len(_ZEROS))
            _write_all(self.fd, memoryview(_ZEROS)[:n])
            self.zeros -= n


def _serve_zstd(fd: int, archive: str, error: Path) -> None:
    """``archive`` decompressed to ``fd``; a failed check ends it broken, said in ``error``."""
    zstd = subprocess.Popen(["zstd", "-dcq", archive], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    src = zstd.stdout.fileno()
    _widen(src)
    held = _Held(fd)
    try:
        while data := os.read(src, 1 << 20):
            held.add(data)
        failed = decompression_failed(zstd)
        if failed is None:
            held.release()
            return
        with contextlib.suppress(OSError):  # said first: Podman fails as soon as it reads the end
            error.write_text(f"{archive} is damaged: zstd: {failed}")
        _write_all(fd, memoryview(BROKEN_END))
    except OSError:
        pass  # the reader had what it wanted and closed its end
    finally:
        os.close(fd)
        zstd.kill()
        zstd.wait()


def _serve_retargeted(fd: int, archive: str, retarget: str, error: Path) -> None:
    # start-up: only a --retarget import; the pump starts at every FIFO import
    from gpusnap.gpu.nodes import DeviceRemap
    from gpusnap.runtime.retarget import rewrite_archive

    try:
        spec = json.loads(Path(retarget).read_text())
        rewrite_archive(Path(archive), fd, DeviceRemap.from_dict(spec["remap"]), spec.get("plan"))
    except OSError:
        pass  # the reader had what it wanted and closed its end
    except GpusnapError as exc:
        error.write_text(exc.message)
    except Exception as exc:  # noqa: BLE001 -- said to the CLI; the stream already ends broken
        error.write_text(
            f"rewriting the archive failed: {type(exc).__name__}: {exc}")
    finally:
        os.close(fd)


def serve(fifo: str, whole: Callable[[int], None], head: str | None = None,
          head_opens: int = 0) -> int:
    """Serve each reader of FIFO: the first HEAD_OPENS get HEAD (config.dump and
    spec.dump: all Podman 4.3 reads on those opens), the others ``whole(fd)``."""
    served = 0
    while True:
        fd = os.open(fifo, os.O_WRONLY)  # returns once a reader opens it
        _widen(fd)
        # A reader may close before the end (Go's tar stops at the end marker,
        # before the padding) and open the path again at once: it must get a
        # new pipe, not the rest of the old stream. So every reader gets its
        # own FIFO: a fresh one replaces the path as soon as this one is taken.
        fresh = f"{fifo}.next"
        os.mkfifo(fresh, 0o600)
        os.replace(fresh, fifo)
        if not served:  # the CLI's watch: Podman has opened the stream
            open_private(Path(fifo).with_name(OPENED), "wb").close()
        served += 1
        if head and served <= head_opens:
            threading.Thread(target=_serve_bytes, args=(fd, Path(head).read_bytes()),
                             daemon=True).start()
        else:
            threading.Thread(target=whole, args=(fd,), daemon=True).start()


def _serve_pipe(fd: int, src: int, done: str, fifo: str, parent: int,
                cut: threading.Event) -> None:
    """What the CLI writes into the pipe ``src``, on to the reader of ``fd``.

    The pipe may end without DONE: the download failed, or the CLI is gone. A
    tar cut between two members reads as a complete, shorter archive (Go's
    reader takes a clean EOF there for the end), so the reader, Podman, is
    killed first: it must never restore from part of a checkpoint."""
    try:
        while os.splice(src, fd, _SPLICE):
            pass
    except OSError:
        pass  # the reader closed its end: past the end marker, or failing on its own
    finally:
        os.close(src)  # the CLI's next write fails: it stops downloading
        # DONE is made before the end marker is written: a reader that stops
        # at the marker, before the pipe ends, has had every member.
        if not os.path.exists(done):
            for pid in referrers(fifo):
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            if not _alive(parent):
                cut.set()
        os.close(fd)


def _serve_spent(fd: int) -> None:
    """A second whole-archive open: the pipe can be read once (Podman 4.3 does)."""
    _serve_bytes(fd, b"\xff" * 1024)  # not a tar: the reader fails, it never sees an empty one


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _remove_unfinished(name: str) -> None:
    """The container Podman made from the config before its stream was cut
    (the CLI, which removes it itself, is gone): its name was free before this
    restore, so a container under it that does not run is the restore's debris."""
    try:
        state = subprocess.run(["podman", "container", "inspect", "--format",
                                "{{.State.Status}}", name], capture_output=True, text=True,
                               timeout=60)
        if state.returncode == 0 and state.stdout.strip() != "running":
            subprocess.run(["podman", "rm", "-f", name], capture_output=True, timeout=120)
    except (OSError, subprocess.SubprocessError):
        pass


def _write_all(fd: int, view: memoryview) -> None:
    while view:
        view = view[os.write(fd, view):]


def _serve_bytes(fd: int, data: bytes) -> None:
    try:
        _write_all(fd, memoryview(data))
    except OSError:
        pass
    finally:
        os.close(fd)


def _arguments(argv: list[str]) -> argparse.Namespace:
    # Named options, not positions: an optional positional argument shifts the
    # others, and an import that dies parsing its own command line leaves Podman
    # waiting in open(2) for a writer that never comes.
    parser = argparse.ArgumentParser(prog="gpusnap.runtime.fifo_pump")
    modes = parser.add_subparsers(dest="mode", required=True)
    export_mode = modes.add_parser("export")
    export_mode.add_argument("fifo")
    export_mode.add_argument("partial")
    export_mode.add_argument("level")
    export_mode.add_argument("--head")
    import_mode = modes.add_parser("import")
    import_mode.add_argument("fifo")
    import_mode.add_argument("archive")
    import_mode.add_argument("--retarget")
    import_mode.add_argument("--head")
    import_mode.add_argument("--head-opens", type=int, default=0)
    pipe_mode = modes.add_parser("pipe")
    pipe_mode.add_argument("fifo")
    pipe_mode.add_argument("--fd", type=int, required=True)
    pipe_mode.add_argument("--done", required=True)
    pipe_mode.add_argument("--head", required=True)
    pipe_mode.add_argument("--head-opens", type=int, required=True)
    pipe_mode.add_argument("--name")
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = _arguments(argv)
    fifo = args.fifo
    # The CLI names itself: by the time we get here it may already be dead and
    # our parent init, which would then never look gone.
    parent = int(os.environ.get(PUMP_PARENT_ENV) or os.getppid())
    if args.mode == "pipe":
        # A stream cut because the CLI died leaves Podman's half-made container:
        # removed once Podman is done with the FIFO, as the CLI would have.
        cut, name = threading.Event(), args.name
        threading.Thread(target=_watchdog, daemon=True,
                         args=(fifo, parent, lambda: cut.is_set() and name and
                               _remove_unfinished(name))).start()
        once = iter([functools.partial(_serve_pipe, src=args.fd, done=args.done, fifo=fifo,
                                       parent=parent, cut=cut)])
        return serve(fifo, lambda fd: next(once, _serve_spent)(fd), args.head, args.head_opens)
    threading.Thread(target=_watchdog, args=(fifo, parent), daemon=True).start()
    if args.mode == "export":
        return export(fifo, args.partial, args.level, args.head)
    error = Path(fifo).with_name(PUMP_ERROR)
    if args.retarget:
        whole = functools.partial(_serve_retargeted, archive=args.archive, retarget=args.retarget,
                                  error=error)
    else:
        whole = functools.partial(_serve_one, archive=args.archive, error=error)
    return serve(fifo, whole, args.head, args.head_opens)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
