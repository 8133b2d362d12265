"""A running Podman container as a push's source: checkpointed into a staged
plain tar that the push reads while Podman writes it.

CRIU's memory pages stay out of that tar (pages/pages_aside.py): moved beside
it after the dump, or written into RAM through links made before it
(pages/memory.py). Every failure leaves the container running, or stopped
with a checkpoint that restores: the export made whole, or the local one.
"""

from __future__ import annotations

import os
import shutil
import tarfile
import tempfile
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from gpusnap import MANIFEST_NAME, journal
from gpusnap.pages import pages_aside
from gpusnap.gpu.quiesce import DEFAULT_LOCK_TIMEOUT_MS
from gpusnap.criu.runtimes import runs_action_script
from gpusnap.errors import GpusnapError
from gpusnap.ops import checkpoint as ops_checkpoint
from gpusnap.ops import gpu_back
from gpusnap.pages import early_pages, kept_pages, prefetch, prepared_pages
from gpusnap.ops.push_source import (PushSource, cause, kept_error, mark_only_copy,
                                     push_again_words)
from gpusnap.runtime import podman
from gpusnap.pages import memory
from gpusnap.runtime.follow import follow
from gpusnap.runtime.storage import PUSH_PREFIX, discard, staging_dir
from gpusnap.partial import partial_path
from gpusnap.runtime.stream import tar_member


def _push_source(plan: ops_checkpoint.CheckpointPlan, export: Path, job: Future, stream: bool,
                 pages_aside_in_ram: Path | None) -> PushSource:
    """The export as the push reads it: followed while Podman writes it (``stream``)."""
    back = gpu_back.expected(plan.leave_running, bool(plan.cuda), plan.container.runtime)
    job.add_done_callback(lambda _: memory.let_go())  # dumped: its pages are in RAM or not at all
    return PushSource("container", export, plan.estimate_bytes, plan.estimate_bytes,
                      container=plan.container.name,
                      follow=(lambda: follow([partial_path(export), export], job.done,
                                             head=_manifest_member(plan))) if stream else None,
                      finish=job.result,
                      userdata=plan.container.userdata if stream else None,
                      writer_done=job.done, pages_aside=pages_aside_in_ram,
                      gpu_back=(lambda: _gpu_back(plan)) if back else None)


def _gpu_back(plan: ops_checkpoint.CheckpointPlan) -> dict:
    """The guardian's verdict on a leave-running push's GPUs (long given back, by
    the end of an upload, but said: a failure was in the journal only)."""
    try:
        return gpu_back.wait(plan.container.pid, plan.container.name, *plan.dumped).fields()
    except KeyboardInterrupt:  # the push is done: said, not lost behind Ctrl-C
        return gpu_back.not_waited(plan.container.name).fields()


