"""Checkpoint a Podman container, GPU-aware through the installed CRIU action script."""

from __future__ import annotations

import os
import shutil
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

from gpusnap import MANIFEST_NAME, archive, journal, requests
from gpusnap.pages import pages_aside, remote_syscall
from gpusnap.criu import dumped
from gpusnap.criu.freezer import thaw
from gpusnap.criu.log import (ended_early, first_error as criu_error, seize_blocked,
                              unseizable_words)
from gpusnap.criu.runtimes import TRUST_ENV, runs_action_script, why_not
from gpusnap.criu.version import (INET_SOCKETS_LOG, criu_version, cuda_plugin_path,
                                  inet_sockets_problem, require_supported)
from gpusnap.errors import GpusnapError
from gpusnap.gpu.inventory import read_inventory
from gpusnap.ops import frozen, moving
from gpusnap.ops.gpu_state import ensure_running
from gpusnap.ops.snapshot_files import unrestorable
from gpusnap.ops.preconditions import has_checkpoint, require_running
from gpusnap.private import restrict_tree
from gpusnap.procs import ProcessGpuUse, cuda_processes, process_tree, rss_bytes
from gpusnap.runtime import podman
from gpusnap.runtime.storage import discard
from gpusnap.runtime.stream import export_fifo, export_plain
from gpusnap.tarstream import DamagedStream

# zstd -1 with all cores: the checkpoint disk is the limit from there on, and
# -3 saves little of a CUDA checkpoint's size (docs/benchmarks.md).
EXPORT_ZSTD_LEVEL = 1


@dataclass
class CheckpointPlan:
    container: podman.Container
    cuda: list[ProcessGpuUse]
    export: Path | None
    leave_running: bool
    tcp_established: bool
    lock_timeout_ms: int
    estimate_bytes: int  # host memory + GPU memory in use: an upper bound of the dump
    keep: bool = False  # keep the local checkpoint files after an export (podman --keep)
    export_level: int = EXPORT_ZSTD_LEVEL  # 0: the plain tar, for a push that follows it
    # A push's folder on the images' filesystem: the memory pages are moved
    # there once dumped, out of Podman's export (pages/pages_aside.py).
    pages_aside: Path | None = None
    # That folder is in RAM: CRIU writes the pages there through links made
    # before the dump (pages_aside.prelink; pages/memory.py).
    pages_prelinked: bool = False
    # Files in that RAM the read-ahead writes over (pre-copy round 1's: pages/kept_pages.py).
    pages_reuse: list[str] = field(default_factory=list)
    gpu_bytes: int = 0  # of ``estimate_bytes``: what the driver moves into host memory first
    # A --leave-running export that would not restore is taken again here; a
    # push that uploads the export as Podman writes it takes it again itself.
    retake_stale: bool = True
    # A pre-copy round only warms the target's cache, and is never restored:
    # its open files need no check.
    check_files: bool = True
    # When the last try began and Podman was done with it: the guardian's
    # verdict on this dump is told from a later one's by them (ops/gpu_back.py).
    dumped: tuple[float, float] | None = None


def _free_bytes(path: Path) -> int:
    return shutil.disk_usage(path).free


def plan(name: str, export: str | None, leave_running: bool, tcp_established: bool,
         lock_timeout_ms: int, skip_space_check: bool = False,
         export_level: int = EXPORT_ZSTD_LEVEL,
         container: podman.Container | None = None) -> CheckpointPlan:
    """``container``: ``name`` as the caller just inspected it."""
    container = container or podman.inspect(name)
    require_running(container, "be checkpointed")
    require_supported("checkpoint")
    export_path = Path(export).absolute() if export else None
    if export_path is not None:
        if not export_path.parent.is_dir():
            raise GpusnapError(f"cannot export to {export_path}: {export_path.parent} does not exist")
        if not os.access(export_path.parent, os.W_OK):
            raise GpusnapError(f"cannot export to {export_path}: {export_path.parent} is not writable")
        if export_path.is_dir():  # found out only after the dump otherwise: refused before it
            raise GpusnapError(f"cannot export to {export_path}: it is a folder; the container "
                               "keeps running", f"pass a file, e.g. {export_path / name}.tar.zst")
    cuda = cuda_processes(container.pid)
    gpu_bytes = 0
    # a frozen one's GPU memory is in its processes' host memory, and its manifest
    # would name no GPU: nothing a restore could check or place
    frozen.refuse(container.name, cuda, "be checkpointed: its GPU state is not on a GPU")
    if cuda:  # a move cut off: its processes off their GPUs, its nodes maybe half-changed
        moving.refuse(container.pid, container.name, "be checkpointed", holding_turn=False)
    if cuda and not runs_action_script(container.runtime) and cuda_plugin_path() is None:
        raise GpusnapError(f"{container.name} has CUDA processes and runs under "
                           f"{container.runtime}: {why_not(container.runtime)} and its GPU "
                           "could not be quiesced; the container keeps running",
                           "run it with `podman run --runtime runc`, or install crun >= 1.26 "
                           f"and libcriu >= 4.2 ({TRUST_ENV}=1 where the probe misjudges)")
    if cuda:
        inv = read_inventory()
        gpu_bytes = sum(sum(inv.process_memory.get(p.pid, {}).values()) for p in cuda)
    estimate = rss_bytes(process_tree(container.pid)) + gpu_bytes
    if not skip_space_check:
        require_space([container.userdata] + ([export_path.parent] if export_path else []),
                      estimate)
    return CheckpointPlan(container, cuda, export_path, leave_running, tcp_established,
                          lock_timeout_ms, estimate, export_level=export_level,
                          gpu_bytes=gpu_bytes)


