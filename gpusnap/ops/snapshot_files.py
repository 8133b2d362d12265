"""Whether a --leave-running export holds the files its processes had open.

Podman dumps the container, lets it run on, and only then writes the root
filesystem's changes (rootfs-diff.tar) into the export. A file the processes
held open at the dump and renamed, removed or resized before that export is
not in the archive as CRIU saw it, and CRIU refuses the restore: it opens
every such file and checks its size (criu/files-reg.c, "Can't open file" or
"has bad size"). A counter that writes c.new and renames it to c meets this
whenever the dump lands between the two.

``unrestorable`` makes CRIU's own check on what the export holds: the images
and rootfs-diff.tar Podman keeps in the container's folder (--keep), and the
image's layers for what the container did not change.
"""

from __future__ import annotations

import json
import os
import struct
import tarfile
from pathlib import Path
from typing import Sequence

from gpusnap.criu.images import IMG_COMMON_MAGIC, ImageError, fields_of, messages, read_mounts
from gpusnap.pages.file_pages import regular_files

REMAP_FPATH_MAGIC = 0x59133954


def _remapped(images: Path) -> set[int]:
    """Ids of files CRIU restores from its own copy (unlinked at the dump: ghosts)
    or through a link it made: the root filesystem need not hold them."""
    path = images / "remap-fpath.img"
    if not path.is_file():
        return set()
    data = path.read_bytes()
    if len(data) < 8 or struct.unpack_from("<II", data) != (IMG_COMMON_MAGIC, REMAP_FPATH_MAGIC):
        raise ImageError("remap-fpath.img is not a CRIU remap-fpath image")
    out = set()
    for entry in messages(data):
        f = {n: v for n, _, v in fields_of(entry)}
        if isinstance(f.get(1), int):
            out.add(f[1])
    return out


def _diff_sizes(userdata: Path) -> dict[str, int | None]:
    """rootfs-diff.tar's members: regular files by size, anything else None."""
    out: dict[str, int | None] = {}
    with tarfile.open(userdata / "rootfs-diff.tar") as tar:
        for member in tar:
            out[member.name.removeprefix("./").lstrip("/")] = member.size if member.isreg() else None
    return out


def _deleted(userdata: Path) -> set[str]:
    try:
        names = json.loads((userdata / "deleted.files").read_text())
    except (OSError, ValueError):
        return set()
    return {str(n).lstrip("/") for n in names or []}


def _layer_size(rel: str, lower_dirs: Sequence[str]) -> int | None:
    """The size of ``rel`` in the uppermost image layer holding it; None: in none."""
    for layer in lower_dirs:
        try:
            st = os.stat(Path(layer) / rel, follow_symlinks=False)
        except OSError:
            continue
        return st.st_size
    return None


def unrestorable(userdata: Path, lower_dirs: Sequence[str]) -> list[str]:
    """Paths (in the container) of files CRIU will not find as it saw them at the
    dump, each with why; [] where the export restores, or where Podman's folder
    does not have what the check needs (no images or no rootfs-diff.tar)."""
    images = userdata / "checkpoint"
    if not (userdata / "rootfs-diff.tar").is_file() or not (images / "inventory.img").is_file():
        return []
    roots = {m.mnt_id for m in read_mounts(images) if m.mountpoint == "/"}
    remapped, diff, deleted = _remapped(images), _diff_sizes(userdata), _deleted(userdata)
    wrong = []
    for fid, reg in sorted(regular_files(images).items()):
        if reg.mnt_id not in roots or fid in remapped or reg.size is None:
            continue  # on a volume or /dev, restored from CRIU's copy, or a directory/append-only log
        rel = reg.name.lstrip("/")
        if rel in diff:
            size = diff[rel]
        elif rel in deleted:
            size = None
        else:
            size = _layer_size(rel, lower_dirs)
        if size is None:
            wrong.append(f"/{rel} (gone)")
        elif size != reg.size:
            wrong.append(f"/{rel} ({size} bytes, {reg.size} at the dump)")
    return wrong
