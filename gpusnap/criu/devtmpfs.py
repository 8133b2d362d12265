"""Rewrite the device nodes in the checkpoint's copy of the container's /dev.

runc makes a container's /dev a tmpfs and mknods its devices there; CRIU saves
that tmpfs as a tarball (tmpfs-dev-N.tar.gz.img) and at restore unpacks it,
device nodes with their old numbers included: runc creates no devices on
restore. So moving a GPU means editing the spec and this tarball alike. The
same DeviceRemap drives both; only numbers change with container paths
"keep", names and by-path links too with "host".
"""

from __future__ import annotations

import gzip
import io
import posixpath
import tarfile
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the remap is handed in: criu/ sits below the GPU code
    from gpusnap.gpu.nodes import DeviceRemap


class DevTarError(ValueError):
    pass


def _container_path(member: str, mount: str) -> str:
    rel = posixpath.normpath(member)
    return mount if rel == "." else posixpath.join(mount, rel)


def _member_name(path: str, mount: str) -> str:
    return "./" + posixpath.relpath(path, mount)


def rewrite_dev_tar(data: bytes, remap: DeviceRemap, mount: str = "/dev") -> bytes:
    """The tarball with moved nodes (and, for "host", their names and links) changed."""
    try:
        src = tarfile.open(fileobj=io.BytesIO(data), mode="r:gz")
        members = src.getmembers()
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise DevTarError(f"the /dev tmpfs image is not a gzip tarball ({exc})") from None
    out = io.BytesIO()
    names: dict[str, str] = {}
    # mtime 0 in the gzip header: the same input gives the same bytes
    with gzip.GzipFile(fileobj=out, mode="wb", mtime=0) as gz, \
            tarfile.open(fileobj=gz, mode="w", format=src.format) as dst:
        written: dict[str, tarfile.TarInfo] = {}
        for member in members:
            new = _edit(member, remap, mount)
            if new.name in names:
                if _same_node(written[new.name], new):
                    # The target's node was there already (libcuda mknods the GPUs it
                    # sees where the container may, e.g. under containerd): keep one.
                    continue
                raise DevTarError(f"rewriting /dev would create {_container_path(new.name, mount)} "
                                  f"twice (from {names[new.name]} and {member.name})")
            names[new.name] = member.name
            written[new.name] = new
            content = src.extractfile(member) if member.isfile() else None
            dst.addfile(new, content)
    return out.getvalue()


def _edit(member: tarfile.TarInfo, remap: DeviceRemap, mount: str) -> tarfile.TarInfo:
    path = _container_path(member.name, mount)
    new = member.replace() if hasattr(member, "replace") else _copy(member)
    if member.ischr():
        change = remap.node(member.devmajor, member.devminor)
        if change is not None:
            new.devmajor, new.devminor = change.new
            if remap.container_paths == "host" and path == change.old_path:
                new.name = _member_name(change.new_path, mount)
    elif member.issym() and remap.container_paths == "host":
        renamed = remap.path(path)
        if renamed:
            new.name = _member_name(renamed, mount)
        target = posixpath.normpath(posixpath.join(posixpath.dirname(path), member.linkname))
        node = remap.node_by_path(target)
        if node is not None:
            new_dir = posixpath.dirname(renamed or path)
            new.linkname = posixpath.relpath(node.new_path, new_dir)
    return new


def _same_node(a: tarfile.TarInfo, b: tarfile.TarInfo) -> bool:
    return a.ischr() and b.ischr() and (a.devmajor, a.devminor) == (b.devmajor, b.devminor)


def _copy(member: tarfile.TarInfo) -> tarfile.TarInfo:  # Python < 3.12 has no TarInfo.replace
    clone = tarfile.TarInfo(member.name)
    for attr in ("size", "mtime", "mode", "type", "linkname", "uid", "gid", "uname", "gname",
                 "devmajor", "devminor", "pax_headers"):
        setattr(clone, attr, getattr(member, attr))
    return clone