def require_space(targets: list[Path], needed: int) -> None:
    """Each folder has ``needed`` bytes free, or the dump is refused before it starts."""
    for target in targets:
        free = _free_bytes(target)
        if free < needed:
            raise GpusnapError(
                f"not enough disk space in {target}: the checkpoint needs up to "
                f"{needed >> 20} MiB, {free >> 20} MiB are free; the container keeps running",
                "free space or export elsewhere (--skip-space-check tries anyway)")


def _action_failure(init_pid: int, since: float) -> dict | None:
    """What the CRIU action script said (its journal event) during this dump
    (``since`` its start: an earlier dump's refusal is not this one's), when
    it was what stopped the dump."""
    for event in reversed(journal.read(50)):
        if event.get("event") == "failed" and str(event.get("init_pid")) == str(init_pid) \
                and float(event.get("at") or 0) >= since - 1:
            return event
    return None


def _why_dump_failed(p: CheckpointPlan, said: str, hint: str | None, log: Path | None,
                     since: float = 0.0) -> tuple[str, str | None, str | None, Path | None]:
    """The failure in words, the hint to give, CRIU's first error where it had
    one, and where its log is kept. ``said``: Podman's error, the cause where
    neither the action script nor CRIU failed (a full disk): CRIU's log is then
    neither kept nor named. ``log``: CRIU's log of this dump."""
    action = _action_failure(p.container.pid, since)
    criu = criu_error(log) if log else None
    if action and action.get("refused"):  # pre-dump said no before anything was touched
        return action["error"], action.get("hint") or hint, None, None
    if action:
        message = f"GPU quiesce failed: {action['error']}"
    elif criu:
        message = f"CRIU could not dump {p.container.name}: {criu}"
    elif log and ended_early(log):
        message = (f"CRIU stopped before the dump of {p.container.name} was complete (its "
                   "log ends mid-way, with no error: killed?)")
    else:
        return said, hint, None, None
    kept = journal.keep_log(log, "dump", p.container.name) if log else None
    if kept is not None:  # the next dump or `podman rm` takes Podman's copy
        message += f" (CRIU's log is kept in {kept})"
    return message, hint, criu, kept


def _dump(p: CheckpointPlan) -> None:
    """Podman dumps; an export goes through a FIFO to multi-threaded zstd.

    The local checkpoint is kept (--keep) until the export is complete, so a
    failed export (disk full) leaves a container that `gpusnap restore CTR`
    brings back. For GPU containers the GPU manifest is also put first in the
    archive, so restore checks it without reading gigabytes of memory pages.
    """
    if p.export is None:
        podman.checkpoint(p.container.id, None, p.leave_running, p.tcp_established, keep=p.keep)
        return
    journal.record("export-started", container=p.container.id, export=str(p.export))
    if p.export_level == 0:  # the plain tar, for a push that follows it (and adds the head)
        with export_plain(p.export) as target:
            podman.checkpoint(p.container.id, target, p.leave_running, p.tcp_established,
                              keep=True, compress="none")
        return
    head = p.container.checkpoint_dir / MANIFEST_NAME
    with export_fifo(p.export, p.export_level, head) as stream:
        podman.checkpoint(p.container.id, stream.path, p.leave_running, p.tcp_established,
                          keep=True, compress="none", watch=stream.check)


