"""Restore a Podman container from an export archive or a local checkpoint."""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import ContextManager

from gpusnap import PLAN_NAME, archive, journal
from gpusnap.criu.log import ended_early, first_error as criu_error
from gpusnap.criu.runtimes import require_gpu_restore
from gpusnap.criu.version import require_supported
from gpusnap.gpu.checks import read_host_facts
from gpusnap.criu import yard
from gpusnap.errors import GpusnapError
from gpusnap.gpu.cuda import DriverAhead
from gpusnap.gpu.plan import Plan
from gpusnap.ops.engines import refuse_engine
from gpusnap.ops.gpu_plan import carried, plan_here, with_host_numbers
from gpusnap.ops.restore_check import OffTheGpu, gpu_report
from gpusnap.ops.preconditions import has_checkpoint
from gpusnap.partial import full_at
from gpusnap.private import write_private
from gpusnap.runtime import identity, kept_checkpoint, podman
from gpusnap.runtime.retarget import edit_members
from gpusnap.runtime.stream import (CONFIG_FILES, ImportStream, config_only_opens, config_tar,
                                    import_fifo, is_zstd)


_NOT_HERE = ("restore on a host with GPUs like the checkpoint's (`gpusnap inspect` lists them, "
             "`gpusnap gpus` this host's), or name targets with --gpu-map; nothing was changed")


def _plan(contents: archive.CheckpointContents, gpu_map: str | None, remap: bool) -> Plan:
    host = read_host_facts()  # `criu --version` once, for the CRIU check and the plan's
    require_supported("restore", host.criu_version)
    manifest = contents.manifest
    runtime = (contents.json_file("config.dump") or {}).get("runtime") or podman.default_runtime()
    require_gpu_restore(runtime, manifest, contents.source, "nothing was changed")
    return plan_here(manifest, gpu_map, remap=remap, refusal_hint=_NOT_HERE, host=host)


def _retarget(contents: archive.CheckpointContents,
              plan: Plan) -> tuple[dict | None, dict[str, bytes]]:
    """What the import stream needs to move the devices: (the pump's retarget
    spec, None for a checkpoint without GPUs; the archive's small files with
    config.dump and spec.dump as the stream will carry them). Checked on the
    spec before Podman is called, so a spec that cannot be moved is refused up
    front. A plan that moves nothing is carried too: the OCI hook re-checks it
    (with the checks this restore was told to skip) rather than planning anew."""
    if not carried(plan):
        return None, contents.files
    plan = with_host_numbers(plan, contents.json_file("spec.dump"))
    for name in CONFIG_FILES:
        if plan.needs_remap and name not in contents.files:
            raise GpusnapError(f"{contents.source} has no {name}; its devices cannot be moved")
    moved = edit_members({name: contents.files[name] for name in CONFIG_FILES
                          if name in contents.files}, plan.remap, None)
    return {"remap": plan.remap.to_dict(), "plan": plan.to_dict()}, {**contents.files, **moved}


def name_taken(target: str) -> GpusnapError:
    """The refusal of a restore whose container name another container has."""
    return GpusnapError(f"a container named {target} already exists",
                        f"restore with --name NEW, or remove it (`podman rm -f {target}`, "
                        "which stops it first if it runs)")


def free_name(name: str | None) -> str | None:
    """NAME-N, the first no container here has, where a container named ``name``
    exists on this host; None where it does not (or Podman is not installed,
    so no name is taken, or does not answer): what a printed restore line adds
    as --name. Asked after a push or pull is done: a Podman that does not
    answer in time (another container's dump holds it) costs the line its
    --name, not the command its success (a restore of a name in use says so)."""
    if not name or shutil.which("podman") is None:
        return None
    try:
        if not podman.exists(name):
            return None
        n = 2
        while podman.exists(f"{name}-{n}"):
            n += 1
    except GpusnapError as exc:
        journal.record("restore-line-unnamed", container=name, error=exc.message)
        return None
    return f"{name}-{n}"


