"""Where checkpoint archives can be staged, and what Podman knows of an image."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from gpusnap.errors import GpusnapError
from gpusnap.runtime import podman


# Staging folders' name prefixes: doctor finds what a killed CLI left by them (leftovers.py).
PUSH_PREFIX = ".gpusnap-push-"
PULL_PREFIX = ".gpusnap-pull-"
TRASH_PREFIX = ".gpusnap-trash-"  # doctor lists one a killed `rm` left (leftovers.py)


def discard(path: Path, near: Path) -> None:
    """Remove the tree ``path`` without waiting for it: renamed at once into a
    trash folder in ``near`` (the same filesystem), deleted there by a detached
    `rm -rf`. Unlinking tens of GB of freshly written files waits for their
    writeback: seconds at the end of every migration. Where the rename fails, removed here and now."""
    try:
        trash = Path(tempfile.mkdtemp(prefix=TRASH_PREFIX, dir=near))
    except OSError:
        shutil.rmtree(path, ignore_errors=True)
        return
    try:
        os.rename(path, trash / path.name)
    except OSError:  # gone already, or not movable: nothing left to do in the background
        shutil.rmtree(path, ignore_errors=True)
        os.rmdir(trash)
        return
    subprocess.Popen(["rm", "-rf", "--", str(trash)], start_new_session=True,
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                     stderr=subprocess.DEVNULL)


def storage_root() -> Path | None:
    """Podman's graph root (/var/lib/containers/storage for root), if Podman answers
    (podman.host_facts: `podman info` is asked only where its answer is not kept)."""
    if shutil.which("podman") is None:
        return None
    return podman.host_facts().graph_root


def staging_dir(size: int, graph_root: Path | None = None) -> Path:
    """A directory for an archive of ``size`` bytes: beside Podman's storage (the
    import lands there anyway) or /var/tmp, whichever has more room; never /tmp,
    often a small tmpfs. ``graph_root``, where a container already told it, spares
    asking `podman info` (slow: it queries dpkg for runc's and conmon's versions)."""
    root = graph_root or storage_root()
    candidates = [c for c in (root.parent if root else None, Path("/var/tmp"))
                  if c is not None and c.is_dir()]
    return roomiest(candidates, size, "free space beside Podman's storage or in /var/tmp")


def fifo_dir() -> Path:
    """Where a FIFO (no room needed) goes: /var/tmp, one of the places doctor looks
    for what a killed CLI left; no `podman info` asked."""
    return Path("/var/tmp")


def roomiest(candidates: list[Path], size: int, hint: str) -> Path:
    """The candidate directory with the most free space, if ``size`` bytes fit there."""
    best = max(candidates, key=lambda c: shutil.disk_usage(c).free)
    free = shutil.disk_usage(best).free
    if free < size:
        raise GpusnapError(f"not enough disk space to stage a {size >> 20} MiB checkpoint "
                           f"({best} has {free >> 20} MiB free)", hint)
    return best


def image_repo_digests(image: str) -> list[str]:
    """NAME@sha256:... references under which a local image was pulled or pushed."""
    if shutil.which("podman") is None:
        return []
    res = podman._run(["image", "inspect", image, "--format", "{{json .RepoDigests}}"])
    if res.returncode != 0:
        return []
    try:
        return [d for d in json.loads(res.stdout.strip() or "[]") if "@" in d]
    except ValueError:
        return []
