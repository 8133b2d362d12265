"""A container's local checkpoint kept aside where its restore left the GPU
state off the GPU, for `gpusnap restore NAME` to restore again.

CRIU only logs a post-resume step that failed, so Podman counts such a restore
as done and, without --keep, removes the checkpoint once runc returns (a plain
`podman container restore NAME`, the OCI hook's path). Driver 580 refuses for
good a process whose restore it once refused for memory, so that checkpoint is
then the only way back. The action script links Podman's checkpoint files into
``USERDATA/gpusnap-kept-checkpoint`` before it answers CRIU: hard links, so no
copy, on the same file system, and gone with the container (`podman rm`).
Once the container is stopped, `gpusnap restore NAME` moves them back where
Podman looks. They never stand for an older state than the container's: a
restore whose GPU state came back drops them, and so do a create that is
not a restore (the container started afresh: the OCI hook), a dump into a
checkpoint whose files they share, and `doctor --fix` once the container
runs on its GPU again.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from pathlib import Path

from gpusnap import journal
from gpusnap.criu import dumped
from gpusnap.private import write_private

KEPT_NAME = "gpusnap-kept-checkpoint"
WHY_NAME = "gpusnap-why.json"
# What Podman's restore without --keep removes (libpod's restore cleanup); a
# local restore needs the folders, /dev/shm's tar and the network's status.
CHECKPOINT_DIRS = ("checkpoint", "pre-checkpoint")
CHECKPOINT_FILES = ("restore.log", "dump.log", "stats-dump", "stats-restore",
                    "devshm-checkpoint.tar", "network.status", "rootfs-diff.tar", "deleted.files")


def podman_userdata(image_dir: Path) -> Path | None:
    """The container's userdata folder (its bundle) where ``image_dir`` is
    Podman's folder of a container's own checkpoint; None otherwise (containerd,
    CRIU run by hand)."""
    if image_dir.name != CHECKPOINT_DIRS[0]:
        return None
    userdata = image_dir.parent
    return userdata if (userdata / "config.json").is_file() else None


def _link_tree(src: Path, dst: Path) -> None:
    """``dst`` a tree of hard links to ``src``'s files (a symlink linked as one)."""
    os.mkdir(dst, 0o700)
    for entry in os.scandir(src):
        if entry.is_dir(follow_symlinks=False):
            _link_tree(Path(entry.path), dst / entry.name)
        else:
            os.link(entry.path, dst / entry.name, follow_symlinks=False)


def keep_aside(image_dir: Path, why: str, init_pid: int | None = None) -> Path | None:
    """Link the checkpoint Podman restored from into USERDATA/gpusnap-kept-checkpoint
    (replacing an older one: this checkpoint is the later), with why and which
    restored init it left off the GPU (pid and start time); its path, None where
    ``image_dir`` is not a Podman container's own checkpoint. Raises OSError,
    leaving nothing half made, where a link cannot be made."""
    userdata = podman_userdata(image_dir)
    if userdata is None or not dumped.whole(image_dir):
        return None
    kept, work = userdata / KEPT_NAME, userdata / f".{KEPT_NAME}.tmp"
    trash = userdata / f".{KEPT_NAME}.old"
    for leftover in (work, trash):
        shutil.rmtree(leftover, ignore_errors=True)
    try:
        os.mkdir(work, 0o700)
        for name in CHECKPOINT_DIRS:
            if (userdata / name).is_dir():
                _link_tree(userdata / name, work / name)
        for name in CHECKPOINT_FILES:
            if os.path.lexists(userdata / name):
                os.link(userdata / name, work / name, follow_symlinks=False)
        from gpusnap.procs import start_time  # start-up: the OCI hook imports this module
        write_private(work / WHY_NAME, json.dumps({
            "why": why, "at": time.time(), "init_pid": init_pid,
            "start_time": start_time(init_pid) if init_pid else None}))
        if kept.exists():  # an older one goes only once this one is in its place
            os.rename(kept, trash)
        os.rename(work, kept)
    except OSError:
        shutil.rmtree(work, ignore_errors=True)
        raise
    shutil.rmtree(trash, ignore_errors=True)
    return kept


