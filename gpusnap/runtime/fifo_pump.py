"""The process at the other end of an export or import FIFO (see stream.py).

It runs apart from the gpusnap CLI, in its own session, because Podman blocks
in open(2) on a FIFO until someone opens the other end: were the CLI killed
mid-checkpoint, Podman would hang for ever. This process outlives the CLI and
ends when no process refers to the FIFO any more.

    python -m gpusnap.runtime.fifo_pump export FIFO PARTIAL LEVEL [HEAD]
    python -m gpusnap.runtime.fifo_pump import FIFO ARCHIVE [RETARGET]

export: FIFO -> (HEAD as a tar member, if the file exists then) -> zstd -T0
        -> PARTIAL. The exit status is zstd's. Renaming PARTIAL is the
        CLI's job, once Podman has succeeded: an orphaned pump leaves it.
import: every open of FIFO gets a fresh `zstd -dc ARCHIVE` stream, or with
        RETARGET (JSON: remap and plan) the archive rewritten for other GPUs;
        a rewrite that fails leaves its reason in RETARGET's folder, retarget.error.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from gpusnap.runtime.stream import PUMP_PARENT_ENV, tar_member

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


def _watchdog(fifo: str, parent: int) -> None:
    """While the CLI lives it decides; once it is gone, leave with the last user."""
    while True:
        time.sleep(0.5)
        if os.getppid() != parent and not referenced(fifo):
            os._exit(3)


def export(fifo: str, partial: str, level: str, head: str | None) -> int:
    src = os.open(fifo, os.O_RDONLY)  # returns once Podman opens it to write
    _widen(src)
    zstd = subprocess.Popen(["zstd", "-q", "-T0", f"-{level}", "-f", "-o", partial],
                            stdin=subprocess.PIPE)
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
        # zstd died (disk full). Podman 4.3 deadlocks when its export write
        # fails (its tar goroutine blocks for ever), so read on to the end and
        # let the CLI report the failure: the dump itself is kept locally.
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


def serve(fifo: str, archive: str, retarget: str | None = None) -> int:
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
        if retarget:
            threading.Thread(target=_serve_retargeted, args=(fd, archive, retarget),
                             daemon=True).start()
        else:
            threading.Thread(target=_serve_one, args=(fd, archive), daemon=True).start()


def main(argv: list[str]) -> int:
    mode, fifo = argv[0], argv[1]
    # The CLI names itself: by the time we get here it may already be dead and
    # our parent init, which would then never look gone.
    parent = int(os.environ.get(PUMP_PARENT_ENV) or os.getppid())
    threading.Thread(target=_watchdog, args=(fifo, parent), daemon=True).start()
    if mode == "export":
        return export(fifo, argv[2], argv[3], argv[4] if len(argv) > 4 else None)
    return serve(fifo, argv[2], argv[3] if len(argv) > 3 else None)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