def plan_report(source: str, plan: Plan) -> dict:
    return {"source": source, "dry_run": True, "remap": plan.needs_remap,
            "moves": plan.describe(), "plan": plan.to_dict()}


def run(source: str, name: str | None, keep: bool, tcp_established: bool,
        gpu_map: str | None = None, dry_run: bool = False) -> dict:
    path = Path(source)
    if path.exists():
        contents = archive.read(str(path), head_only=True)
        if contents.is_containerd_checkpoint:  # restored with --to containerd://
            refuse_engine(contents.summary(), source, "podman")
        config = contents.json_file("config.dump") or {}
        target = name or config.get("name")
        if target and podman.exists(target):  # --dry-run too: a check the restore makes
            raise name_taken(target)
        plan = _plan(contents, gpu_map, remap=True)
        archive_mode = True
    elif podman.exists(source):
        ctr = podman.inspect(source)
        kept = kept_checkpoint.why_kept(ctr.userdata)
        if ctr.running:
            raise GpusnapError(f"container {ctr.name} is running; there is nothing to restore",
                               _off_the_gpu_hint(ctr) if kept and
                               kept_checkpoint.left_by(kept, ctr.pid) else "")
        from_kept = not has_checkpoint(ctr)
        if from_kept and kept is None:
            raise GpusnapError(f"container {ctr.name} has no checkpoint to restore",
                               "checkpoint it first with `gpusnap checkpoint`")
        if name:
            raise GpusnapError("--name applies only when restoring from an archive or a registry "
                               "reference", "drop --name: a local checkpoint restores its own "
                               "container")
        if gpu_map:
            raise GpusnapError("--gpu-map applies only when restoring from an archive: "
                               "Podman keeps a local checkpoint's devices in its database",
                               f"export it (`gpusnap checkpoint {ctr.name} --export FILE`) "
                               "and restore the file")
        contents = _kept_contents(ctr) if from_kept else archive.read_directory(ctr.userdata)
        plan = _plan(contents, None, remap=False)
        archive_mode = False
    elif "/" in source or source.endswith((".tar", ".zst", ".gz")):
        raise GpusnapError(f"no such file: {source}", "check the path of the exported archive")
    else:
        raise GpusnapError(f"{source} is neither a checkpoint archive nor a container",
                           "pass a file from `gpusnap checkpoint --export` or a checkpointed "
                           "container's name (`podman ps -a`)")
    if dry_run:
        return plan_report(source, plan)
    if archive_mode:
        return import_file(path, contents, plan, name, keep, tcp_established, source)
    if from_kept:
        _put_back(ctr, kept)
    elif kept:  # never newer than the one in place
        kept_checkpoint.drop(ctr.userdata, "a checkpoint in place")
    return restore_local(source, contents, plan, keep, tcp_established, ctr.userdata)


def _off_the_gpu_hint(ctr: podman.Container) -> str:
    """For a container whose last restore left its GPU state off the GPU, its
    checkpoint kept aside (runtime/kept_checkpoint.py)."""
    return (f"its last restore could not bring its GPU state back and kept its checkpoint: "
            f"`podman stop -t 0 {ctr.name}`, then `gpusnap restore {ctr.name}`")


def _kept_contents(ctr: podman.Container) -> archive.CheckpointContents:
    """A kept checkpoint's contents; Podman's config.dump and spec.dump stay in
    userdata (they are not the checkpoint's to drop)."""
    contents = archive.read_directory(ctr.userdata / kept_checkpoint.KEPT_NAME)
    for name in archive.METADATA:
        if name not in contents.files and (ctr.userdata / name).is_file():
            contents.files[name] = (ctr.userdata / name).read_bytes()
    return contents


