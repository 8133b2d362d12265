"""Whether a --leave-running export holds the files its processes had open.

Podman dumps the container, lets it run on, and only then writes the root
filesystem's changes (rootfs-diff.tar) into the export. A file the processes
held open at the dump and renamed, removed or resized before that export is
not in the archive as CRIU saw it, and CRIU refuses the restore: it opens
every such file and checks its size (criu/files-reg.c, "Can't open file" or
"has bad size"). A counter that writes c.new and renames it to c meets this
whenever the dump lands between the two.

``unrestorable`` makes CRIU's own check on what the export holds: the images
Podman keeps in the container's folder (--keep), its rootfs-diff.tar (kept
there by Podman 4, read from the export where Podman 5.8 removed it), and the
image's layers for what the container did not change.
"""

from __future__ import annotations

import io
import json
import os
import tarfile
from pathlib import Path
from typing import Sequence

from gpusnap.criu import dumped
from gpusnap.criu.images import ImageError, checked_messages, fields_of, read_mounts
from gpusnap.pages.file_pages import regular_files
from gpusnap.tarstream import DamagedStream, TarStream

REMAP_FPATH_MAGIC = 0x59133954


def _remapped(images: Path) -> set[int]:
    """Ids of files CRIU restores from its own copy (unlinked at the dump: ghosts)
    or through a link it made: the root filesystem need not hold them."""
    path = images / "remap-fpath.img"
    if not path.is_file():
        return set()
    out = set()
    for entry in checked_messages(path.read_bytes(), REMAP_FPATH_MAGIC, "remap-fpath",
                                  path.name):
        f = {n: v for n, _, v in fields_of(entry)}
        if isinstance(f.get(1), int):
            out.add(f[1])
    return out


def _sizes(tar: tarfile.TarFile) -> dict[str, int | None]:
    """A tar's members: regular files by size, anything else None."""
    return {m.name.removeprefix("./").lstrip("/"): m.size if m.isreg() else None for m in tar}


def _diff_sizes(userdata: Path, export: Path) -> dict[str, int | None]:
    """rootfs-diff.tar's members, from Podman's folder where it keeps the file
    (4.x with --keep), else from the export (5.8 removes it after the export:
    read to the end, where Podman puts it). None in either: no changes."""
    kept = userdata / "rootfs-diff.tar"
    if kept.is_file():
        with tarfile.open(kept) as tar:
            return _sizes(tar)
    stream = TarStream(export)
    try:
        for member in stream.tar:
            if member.name.removeprefix("./") == "rootfs-diff.tar" and member.isreg():
                data = stream.data(member)
                with tarfile.open(fileobj=io.BufferedReader(data), mode="r|") as inner:
                    return _sizes(inner)
        return {}
    finally:
        stream.close(read_to_end=False)


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


def unrestorable(userdata: Path, export: Path, lower_dirs: Sequence[str]) -> list[str]:
    """Paths (in the container) of files CRIU will not find as it saw them at the
    dump, each with why; [] where the export restores. The images are Podman's
    kept ones (--keep); without them there is nothing to check against: an
    error, not a pass."""
    images = userdata / "checkpoint"
    if not dumped.whole(images):
        raise ImageError(f"no CRIU images in {images} to check the export against")
    roots = {m.mnt_id for m in read_mounts(images) if m.mountpoint == "/"}
    remapped, deleted = _remapped(images), _deleted(userdata)
    try:
        diff = _diff_sizes(userdata, export)
    except (tarfile.TarError, EOFError, DamagedStream) as exc:
        # Podman's archiver logs a file that shrank under it and goes on: its tar
        # ends damaged, and Podman's restore fails on it
        return [f"the root filesystem in the export (damaged: {exc}; a file changed size "
                "while Podman archived it)"]
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