def drop_local(userdata: Path) -> None:
    """What Podman removes after an export when --keep is not given (the
    images are deleted in the background: storage.discard)."""
    discard(userdata / "checkpoint", userdata)
    for name in ("dump.log", "stats-dump", "config.dump", "spec.dump"):
        (userdata / name).unlink(missing_ok=True)


def _written_since(path: Path, since: float) -> Path | None:
    """``path`` if this run wrote it: a failure before CRIU ran leaves the last
    dump's files in place (its log's error is not this one's)."""
    try:
        return path if path.stat().st_mtime >= since - 1 else None
    except OSError:
        return None


def _drop_stale_dump(ctr: podman.Container, since: float) -> None:
    """A dump this run wrote (kept for the export) of a container that runs on
    (--leave-running) is stale, and as large as its memory: free the space. An
    older local checkpoint, made on purpose, is left alone."""
    if _written_since(ctr.checkpoint_dir / dumped.INVENTORY, since):
        discard(ctr.checkpoint_dir, ctr.userdata)


def ahead_tasks(p: CheckpointPlan) -> int:
    """How many processes a dump that stops the container would have read ahead
    (_read_ahead): the CUDA ones, where gpusnap quiesces them itself. Tests:
    with GPUSNAP_DUMP_AHEAD_TEST_MIN, the container's processes."""
    if os.environ.get("GPUSNAP_DUMP_AHEAD", "1") == "0" or cuda_plugin_path() is not None \
            or not remote_syscall.supported():
        return 0
    if os.environ.get("GPUSNAP_DUMP_AHEAD_TEST_MIN", "").isdigit():
        return len(process_tree(p.container.pid))
    return len(p.cuda)


def _read_ahead(p: CheckpointPlan) -> dict:
    """Whether pre-dump reads the driver's copy of GPU memory into the push's
    RAM folder itself, on many threads (pages/dump_ahead.py; GPUSNAP_DUMP_AHEAD=0:
    CRIU dumps it itself). Only where the dump stops the container: one
    that runs on needs that memory back before the driver restores it, and
    writing all of it back costs pre-copy's round 1 more than CRIU's dump
    saves (docs/benchmarks.md). GPUSNAP_DUMP_AHEAD_TEST_MIN is for the tests: a
    CPU container's anonymous areas of at least that many bytes are taken too,
    and GPUSNAP_DUMP_AHEAD_TEST_FAULT=compose makes post-dump fail there."""
    if not p.pages_prelinked or p.leave_running or os.environ.get("GPUSNAP_DUMP_AHEAD", "1") == "0":
        return {}
    out: dict = {"read_ahead": True, "reuse": p.pages_reuse}
    test_min = os.environ.get("GPUSNAP_DUMP_AHEAD_TEST_MIN", "")
    if test_min.isdigit():
        out["ahead_test_min"] = int(test_min)
        out["fault"] = os.environ.get("GPUSNAP_DUMP_AHEAD_TEST_FAULT", "")
    return out


# A --leave-running export taken again while its open files changed under it:
# the race is a few milliseconds wide, so a third miss means the workload
# renames what it holds open all the time.
SNAPSHOT_TRIES = 3


class _Stale(Exception):
    def __init__(self, files: list[str]) -> None:
        super().__init__(files)
        self.files = files


class TakeAgain(GpusnapError):
    """A checkpoint that met a race another try is likely to miss; the container
    is still running. Not taken again here where the plan leaves that to its
    taker (CheckpointPlan.retake_stale: a push that streams the export)."""


class StaleSnapshot(TakeAgain):
    """A --leave-running checkpoint that would not restore."""

    def __init__(self, name: str, files: list[str]) -> None:
        super().__init__(f"the checkpoint of {name} would not restore: {_stale_words(files)}")
        self.files = files


class SeizeBlocked(TakeAgain):
    """CRIU could not seize a task that stayed uninterruptible through its
    freeze (criu.log.seize_blocked); nothing was dumped."""

    def __init__(self, name: str, pid: int, kept: Path | None) -> None:
        log = f" (CRIU's log is kept in {kept})" if kept else ""
        super().__init__(f"{unseizable_words(pid, name)}{log}; the container is still running",
                         "checkpoint it again: the window is a few milliseconds wide")
        self.pid = pid

    def refusal(self) -> GpusnapError:
        """This one line once SNAPSHOT_TRIES tries met it (checkpoint's and push's)."""
        return GpusnapError(f"{self.message} ({SNAPSHOT_TRIES} tries)", self.hint)