@contextmanager
def checkpointed(source: str, leave_running: bool, on_checkpoint: Callable[[str], None] | None,
                 stream: bool, container: podman.Container,
                 on_checkpointed: Callable[[dict], None] | None,
                 pre_checkpoint: bool = False,
                 push_again: Callable[[str], str] = push_again_words) -> Iterator[PushSource]:
    """``container`` checkpointed into a staged plain tar; with ``stream`` the
    push reads that tar while Podman still writes it (upload overlaps the
    dump), else once it is complete. ``on_checkpointed``: called once the
    checkpoint succeeded (see push()). ``pre_checkpoint``: a pre-copy's round
    1, its pages kept for the final round's read-ahead (pages/kept_pages.py).
    ``push_again``: the retry of this push, for a path (its reference and flags)."""
    kept_pages.sweep()
    # Only where CRIU runs gpusnap's action script, which moves them (criu/runtimes.py).
    sets_aside = stream and pages_aside.enabled() and runs_action_script(container.runtime)
    # The export holds the pages only where they are not set aside: then it
    # needs the roomiest place (an export that holds the pages is larger than
    # the GPU memory and can fill the disk beside Podman's storage, where the
    # set-aside export needs a few MB).
    root = _work_root(container) if sets_aside else staging_dir(0, container.graph_root)
    work = Path(tempfile.mkdtemp(prefix=PUSH_PREFIX, dir=root))
    # Plain, not zstd: the chunks are compressed one by one anyway, so a
    # compressed export would be compressed twice and decompressed once more.
    export = work / "checkpoint.tar"
    aside: Path | None = None  # where CRIU's memory pages go, out of Podman's export
    in_ram = False
    stopped = False  # the container is down and this archive is all that is left of it
    again, back = push_again(str(export)), f"`podman rm {source}; gpusnap restore {export}`"
    job: Future | None = None
    pool = ThreadPoolExecutor(1, thread_name_prefix="gpusnap-checkpoint")
    try:
        # The disk's room is checked below, once it is known whether the pages go to RAM.
        plan = ops_checkpoint.plan(source, str(export), leave_running, False,
                                   DEFAULT_LOCK_TIMEOUT_MS, skip_space_check=True,
                                   export_level=0, container=container)
        # streamed: not taken again under the upload, but refused to push(), which retakes it all
        plan.retake_stale, plan.check_files = not stream, not pre_checkpoint
        aside, in_ram = _place_pages(plan, work, root, sets_aside)
        back_now = back if aside is None else _back_aside(source, aside)  # the export links them
        if not leave_running:  # the export, or the local checkpoint and its pages aside
            mark_only_copy(work, source, export, f"`{again}`", back_now,
                           holds=(aside,) if aside is not None else ())
        if on_checkpoint:
            on_checkpoint(plan.container.name)
        if stream:
            _clear_stale(plan.container)
        job = pool.submit(ops_checkpoint.run, plan)
        if on_checkpointed:
            job.add_done_callback(_when_checkpointed(on_checkpointed, plan, export, aside,
                                                     {"again": again, "back": back_now}))
        try:
            if not stream:
                job.result()
            yield _push_source(plan, export, job, stream, aside if stream and in_ram else None)
        except BaseException as exc:
            # The dump goes on to its end whatever the upload did: what is left
            # of the container decides what to say.
            _dump_ended(job, plan, isinstance(exc, KeyboardInterrupt) and not leave_running)
            stopped = not leave_running
            raise
        job.result()
        stopped = not leave_running
    except (Exception, KeyboardInterrupt) as exc:  # noqa: BLE001 -- any: where it is kept
        if not stopped:
            raise
        if aside is not None:  # the export alone must restore anywhere: pages into it
            _make_export_whole(exc, source, export, aside, container)
            mark_only_copy(work, source, export, f"`{again}`", back)
        raise kept_error(exc, source, f"in {export}", str(export), back) from None
    else:
        _pushed(plan, work, aside, in_ram, pre_checkpoint)
        work = None
    finally:
        pool.shutdown(wait=True)
        # a second Ctrl-C may have left the handler above before it knew the dump stopped it
        if work is not None and not stopped and not _stopped_it(job, leave_running):
            needed = aside is not None and _local_checkpoint_after_failure(container, aside)
            shutil.rmtree(work, ignore_errors=True)
            if in_ram and not needed:
                shutil.rmtree(aside, ignore_errors=True)


def _dump_ended(job: Future, plan, ctrl_c: bool) -> None:
    """Waits for the dump; a failed one is the cause: its words. Where a Ctrl-C
    (``ctrl_c``: of a dump that stops the container) ended it too (Podman, in
    the same process group, gets the SIGINT), the line is the Ctrl-C's (exit
    130, which the CLI keeps): whether the container runs, or where its
    checkpoint is and how back; the CLI's bare "Interrupted" said neither."""
    futures_wait([job])
    try:
        job.result()
    except GpusnapError:
        if ctrl_c:
            raise ops_checkpoint.interrupted(plan) from None
        raise