def why_kept(userdata: Path) -> dict | None:
    """{"why", "at", "init_pid", "start_time"} of a checkpoint kept aside under
    ``userdata``; None where none is."""
    kept = userdata / KEPT_NAME
    if not dumped.whole(kept / CHECKPOINT_DIRS[0]):
        return None
    with contextlib.suppress(OSError, ValueError):
        said = json.loads((kept / WHY_NAME).read_text())
        if isinstance(said, dict):
            return {"why": "unknown", "at": None, **said}
    return {"why": "unknown", "at": None}


def left_by(said: dict, pid: int) -> bool:
    """Whether ``pid`` is the restored init whose failed post-resume kept it
    (still running since: the container was not started afresh)."""
    from gpusnap.procs import start_time  # start-up: the OCI hook imports this module
    return said.get("init_pid") == pid and said.get("start_time") is not None \
        and said.get("start_time") == start_time(pid)


def put_back(userdata: Path) -> bool:
    """Move a kept checkpoint back where Podman restores from (over what a later,
    incomplete dump left there); False where none is kept. The images folder
    goes last: cut short, the kept copy is still found and a rerun finishes."""
    if why_kept(userdata) is None:
        return False
    kept = userdata / KEPT_NAME
    entries = sorted((e for e in kept.iterdir() if e.name != WHY_NAME),
                     key=lambda e: e.name == CHECKPOINT_DIRS[0])
    for entry in entries:
        target = userdata / entry.name
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        elif os.path.lexists(target):
            target.unlink()
        os.rename(entry, target)
    shutil.rmtree(kept, ignore_errors=True)
    return True


def drop(userdata: Path, why: str) -> bool:
    """Remove a kept checkpoint (``why``: the container's GPU state came back
    since, it was started afresh, ...), journaled; whether there was one."""
    kept = userdata / KEPT_NAME
    if not kept.exists():
        return False
    shutil.rmtree(kept, ignore_errors=True)
    journal.record("kept-checkpoint-dropped", path=str(kept), why=why)
    return True


def shares_files(userdata: Path) -> bool:
    """Whether the kept copy links the very files of a checkpoint still in place
    (Podman kept it: --keep): a later dump rewriting those would change it."""
    try:
        return os.path.samefile(userdata / CHECKPOINT_DIRS[0] / dumped.INVENTORY,
                                userdata / KEPT_NAME / CHECKPOINT_DIRS[0] / dumped.INVENTORY)
    except OSError:
        return False


def found(graph_root: Path) -> list[dict]:
    """Every kept checkpoint in Podman's storage: {container (its id), path, why,
    at, init_pid, start_time}."""
    said = {kept: why_kept(kept.parent)
            for kept in sorted(graph_root.glob(f"*-containers/*/userdata/{KEPT_NAME}"))}
    return [{"container": kept.parents[1].name, "path": str(kept), **why}
            for kept, why in said.items() if why is not None]


def after_failed_resume(image_dir: str, why: str, init_pid: int | None = None) -> None:
    """post-resume failed (the action script): keep the checkpoint, journaled."""
    try:
        kept = keep_aside(Path(image_dir), why, init_pid)
    except OSError as exc:
        journal.record("checkpoint-not-kept", folder=image_dir, error=str(exc))
        return
    if kept is not None:
        journal.record("checkpoint-kept", path=str(kept), why=why)
    elif image_dir.startswith("/proc/"):  # pre-restore did not resolve it (no GPU manifest)
        journal.record("checkpoint-not-kept", folder=image_dir,
                       error="the images folder's path is not known")


def before_dump(image_dir: str) -> None:
    """A dump into a Podman checkpoint folder whose files a kept copy shares
    (Podman kept them too): the copy goes, as the dump rewrites them."""
    userdata = podman_userdata(Path(image_dir))
    if userdata is not None and shares_files(userdata):
        drop(userdata, "a dump rewrites the files it shares")


def at_create(userdata: Path) -> None:
    """A container created afresh (not restored): the state a kept copy holds
    was given up for a new start (Podman's own start, the OCI hook)."""
    drop(userdata, "the container was started afresh")


def after_resume(image_dir: str) -> None:
    """post-resume brought the GPU state back: an older kept checkpoint goes."""
    userdata = podman_userdata(Path(image_dir))
    if userdata is not None:
        drop(userdata, "a later restore brought the GPU state back")