def gave_up(last: TakeAgain | None, name: str, changed: list[str], undone: str,
            first_hint: str) -> GpusnapError:
    """The one line once SNAPSHOT_TRIES tries failed (checkpoint's and push's).
    Where any try met open files renamed under it, that is the line, whatever
    the last try met: another try would meet them again, and a task caught
    uninterruptible (a few milliseconds' window) is only what the last met."""
    if not changed and isinstance(last, SeizeBlocked):
        return last.refusal()
    return _stale_refusal(name, changed, undone, first_hint)


def _stale_refusal(name: str, files: list[str], undone: str, first_hint: str) -> GpusnapError:
    """One line for a --leave-running checkpoint whose open files changed before
    Podman wrote the root filesystem into its export."""
    return GpusnapError(
        f"the checkpoint of {name} would not restore: {_stale_words(files)} "
        f"({SNAPSHOT_TRIES} tries); the container is still running, {undone}",
        f"{first_hint} (it stops, its files stay as dumped), or at a moment it is not "
        "renaming the files it holds open")


def _stale_words(files: list[str]) -> str:
    """ops/snapshot_files.py's findings in words: open files by their paths, and
    a root filesystem Podman archived damaged as it is."""
    opened = [f for f in files if f.startswith("/")]
    words = [f"{', '.join(opened[:3])}, open at the dump, changed before Podman wrote the "
             "root filesystem"] if opened else []
    return "; ".join(words + [f for f in files if not f.startswith("/")])


def _stale_files(p: CheckpointPlan) -> list[str]:
    """What a --leave-running export lacks of the files open at its dump
    (ops/snapshot_files.py)."""
    if not (p.check_files and p.leave_running) or p.export is None:
        return []
    try:
        return unrestorable(p.container.userdata, p.export, p.container.lower_dirs)
    except (OSError, ValueError, tarfile.TarError, DamagedStream) as exc:  # cannot read: say so
        journal.record("snapshot-check-skipped", container=p.container.id, error=str(exc))
        return []


def run(p: CheckpointPlan) -> dict:
    """Checkpoint as planned. A race another try is likely to miss (TakeAgain: a
    --leave-running export whose open files changed before Podman wrote the
    root filesystem, a task CRIU could not seize) takes it again, up to
    SNAPSHOT_TRIES, or is raised where the plan leaves that to its taker."""
    changed: list[str] = []
    last: TakeAgain | None = None
    for attempt in range(1, SNAPSHOT_TRIES + 1):
        try:
            result = _run_once(p)
        except _Stale as stale:
            journal.record("checkpoint-stale", container=p.container.id, files=stale.files,
                           attempt=attempt)
            drop_local(p.container.userdata)
            last = StaleSnapshot(p.container.name, stale.files)
            changed = stale.files
        except SeizeBlocked as blocked:
            journal.record("checkpoint-unseizable", container=p.container.id, pid=blocked.pid,
                           attempt=attempt)
            last = blocked
        else:
            if attempt > 1:
                result["retaken"] = {"tries": attempt, "files": changed}
            return result
        if not p.retake_stale:
            raise last from None
    _gave_up(p, last, changed)


def _after_failure(p: CheckpointPlan, started_at: float) -> tuple[str, list[int]]:
    """What a dump that failed or was interrupted left, put back: its requests
    dropped, a cgroup CRIU left frozen thawed, the GPU state given back, a stale
    dump's files and links dropped where the container runs. (its state, the
    pids resumed here)"""
    requests.drop_own(p.container.pid)
    requests.drop_own(p.container.pid, "pages")
    state = _state(p.container.id)
    if state == "running" and thaw(p.container.pid):
        # a CRIU killed mid-dump leaves the cgroup frozen, and the runtime does not thaw it
        journal.record("thawed", container=p.container.id, why="CRIU ended with it frozen")
    try:
        resumed = ensure_running(p.container.pid, [c.pid for c in p.cuda])
    except GpusnapError as given_back:  # the dump's failure stays the line; this is journaled
        journal.record("resume-failed", init_pid=p.container.pid, error=given_back.message)
        resumed = []
    if state == "running":
        _drop_stale_dump(p.container, started_at)
        if p.pages_prelinked:
            pages_aside.drop_links(p.container.checkpoint_dir, p.pages_aside)
    return state, resumed


def _state(container_id: str) -> str:
    return podman.inspect(container_id).status if podman.exists(container_id) else "gone"