def _pushed(plan, work: Path, aside: Path | None, in_ram: bool, pre_checkpoint: bool) -> None:
    """The registry holds it now: the local copies go (a pre-copy's round 1 keeps its pages)."""
    if aside is not None:
        ops_checkpoint.drop_local(plan.container.userdata)
    discard(work, work.parent)  # the export (and the pages): as large as the checkpoint
    if in_ram:
        if pre_checkpoint:
            kept_pages.keep(aside, plan.container.id, ops_checkpoint.ahead_tasks(plan),
                            held_too=plan.gpu_bytes)
        discard(aside, aside.parent)


def _clear_stale(container: podman.Container) -> None:
    """What an earlier export left, which would be followed as if Podman wrote it."""
    (container.userdata / prefetch.DEVSHM).unlink(missing_ok=True)
    early_pages.clear_stale(container.checkpoint_dir)


def _back_aside(source: str, aside: Path) -> str:
    return f"`gpusnap restore {source}` (its local checkpoint, whose memory pages lie in {aside})"


def _stopped_it(job: Future | None, leave_running: bool) -> bool:
    """Whether the checkpoint job ended well and so stopped the container."""
    return not leave_running and job is not None and job.done() and not job.cancelled() \
        and job.exception() is None


def _place_pages(plan, work: Path, root: Path, sets_aside: bool) -> tuple[Path | None, bool]:
    """The plan's pages folder (_pages_folder) and whether it is in RAM; the
    disk's room checked where it is not."""
    aside, in_ram = _pages_folder(plan, work, root) if sets_aside else (None, False)
    if not in_ram:
        ops_checkpoint.require_space([plan.container.userdata, plan.export.parent],
                                     plan.estimate_bytes)
    if aside is not None:  # this push drops the local checkpoint once it read the pages
        plan.keep, plan.pages_aside, plan.pages_prelinked = True, aside, in_ram
    return aside, in_ram


def _pages_folder(plan, work: Path, root: Path) -> tuple[Path | None, bool]:
    """Where CRIU's pages go for this push, and whether that is RAM: a folder on
    /dev/shm that CRIU writes into through links (the host can spare the pages
    and the GPU memory the driver moves into the process first:
    pages/memory.py; pages prepared for a restore give way: prepared_pages),
    else one beside Podman's storage they are moved into
    after the dump (a rename: the images' filesystem), else none (the export
    holds them)."""
    claimed, reuse = _claim_kept(plan)
    try:
        kept_bytes = memory.folder_bytes(claimed / kept_pages.CLAIMED) if claimed else 0
        ram = prepared_pages.evict_for(max(1 << 20, plan.estimate_bytes - kept_bytes),
                                       held_too=plan.gpu_bytes)
        if claimed is not None and ram is not None and os.path.samefile(ram, claimed.parent):
            plan.pages_reuse = reuse  # (not named for the hold: round 1's pages move into it)
            return claimed, True
    except BaseException:
        if claimed is not None:  # not yet the push's: nothing else would remove it
            shutil.rmtree(claimed, ignore_errors=True)
        raise
    if claimed is not None:  # of no use here: the memory goes back now
        shutil.rmtree(claimed, ignore_errors=True)
    if ram is not None:
        folder = Path(tempfile.mkdtemp(prefix=PUSH_PREFIX, dir=ram))
        memory.hold_folder(folder)
        return folder, True
    if _same_fs(root, plan.container.userdata):
        (work / "pages").mkdir(mode=0o700)
        return work / "pages", False
    return None, False


def _claim_kept(plan) -> tuple[Path | None, list[str]]:
    """A final round's push folder in RAM holding round 1's kept pages, which
    its read-ahead writes over (pages/kept_pages.py), claimed before the RAM
    check counts them as held already; (None, []) where there are none."""
    count = 0 if plan.leave_running else ops_checkpoint.ahead_tasks(plan)
    if not count or os.environ.get(memory.ENV) == "0":
        return None, []
    root = memory.ram_root()
    if not kept_pages.folders((root,)):
        return None, []
    folder = Path(tempfile.mkdtemp(prefix=PUSH_PREFIX, dir=root))
    reuse = kept_pages.claim(plan.container.id, folder, count)
    if not reuse:
        shutil.rmtree(folder, ignore_errors=True)
        return None, []
    return folder, reuse


