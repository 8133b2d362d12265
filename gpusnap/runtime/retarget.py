"""An export archive, rewritten on the fly for other GPUs.

`podman container restore --import` takes the container's spec from the
archive (spec.dump, and config.dump's copy of it), and CRIU recreates the
container's /dev from its tmpfs image with the device numbers of the
checkpoint's host. Restoring onto other GPUs changes all three, and gpusnap
does it in the stream Podman reads (through the import FIFO), so the archive
on disk is never touched: a refused or failed restore leaves it as it was.

The plan travels as checkpoint/gpusnap-plan.json, beside the GPU manifest:
the OCI hook validates it and the CRIU action script gives the driver its
GPU UUID pairs.
"""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path
from typing import BinaryIO

from gpusnap import PLAN_NAME
from gpusnap.criu.devtmpfs import DevTarError, rewrite_dev_tar
from gpusnap.criu.images import ImageError, dev_tmpfs_name, parse_mountpoints
from gpusnap.errors import GpusnapError
from gpusnap.gpu.nodes import DeviceRemap
from gpusnap.oci.spec import SpecError, rewrite_config_dump, rewrite_spec
from gpusnap.tarstream import TarStream

_COPY_BUFFER = 1 << 20
_IMAGES = "checkpoint/"


def _norm(name: str) -> str:
    return (name[2:] if name.startswith("./") else name).rstrip("/")


class _Editor:
    """Edits the few members that name devices; everything else passes through."""

    def __init__(self, remap: DeviceRemap) -> None:
        self.remap = remap
        self.dev_image: str | None = None

    def wants(self, name: str) -> bool:
        return (name in ("spec.dump", "config.dump")
                or (name.startswith(_IMAGES + "mountpoints-") and name.endswith(".img"))
                or name == self.dev_image
                or (self.dev_image is None and name.startswith(_IMAGES + "tmpfs-dev-")))

    def edit(self, name: str, data: bytes) -> bytes:
        if name == "spec.dump":
            return _json(rewrite_spec(json.loads(data), self.remap))
        if name == "config.dump":
            return _json(rewrite_config_dump(json.loads(data), self.remap))
        if name.startswith(_IMAGES + "mountpoints-"):
            found = dev_tmpfs_name(parse_mountpoints(data))
            if found:
                self.dev_image = _IMAGES + found
            return data  # read only
        if self.dev_image is None:
            # Go's tar walks the directory in lexical order: mountpoints-* come first.
            raise GpusnapError(f"the archive holds {name} before CRIU's mount table",
                               "re-export the container with `gpusnap checkpoint --export`")
        return rewrite_dev_tar(data, self.remap)


def _json(value: dict) -> bytes:
    return json.dumps(value).encode()


def _member(name: str, data: bytes, like: tarfile.TarInfo | None = None) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size, info.mode = len(data), 0o600
    if like is not None:
        info.mtime, info.uid, info.gid = like.mtime, like.uid, like.gid
    return info


def rewrite_archive(src: Path, out: BinaryIO, remap: DeviceRemap, plan: dict | None) -> None:
    """Write ``src`` (a Podman export, any compression) to ``out`` as a plain tar
    with its devices moved per ``remap`` and ``plan`` added as checkpoint/gpusnap-plan.json.

    Raises GpusnapError for an archive that cannot be rewritten and OSError when
    the reader goes away (Podman reads only the head of the archive at first).
    """
    editor = _Editor(remap)
    stream = TarStream(src)
    dst = tarfile.open(fileobj=out, mode="w|", format=tarfile.PAX_FORMAT)
    dst.copybufsize = _COPY_BUFFER
    plan_data = _json(plan) if plan is not None else None
    read_all = False
    try:
        for info in stream.tar:
            name = _norm(info.name)
            if plan_data is not None and name.startswith(_IMAGES):
                dst.addfile(_member(_IMAGES + PLAN_NAME, plan_data, info), io.BytesIO(plan_data))
                plan_data = None
            if info.isreg() and editor.wants(name):
                try:
                    data = editor.edit(name, stream.tar.extractfile(info).read())
                except (SpecError, DevTarError, ImageError, ValueError) as exc:
                    raise GpusnapError(f"cannot move the devices in {name}: {exc}",
                                       "nothing was restored; `gpusnap restore --dry-run` "
                                       "shows the plan") from None
                info.size = len(data)
                dst.addfile(info, io.BytesIO(data))
            else:
                dst.addfile(info, stream.tar.extractfile(info) if info.isreg() else None)
        read_all = True
    except tarfile.TarError as exc:
        raise GpusnapError(f"{src} is not a readable checkpoint archive ({exc})") from None
    finally:
        complaint = stream.close(read_to_end=read_all)
        if not (read_all and not complaint):
            # Never finish a stream that failed: an end marker would make a cut
            # archive look whole to its reader.
            dst.closed = dst.fileobj.closed = True
    dst.close()
    if complaint:
        raise GpusnapError(f"{src} is not a valid zstd archive ({complaint})",
                           "the file is damaged or truncated")
