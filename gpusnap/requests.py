"""Options the CLI hands to the CRIU action script of one checkpoint.

Podman runs runc with a scrubbed environment, so `gpusnap checkpoint` writes
its options to /run/gpusnap/requests/<init pid>.json; the action script
takes (reads and removes) that file.

A CLI killed before its dump (SIGKILL, the OOM killer) leaves
its requests behind, and the file names a container, not a dump: the next
dump of that container (a plain `podman container checkpoint`, another
command's) would obey options it never asked for. So the CLI's requests name
their writer, which waits for its dump, and the init they are for
(``put_for_dump``); pre-dump drops, unobeyed, one whose writer is gone
(``for_dump``). containerd's bound requests (``put_bound``) are the shim's and
its client's, bound to the init's start time instead.
"""

from __future__ import annotations

import json
import os

from gpusnap import journal
from gpusnap.private import write_private
from gpusnap.procs import ancestors, runs_as, start_time


# Bound requests (put_bound) about one containerd task, by its init's pid:
# QUIESCED: gpusnap's containerd client quiesced the task's GPU before pausing
# it (ops/containerd_gpu.py): {"manifest": {...}, "pids": [...]}. The shim then
# keeps the task paused for the dump; pre-dump takes it, writes that manifest
# and quiesces nothing.
QUIESCED = "quiesced"
# HELD: the shim thawed a task the client had paused, for the driver's lock,
# and pauses it again after the dump for the client, which resumes it (the rw
# diff may come after the dump). The guardian gives the GPUs back only once
# the shim's Resume has dropped it.
HELD = "held"


def _path(init_pid: int, kind: str = ""):
    """``kind``: a request for another step than pre-dump ("pages": post-dump's)."""
    return journal.state_subdir("requests") / f"{init_pid}{'.' + kind if kind else ''}.json"


def put(init_pid: int, kind: str = "", **options) -> None:
    write_private(_path(init_pid, kind), json.dumps(options))


def take(init_pid: int, kind: str = "") -> dict:
    path = _path(init_pid, kind)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    path.unlink(missing_ok=True)
    return data if isinstance(data, dict) else {}


def peek(init_pid: int, kind: str = "") -> dict:
    """A request as ``take`` reads it, left for a later step to take."""
    try:
        data = json.loads(_path(init_pid, kind).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def drop(init_pid: int, kind: str = "") -> None:
    _path(init_pid, kind).unlink(missing_ok=True)


def drop_own(init_pid: int, kind: str = "") -> None:
    """This process's put_for_dump request, dropped; another command's, which
    replaced it while both waited on Podman's lock, stays for its dump."""
    if peek(init_pid, kind).get("writer") == os.getpid():
        drop(init_pid, kind)


def put_for_dump(init_pid: int, kind: str = "", **options) -> None:
    """A request for the next dump of the container whose init is ``init_pid``,
    named for its writer (this process, which waits for that dump) and for that
    init (start times both): pre-dump obeys it only while both are (for_dump)."""
    me = os.getpid()
    put(init_pid, kind, writer=me, writer_started=start_time(me),
        init_started=start_time(init_pid), **options)


def stale(init_pid: int, request: dict, images: str = "") -> str | None:
    """Why a put_for_dump ``request`` is not the current dump's, in words;
    None where it is. ``images``: that dump's folder, where the request names
    one (a pages request: its ``images``)."""
    writer = request.get("writer")
    if not isinstance(writer, int):
        return "it names no writer"
    if not runs_as(writer, request.get("writer_started")):
        return f"its writer (pid {writer}) is gone: killed before this dump"
    if request.get("init_started") != start_time(init_pid):
        return "it is for an earlier process under the init's pid"
    if images and request.get("images") and not _same_folder(images, request["images"]):
        return f"it is for a dump into {request['images']}"
    return None


def _started_by(writer: int) -> bool:
    """Whether this process (pre-dump: CRIU's action script) descends from
    ``writer``: the CLI's Podman runs the runtime, which runs CRIU. A plain
    `podman container checkpoint` run meanwhile by someone else does not."""
    return writer in ancestors(os.getpid())


def _same_folder(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def for_dump(init_pid: int, kind: str = "", images: str = "") -> dict:
    """A put_for_dump request of the current dump, left for its step to take;
    {} where there is none, or it is ``stale`` (dropped then, journaled: no
    later dump may obey it either)."""
    found = peek(init_pid, kind)
    if not found:
        return {}
    writer = found.get("writer")
    if isinstance(writer, int) and runs_as(writer, found.get("writer_started")) \
            and not _started_by(writer):
        # someone's plain checkpoint took Podman's lock first (into this folder
        # or another: -P's): the request stays for the dump its writer waits for
        journal.record("request-left", init_pid=init_pid, kind=kind or "options",
                       why=f"its writer (pid {writer}) waits for a dump of its own, "
                       "not this one", writer=writer)
        return {}
    why = stale(init_pid, found, images)
    if why is None:
        return found
    drop(init_pid, kind)
    journal.record("request-dropped", init_pid=init_pid, kind=kind or "options", why=why,
                   writer=found.get("writer"))
    return {}


def take_for_dump(init_pid: int, kind: str = "", images: str = "") -> dict:
    """for_dump's request, taken: the step that obeys it is its last reader."""
    found = for_dump(init_pid, kind, images)
    if found:
        drop(init_pid, kind)
    return found


def put_bound(init_pid: int, kind: str, **data) -> None:
    """A request bound to the process that has ``init_pid`` now (its start time)."""
    put(init_pid, kind, started=start_time(init_pid), **data)


def bound(init_pid: int, kind: str, consume: bool = False) -> dict:
    """A put_bound request of this very process: one left for an earlier
    process under the same pid (its writer killed before it could drop it) is
    dropped, not obeyed. ``consume``: taken (the writer may check it was)."""
    found = take(init_pid, kind) if consume else peek(init_pid, kind)
    if found and found.get("started") != start_time(init_pid):
        drop(init_pid, kind)
        return {}
    return found


def held(init_pid: int) -> bool:
    """A HELD request of this very task whose holder (the shim that wrote it)
    still runs: one whose shim died before its Resume is dropped, not waited on."""
    found = bound(init_pid, HELD)
    if not found:
        return False
    holder = found.get("holder")
    if holder is not None and start_time(int(holder)) != found.get("holder_started"):
        drop(init_pid, HELD)
        return False
    return True