def _put_back(ctr: podman.Container, kept: dict) -> None:
    path = ctr.userdata / kept_checkpoint.KEPT_NAME
    try:
        kept_checkpoint.put_back(ctr.userdata)
    except OSError as exc:
        raise GpusnapError(f"could not put back the checkpoint kept at {ctr.name}'s failed "
                           f"restore ({exc}); it is still in {path}",
                           f"run `gpusnap restore {ctr.name}` again") from None
    journal.record("kept-checkpoint-put-back", container=ctr.id, why=kept.get("why"))


def restore_local(source: str, contents: archive.CheckpointContents, plan: Plan, keep: bool,
                  tcp_established: bool, userdata: Path | None = None) -> dict:
    """Podman's restore of a container's own checkpoint, checked. Podman drops
    that checkpoint as soon as CRIU is done, before the driver may refuse the GPU
    state for good: a GPU checkpoint is kept until the check found it back."""
    hold = contents.manifest is not None and not keep
    start = time.monotonic()
    ahead = DriverAhead() if plan.moves else None
    pinned = _pin_plan(userdata, plan)
    try:
        podman.restore(source, archive=False, name=None, keep=keep or hold,
                       tcp_established=tcp_established, size=sum(contents.sizes.values()))
    except GpusnapError as exc:  # the container stays, stopped, and with it CRIU's log
        why, hint = _with_criu_log(exc, _local_log(source), source)
        raise GpusnapError(why, hint) from None
    finally:
        if pinned is not None:  # never carried into a later checkpoint of this folder
            pinned.unlink(missing_ok=True)
    seconds = time.monotonic() - start
    ctr = podman.inspect(source)
    if keep or hold:  # Podman kept its checkpoint: a copy a failed post-resume linked is not needed
        kept_checkpoint.drop(ctr.userdata, "Podman kept the checkpoint itself")
    try:
        result = restored(ctr, source, seconds, plan, driver=ahead)
    except OffTheGpu as exc:
        raise GpusnapError(exc.message, (
            f"`podman stop -t 0 {ctr.name}`, then `gpusnap restore {ctr.name}` once the GPU has "
            "the memory free: its checkpoint is kept")) from None
    except GpusnapError as exc:  # not refused for good: they may still come back
        if hold:
            exc.hint = "; ".join(filter(None, [
                exc.hint, f"its checkpoint is kept: should they not come back, "
                          f"`podman stop -t 0 {ctr.name}`, then `gpusnap restore {ctr.name}`"]))
        raise
    if hold:
        podman.drop_checkpoint(ctr)
    return result


def _pin_plan(userdata: Path | None, plan: Plan) -> Path | None:
    """The plan beside the manifest in Podman's own checkpoint folder, where the
    OCI hook and CRIU's action script re-check it (gpu_plan.carried)."""
    if userdata is None or not carried(plan):
        return None
    folder = userdata / "checkpoint"
    try:
        return write_private(folder / PLAN_NAME, json.dumps(plan.to_dict()))
    except OSError as exc:
        raise GpusnapError(f"cannot write the GPU plan into {folder} ({exc}); nothing was "
                           "restored", "check that disk's free space") from None


def import_file(path: Path, contents: archive.CheckpointContents, plan: Plan,
                name: str | None, keep: bool, tcp_established: bool, source: str) -> dict:
    """Import the archive at ``path`` under ``plan``, made once by the caller
    (this restore, or a pull that staged the file): rewritten on its way to
    Podman where the plan moves GPUs."""
    retarget, files = _retarget(contents, plan)  # refused here, before Podman, if it cannot move
    # Podman 4.3's config-only opens read the whole stream: given the (moved)
    # config alone, the archive is rewritten once, not three times.
    head = config_tar(files)
    opens = config_only_opens(podman.version()) if head else 0
    return import_archive(import_fifo(path.absolute(), retarget=retarget, head=head,
                                      head_opens=opens),
                          contents, plan, name, keep, tcp_established, source,
                          size=_unpacked_size(path))


def _unpacked_size(path: Path) -> int:
    """What Podman reads of the archive, for its restore's bound (zstd packs a
    checkpoint of GPU memory well; a quarter is assumed, so the bound errs long)."""
    size = path.stat().st_size
    return size * 4 if is_zstd(path) else size


