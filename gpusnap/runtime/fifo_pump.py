"""The process at the other end of an export or import FIFO (see stream.py).

It runs apart from the gpusnap CLI, in its own session, because Podman blocks
in open(2) on a FIFO until someone opens the other end: were the CLI killed
mid-checkpoint, Podman would hang for ever. This process outlives the CLI and
ends when no process refers to the FIFO any more.

    python -m gpusnap.runtime.fifo_pump export FIFO PARTIAL LEVEL [HEAD]
    python -m gpusnap.runtime.fifo_pump import FIFO ARCHIVE [RETARGET|- [HEAD HEAD_OPENS]]

export: FIFO -> (HEAD as a tar member, if the file exists then) -> zstd -T0
        -> PARTIAL. The exit status is zstd's. Renaming PARTIAL is the
        CLI's job, once Podman has succeeded: an orphaned pump leaves it.
        (A plain export needs no pump: Podman writes it, stream.export_plain.)
    python -m gpusnap.runtime.fifo_pump follow FIFO ARCHIVE HEAD HEAD_OPENS [NAME]

follow: a restore streamed from a registry: the first HEAD_OPENS opens get the
        small tar HEAD, later ones ARCHIVE while the CLI is still writing it;
        a CLI gone mid-way cuts the stream and, once Podman is done, removes
        the container NAME it half-made.
import: the first HEAD_OPENS opens get HEAD (config.dump and spec.dump: all
        Podman 4 reads on them); every other open of FIFO gets a fresh
        `zstd -dc ARCHIVE` stream (a plain ARCHIVE as it is), or with
        RETARGET (JSON: remap and plan) the archive rewritten for other GPUs;
        a rewrite that fails leaves its reason in RETARGET's folder, retarget.error.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

from gpusnap.private import open_private
from gpusnap.runtime.stream import (PUMP_PARENT_ENV, failed_marker, is_zstd, partial_path,
                                    tar_member)

_SPLICE = 1 << 20
_F_SETPIPE_SZ = 1031  # fcntl.F_SETPIPE_SZ, named only from Python 3.10 on Linux


def _widen(fd: int) -> None:
    """A 1 MiB pipe buffer instead of 64 KiB: several times the throughput
    for the gigabytes of a GPU checkpoint (pipe-max-size allows 1 MiB by default)."""
    import fcntl
    try:
        fcntl.fcntl(fd, _F_SETPIPE_SZ, _SPLICE)
    except OSError:
        pass


def referenced(path: str) -> bool:
    """Does any process's command line name ``path`` (Podman's --export/--import)?"""
    needle = path.encode()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if needle in (entry / "cmdline").read_bytes():
                    return True
            except OSError:
                continue
    return False


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


def _serve_one(fd: int, archive: str) -> None:
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
    zstd = subprocess.Popen(["zstd", "-dcq", archive], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL)
    _widen(zstd.stdout.fileno())
    try:
        while os.splice(zstd.stdout.fileno(), fd, _SPLICE):
            pass
    except OSError:
        pass  # the reader had what it wanted and closed its end
    finally:
        os.close(fd)
        zstd.kill()
        zstd.wait()


def _serve_retargeted(fd: int, archive: str, retarget: str) -> None:
    from gpusnap.errors import GpusnapError
    from gpusnap.gpu.nodes import DeviceRemap
    from gpusnap.runtime.retarget import rewrite_archive

    spec = json.loads(Path(retarget).read_text())
    try:
        rewrite_archive(Path(archive), fd, DeviceRemap.from_dict(spec["remap"]), spec.get("plan"))
    except OSError:
        pass  # the reader had what it wanted and closed its end
    except GpusnapError as exc:
        Path(retarget).with_name("retarget.error").write_text(exc.message)
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
        served += 1
        if head and served <= head_opens:
            threading.Thread(target=_serve_bytes, args=(fd, Path(head).read_bytes()),
                             daemon=True).start()
        else:
            threading.Thread(target=whole, args=(fd,), daemon=True).start()


def _serve_growing(fd: int, archive: str, parent: int, cut: threading.Event) -> None:
    """ARCHIVE as the CLI writes it (.ARCHIVE.partial, renamed to ARCHIVE when
    complete). A download that failed (the partial file removed, or
    .ARCHIVE.failed written) or a CLI gone ends the stream short: Podman then
    fails on a cut archive instead of waiting for ever."""
    from gpusnap.runtime.follow import GrowingFile

    final = Path(archive)
    partial, failed = partial_path(final), failed_marker(final)

    def finished() -> bool:
        if final.exists():
            return True
        if failed.exists() or src.unlinked():
            raise OSError("the download failed")
        if os.getppid() != parent and not _alive(parent):
            cut.set()
            raise OSError("gpusnap exited before the download was complete")
        return False

    src = GrowingFile([partial, final], finished)
    buf = bytearray(_SPLICE)
    try:
        while n := src.readinto(buf):
            _write_all(fd, memoryview(buf)[:n])
    except OSError:
        pass  # the reader closed its end, or the writer is gone: the stream ends short
    finally:
        src.close()
        os.close(fd)


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


def main(argv: list[str]) -> int:
    mode, fifo = argv[0], argv[1]
    # The CLI names itself: by the time we get here it may already be dead and
    # our parent init, which would then never look gone.
    parent = int(os.environ.get(PUMP_PARENT_ENV) or os.getppid())
    if mode == "follow":
        # A stream cut because the CLI died leaves Podman's half-made container:
        # removed once Podman is done with the FIFO, as the CLI would have.
        cut, name = threading.Event(), argv[5] if len(argv) > 5 else None
        threading.Thread(target=_watchdog, daemon=True,
                         args=(fifo, parent, lambda: cut.is_set() and name and
                               _remove_unfinished(name))).start()
        return serve(fifo, functools.partial(_serve_growing, archive=argv[2], parent=parent,
                                             cut=cut), argv[3], int(argv[4]))
    threading.Thread(target=_watchdog, args=(fifo, parent), daemon=True).start()
    if mode == "export":
        return export(fifo, argv[2], argv[3], argv[4] if len(argv) > 4 else None)
    archive = argv[2]
    retarget, head, opens = ([None if a == "-" else a for a in argv[3:]] + [None, None, "0"])[:3]
    whole = (functools.partial(_serve_retargeted, archive=archive, retarget=retarget)
             if retarget else functools.partial(_serve_one, archive=archive))
    return serve(fifo, whole, head, int(opens))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