def interrupted(p: CheckpointPlan, state: str | None = None) -> GpusnapError:
    """The line of a dump that a Ctrl-C ended: where the container is (its
    ``state``, read again where not given) and the way back."""
    where, hint = _where(p, state or _state(p.container.id), "`gpusnap doctor` checks what is left")
    return GpusnapError(f"interrupted (Ctrl-C); {where}", hint, exit_code=130)


def _where(p: CheckpointPlan, state: str, hint: str | None) -> tuple[str, str | None]:
    """Where the container is after a failed dump, and the hint with the way back."""
    if state == "running":
        return "the container is still running", hint
    if has_checkpoint(p.container):
        return (f"the container is {state}, its checkpoint is kept locally",
                f"`gpusnap restore {p.container.name}` brings it back; " + (hint or ""))
    return f"the container is {state}; what was dumped stays in {p.container.checkpoint_dir}", hint


def _gave_up(p: CheckpointPlan, last: TakeAgain | None, changed: list[str]) -> NoReturn:
    if p.export is not None:
        p.export.unlink(missing_ok=True)
    raise gave_up(last, p.container.name, changed, "nothing was exported",
                  "checkpoint it without --leave-running") from None


def _run_once(p: CheckpointPlan) -> dict:
    start, started_at = time.monotonic(), time.time()
    # named for this process, which waits for the dump: killed before it, they
    # are dropped by the next dump's pre-dump, not obeyed (requests.for_dump)
    if p.cuda:
        requests.put_for_dump(p.container.pid, lock_timeout_ms=p.lock_timeout_ms)
    if p.pages_aside is not None:
        # A few links per task: each task's memory and each shared segment
        # takes one pages image; names past these are written to the disk.
        links = 4 * len(process_tree(p.container.pid)) + 32 if p.pages_prelinked else 0
        # ``prelink``: pre-dump makes them again where another's dump, run
        # while this one waited on Podman's lock, dropped them
        requests.put_for_dump(p.container.pid, "pages", images=str(p.container.checkpoint_dir),
                              aside=str(p.pages_aside), prelink=links, **_read_ahead(p))
        if links:
            p.container.checkpoint_dir.mkdir(mode=0o700, exist_ok=True)
            pages_aside.prelink(p.container.checkpoint_dir, p.pages_aside, links)
    try:
        _dump(p)
    except KeyboardInterrupt:  # the same clean-up as a failure's, and its words
        state, _ = _after_failure(p, started_at)
        raise interrupted(p, state) from None
    except GpusnapError as exc:
        state, resumed = _after_failure(p, started_at)
        where, hint = _where(p, state, exc.hint)
        log = _written_since(p.container.userdata / "dump.log", started_at)
        message, hint, criu, kept = _why_dump_failed(p, exc.message, hint, log, started_at)
        blocked = seize_blocked(log) if log and state == "running" else None
        sockets = inet_sockets_problem(criu_version()) if criu and INET_SOCKETS_LOG in criu \
            else None
        if sockets:  # every container with a TCP or UDP socket: say why, and the fix
            hint = f"{sockets}: run `make deps` (CRIU 4.2); {hint or ''}"
        journal.record("checkpoint-failed", container=p.container.id, error=message,
                       resumed=resumed)
        if blocked is not None:
            raise SeizeBlocked(p.container.name, blocked, kept) from None
        raise GpusnapError(f"{message}; {where}", (hint or "").rstrip("; ") or None) from None
    p.dumped = (started_at, time.time())
    requests.drop_own(p.container.pid)  # not taken where no action script ran
    requests.drop_own(p.container.pid, "pages")
    stale = _stale_files(p)
    if stale:
        raise _Stale(stale)
    seconds = time.monotonic() - start
    contents = archive.read_directory(p.container.userdata)
    if p.export is not None and not p.keep:
        drop_local(p.container.userdata)
    elif p.container.checkpoint_dir.is_dir():
        # CRIU writes its images 0644 (in runc's checkpoint/, in Podman's 0700
        # userdata/): root only, even should the folder above be opened up.
        restrict_tree(p.container.checkpoint_dir)
    journal.record("checkpointed", container=p.container.id, export=str(p.export or ""),
                   leave_running=p.leave_running, seconds=round(seconds, 3))
    result = contents.summary()
    result.update({"container": {"id": p.container.id, "name": p.container.name},
                   "export": str(p.export) if p.export else None,
                   "leave_running": p.leave_running, "seconds": round(seconds, 3),
                   "export_bytes": p.export.stat().st_size if p.export else None})
    return result