def _criu_died(podman_said: str) -> bool:
    """runc's words when CRIU's socket closed under it: CRIU was killed (with the
    restored processes: runc moves it into their cgroup)."""
    return "unixpacket" in podman_said and "EOF" in podman_said


def import_archive(opener: ContextManager[ImportStream], contents: archive.CheckpointContents,
                   plan: Plan, name: str | None, keep: bool, tcp_established: bool,
                   source: str, size: int = 0) -> dict:
    """`podman container restore --import` of the stream ``opener`` yields (a FIFO
    that streams the archive, watched while Podman reads it); a failure
    removes what Podman half-created."""
    target = name or (contents.json_file("config.dump") or {}).get("name")
    start, since = time.monotonic(), time.time() - 1  # the second: clocks' rounding
    journal.record("import-started", container=target)
    ahead = DriverAhead() if plan.moves else None  # for the check once Podman is done
    try:
        with opener as stream:
            podman.restore(str(stream.path), archive=True, name=name, keep=keep,
                           tcp_established=tcp_established, size=size, watch=stream.check,
                           progress=stream.progress)
    except GpusnapError as exc:
        journal.record("import-failed", container=target, error=exc.message)
        # a container that took the name meanwhile is not this import's to remove
        log, left = (None, None) if "that name is already in use" in exc.message else \
            _drop_half_restored(target, since)
        # Podman's "see restore.log" names a file removed with the container
        why, hint = _with_criu_log(exc, log, target)
        if left:  # the cause above stays the message; the leftover is what to clean up
            why += f"; the half-restored container {target} is left ({left}): `podman rm -f {target}`"
        raise GpusnapError(f"{why}; nothing was restored, {source} is unchanged", hint) from None
    except KeyboardInterrupt:  # Podman stopped: what it half-made under the name goes too
        journal.record("import-failed", container=target, error="interrupted")
        _drop_half_restored(target, since)
        raise
    done = time.monotonic()
    ctr = podman.inspect(target or source)
    hostname = None
    if name:  # a copy under a new name: its own hostname, not the checkpoint's
        hostname = identity.follow_new_id(ctr, (contents.json_file("config.dump") or {}).get("id", ""))
    try:
        return restored(ctr, source, done - start, plan, hostname=hostname,
                        after={"inspect": round(time.monotonic() - done, 3)}, driver=ahead)
    except OffTheGpu as exc:  # its processes cannot run on; the checkpoint is untouched
        try:
            podman.remove(ctr.name, force=True)
            what = f"the restored container {ctr.name} is removed; nothing was restored"
        except GpusnapError as left:
            what = f"the restored container {ctr.name} could not be removed ({left.message}): " \
                   f"`podman rm -f {ctr.name}`"
        raise GpusnapError(f"{exc.message}; {what}; {source} is unchanged",
                           "restore it again once the GPU has the memory free (nvidia-smi "
                           "shows what holds it)") from None


def restored(ctr: podman.Container, source: str, seconds: float, plan: Plan,
             hostname: str | None = None, after: dict | None = None,
             driver: DriverAhead | None = None) -> dict:
    """The restored container's report (and journal record), its GPU processes
    checked; ``after``: what the restore spent once Podman was done, by step
    (a replica's time counts to here); ``driver``: loaded while Podman worked."""
    checked = time.monotonic()
    try:
        gpu = gpu_report(ctr.pid, driver, plan)
    except OffTheGpu as exc:  # the caller says what of the checkpoint is left
        journal.record("restore-off-the-gpu", container=ctr.id, pids=exc.pids, error=exc.message)
        raise
    after = {**(after or {}), "gpu_check": round(time.monotonic() - checked, 3)}
    # a post-resume that failed kept it; the GPU state is back now
    kept_checkpoint.drop(ctr.userdata, "the restore's check found the GPU state back")
    journal.record("restored", container=ctr.id, source=source, seconds=round(seconds, 3),
                   moves=plan.describe() if plan.needs_remap else None, after=after)
    result = {"container": {"id": ctr.id, "name": ctr.name, "status": ctr.status, "pid": ctr.pid},
              "source": source, "seconds": round(seconds, 3), "gpu_processes": gpu}
    if hostname:
        result["container"]["hostname"] = hostname
    if plan.moves:
        result["gpus"] = [{"from": m.source.to_dict(), "to": m.target.to_dict(),
                           "why": list(m.reasons)} for m in plan.moves]
    return result


