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
    python -m gpusnap.runtime.fifo_pump pipe FIFO FD DONE HEAD HEAD_OPENS [NAME]

pipe:   a restore streamed from a registry: the first HEAD_OPENS opens get the
        small tar HEAD, the next one what the CLI writes into the pipe FD (the
        pump's copy of its read end), spliced on as it comes. The CLI creates
        DONE once the whole tar is in the pipe; a pipe that ends without it (a
        failed download, a CLI gone) is never handed on as an archive: the
        reader is killed before its stream ends, and once Podman is done, the
        container NAME it half-made is removed.
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
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

from gpusnap.private import open_private
from gpusnap.runtime.stream import PIPE_SIZE, PUMP_PARENT_ENV, is_zstd, tar_member
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


def main(argv: list[str]) -> int:
    mode, fifo = argv[0], argv[1]
    # The CLI names itself: by the time we get here it may already be dead and
    # our parent init, which would then never look gone.
    parent = int(os.environ.get(PUMP_PARENT_ENV) or os.getppid())
    if mode == "pipe":
        # A stream cut because the CLI died leaves Podman's half-made container:
        # removed once Podman is done with the FIFO, as the CLI would have.
        src, done, head, opens = int(argv[2]), argv[3], argv[4], int(argv[5])
        cut, name = threading.Event(), argv[6] if len(argv) > 6 else None
        threading.Thread(target=_watchdog, daemon=True,
                         args=(fifo, parent, lambda: cut.is_set() and name and
                               _remove_unfinished(name))).start()
        once = iter([functools.partial(_serve_pipe, src=src, done=done, fifo=fifo,
                                       parent=parent, cut=cut)])
        return serve(fifo, lambda fd: next(once, _serve_spent)(fd), head, opens)
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