def _when_checkpointed(callback: Callable[[dict], None], plan, export: Path,
                       aside: Path | None, ways: dict) -> Callable[[Future], None]:
    """The checkpoint job's done-callback: ``callback`` with what is on local
    storage now (the container stopped or resumed, its GPU released) and
    ``ways`` on from it should the push then fail (again: the push's retry;
    back: the restore here)."""
    def done(job: Future) -> None:
        if job.cancelled() or job.exception() is not None:
            return
        staged = export.stat().st_size if export.exists() else 0
        if aside is not None:
            staged += sum(p.stat().st_size for p in aside.iterdir() if p.is_file())
        callback({"export": str(export), "container": plan.container.name,
                  "init_pid": plan.container.pid, "seconds": job.result().get("seconds"),
                  "bytes": staged, **ways})
    return done


def _make_export_whole(exc: BaseException, source: str, export: Path, aside: Path,
                       container: podman.Container) -> None:
    """The pages into the kept export, then the local checkpoint and the pages
    folder go (one copy on disk). Where the export cannot take them (disk
    full), the local checkpoint stays whole and is what the error offers."""
    try:
        pages_aside.materialize(export)
    except (OSError, tarfile.TarError) as werr:
        pages = f"{aside} (RAM: a reboot loses it)" if memory.in_ram(aside) else str(aside)
        raise GpusnapError(f"{cause(exc)}; {source} is checkpointed and stopped; its export could not "
                           f"take its memory pages ({getattr(werr, 'strerror', None) or werr}), "
                           "so its checkpoint is kept "
                           f"locally, in {container.checkpoint_dir} and {pages}",
                           f"`gpusnap restore {source}` brings it back here") from None
    ops_checkpoint.drop_local(container.userdata)
    shutil.rmtree(aside, ignore_errors=True)


def _work_root(container: podman.Container) -> Path:
    """Beside Podman's storage, where the pages can be moved by a rename (the
    export holds little else); elsewhere only if there is no such folder."""
    root = container.graph_root.parent if container.graph_root else None
    return root if root is not None and root.is_dir() else staging_dir(0, container.graph_root)


def _same_fs(a: Path, b: Path) -> bool:
    try:
        return a.stat().st_dev == b.stat().st_dev
    except OSError:
        return False


def _local_checkpoint_after_failure(container: podman.Container, aside: Path) -> bool:
    """A push that failed and stopped nothing: a container that runs on has a
    stale dump (dropped); one the failed dump stopped keeps its local
    checkpoint, whose pages go back where CRIU wrote them. Whether ASIDE must
    stay (the disk could not take them)."""
    if podman.exists(container.id) and podman.inspect(container.id).running:
        pages_aside.drop_links(container.checkpoint_dir, aside)
        if any(aside.glob(pages_aside.PATTERN)):
            ops_checkpoint.drop_local(container.userdata)
    elif any(aside.glob(pages_aside.PATTERN)):
        # A copy where the pages are in RAM: the checkpoint must outlive the folder.
        try:
            pages_aside.bring_back(container.checkpoint_dir, copy=True)
        except OSError as exc:  # a full disk: the links lead to ASIDE, which stays, marked
            journal.record("pages-left-aside", folder=str(aside), error=str(exc))
            mark_only_copy(aside, container.name, aside, None,
                           _back_aside(container.name, aside), holds=(aside,))
            return True
    return False


def _manifest_member(plan) -> Callable[[], bytes]:
    """The GPU manifest as the archive's first member, as `gpusnap checkpoint
    --export` writes it (restore checks read it without the memory pages).
    The CRIU action script wrote it during the dump, before Podman's export."""
    path = plan.container.checkpoint_dir / MANIFEST_NAME

    def member() -> bytes:
        try:
            return tar_member(MANIFEST_NAME, path.read_bytes())
        except FileNotFoundError:
            return b""  # no CUDA process: no manifest
    return member