@dataclass(frozen=True)
class CriuLog:
    """CRIU's restore.log of a failed import, read before its container went."""
    error: str | None  # its first error (criu.log.first_error)
    cut: bool  # it ends mid-way with no error: CRIU was killed, or could not write
    full: str  # disk_full's words where the disk holding it had no room left
    kept: Path | None  # the copy in state_dir()/logs
    not_kept: str = ""  # why there is no copy

    def where(self) -> str:
        return f"CRIU's log is kept in {self.kept}" if self.kept else \
            f"CRIU's log could not be kept: {self.not_kept}"


def _local_log(name: str) -> CriuLog | None:
    """CRIU's log of a failed restore of container ``name``'s own checkpoint."""
    try:
        ctr = podman.find(name)
    except GpusnapError:
        return None
    return _read_log(ctr) if ctr is not None else None


def _read_log(ctr: podman.Container) -> CriuLog | None:
    log = ctr.userdata / "restore.log"
    if not log.is_file():
        return None
    error, full = criu_error(log), full_at(log.parent)
    try:
        kept, not_kept = journal.copy_log(log, "restore", ctr.name), ""
    except OSError as exc:
        logs = journal.state_subdir("logs")
        kept, not_kept = None, full_at(logs) or f"{exc.strerror or exc} in {logs}"
    return CriuLog(error, not error and ended_early(log), full, kept, not_kept)


def _with_criu_log(exc: GpusnapError, log: CriuLog | None,
                   target: str | None) -> tuple[str, str | None]:
    """Podman's words on a failed restore, and its hint, with what CRIU's own
    log says: Podman often names only where that log is."""
    why, hint = exc.message, exc.hint
    if log is None:
        return why, hint
    cause = log.error or log.full
    if cause and "log file:" in why:  # Podman said only where its log was: CRIU says why
        why = f"podman container restore: {cause} ({log.where()})"
    elif _criu_died(why) or log.cut:
        said = cause or "its log ends mid-way, with no error: killed?"
        why = (f"CRIU stopped before the restore of {target} was complete ({said}; "
               f"{log.where()})")
        hint = "the checkpoint needs nothing: run the same restore again" + (
            ", once the disk has room" if log.full else "")
    else:  # CRIU's "action scripts failed" says less than the words already in `why`
        said = cause if cause and "action scripts failed" not in cause else ""
        why += f" ({said + '; ' if said else ''}{log.where()})"
    return why, hint


def _drop_half_restored(name: str | None, since: float) -> tuple[CriuLog | None, str | None]:
    """An import that failed (a damaged archive) may leave a created container
    behind; the name was free before, so one made since ``since`` is ours to remove. Its CRIU
    restore.log goes with it: it is read and a copy kept first. (the log, why
    the container could not be removed): a failed removal never hides why the
    import failed."""
    try:
        ctr = podman.find(name) if name else None
        if ctr is None or ctr.running or ctr.made_before(since):
            return None, None
    except GpusnapError as exc:
        return None, exc.message
    log = _read_log(ctr)
    released = yard.release(ctr.userdata)  # before Podman's removal walks into it
    if released:
        journal.record("criu-yard-released", container=ctr.id, mounts=released)
    try:
        podman.remove(name)
    except GpusnapError as exc:
        journal.record("half-restored-left", container=ctr.id, error=exc.message)
        return log, exc.message
    return log, None
