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

import errno
import json
import os
import subprocess
import tarfile
from pathlib import Path

from gpusnap import PLAN_NAME
from gpusnap.criu.devtmpfs import DevTarError, rewrite_dev_tar
from gpusnap.criu.images import ImageError, dev_tmpfs_name, parse_mountpoints
from gpusnap.errors import GpusnapError
from gpusnap.gpu.nodes import DeviceRemap
from gpusnap.oci.spec import SpecError, rewrite_config_dump, rewrite_spec
from gpusnap.runtime.stream import BROKEN_END, decompression_failed
from gpusnap.tarstream import GZIP_MAGIC, ZSTD_MAGIC

_COPY_BUFFER = 1 << 20
_IMAGES = "checkpoint/"
BLOCK = tarfile.BLOCKSIZE
NUL = b"\0"
NUL_BLOCK = NUL * BLOCK


def _norm(name: str) -> str:
    return (name[2:] if name.startswith("./") else name).rstrip("/")


class _Editor:
    """Edits the few members that name devices; everything else passes through."""

    def __init__(self, remap: DeviceRemap) -> None:
        self.remap = remap
        self.dev_image: str | None = None
        self.mounts_read = False  # CRIU's mount table seen: dev_image is known (or there is none)

    def wants(self, name: str) -> bool:
        if self.remap.empty:  # a plan that moves nothing: carried, nothing edited
            return False
        if self.mounts_read and name.startswith(_IMAGES + "tmpfs-"):
            return name == self.dev_image  # the mount table named /dev's: only that one
        return names_devices(name)

    def edit(self, name: str, data: bytes) -> bytes:
        """``data`` as the moved container needs it; GpusnapError where it cannot move."""
        try:
            return self._edit(name, data)
        except (SpecError, DevTarError, ImageError, ValueError) as exc:
            raise GpusnapError(f"cannot move the devices in {name}: {exc}",
                               "nothing was restored; the same `gpusnap restore` with "
                               "--dry-run shows the plan") from None

    def _edit(self, name: str, data: bytes) -> bytes:
        if name == "spec.dump":
            return _json(rewrite_spec(json.loads(data), self.remap))
        if name == "config.dump":
            return _json(rewrite_config_dump(json.loads(data), self.remap))
        if name.startswith(_IMAGES + "mountpoints-"):
            found = dev_tmpfs_name(parse_mountpoints(data))
            self.mounts_read = True
            if found:
                self.dev_image = _IMAGES + found
            return data  # read only
        if not self.mounts_read:
            # Go's tar walks the directory in lexical order: mountpoints-* come first.
            raise GpusnapError(f"the archive holds {name} before CRIU's mount table",
                               "re-export the container with `gpusnap checkpoint --export`")
        return rewrite_dev_tar(data, self.remap)


def names_devices(name: str) -> bool:
    """Whether a member of the archive may name the container's devices: the
    ones a moved restore edits, or reads to find which tmpfs image is /dev's
    (CRIU names each tmpfs-dev-<mount id>, /dev's among them)."""
    return (name in ("spec.dump", "config.dump")
            or (name.startswith(_IMAGES + "mountpoints-") and name.endswith(".img"))
            or name.startswith(_IMAGES + "tmpfs-dev-"))


def edit_members(members: dict[str, bytes], remap: DeviceRemap,
                 plan: dict | None) -> dict[str, bytes]:
    """The members of ``members`` (path: data; those names_devices picks) that
    change when the devices move, as the restore needs them, and the plan as
    checkpoint/gpusnap-plan.json: what a streamed restore writes in their place.
    Raises GpusnapError where they cannot move, before anything is restored."""
    editor = _Editor(remap)
    edited = {}
    # CRIU's mount table first: it names the /dev image to edit.
    for name in sorted(members, key=lambda n: not n.startswith(_IMAGES + "mountpoints-")):
        if editor.wants(name):
            data = editor.edit(name, members[name])
            if data is not members[name]:
                edited[name] = data
    if plan is not None:
        edited[_IMAGES + PLAN_NAME] = _json(plan)
    return edited


def _json(value: dict) -> bytes:
    return json.dumps(value).encode()


class _Source:
    """The archive as raw tar bytes on a file descriptor (zstd and gzip decompressed
    by their own processes). Members pass through with os.splice, not tarfile's
    stream reader, which copies every byte a few times."""

    def __init__(self, path: Path) -> None:
        with open(path, "rb") as f:
            magic = f.read(4)
        self.proc: subprocess.Popen | None = None
        tool = "zstd" if magic.startswith(ZSTD_MAGIC) else "gzip" if magic.startswith(GZIP_MAGIC) \
            else None
        if tool:
            self.proc = subprocess.Popen([tool, "-dcq", str(path)], stdout=subprocess.PIPE,
                                         stderr=subprocess.PIPE)
            self.fd = self.proc.stdout.fileno()
        else:
            self.fd = os.open(path, os.O_RDONLY)

    def exact(self, n: int) -> bytes:
        parts, left = [], n
        while left:
            got = os.read(self.fd, min(left, _COPY_BUFFER))
            if not got:
                raise EOFError(f"the archive ends inside a member ({n - left} of {n} bytes)")
            parts.append(got)
            left -= len(got)
        return b"".join(parts)

    def copy(self, n: int, out: int) -> None:
        while n:
            try:
                moved = os.splice(self.fd, out, min(n, _COPY_BUFFER))
            except OSError as exc:
                if exc.errno != errno.EINVAL:  # EINVAL: neither end is a pipe
                    raise
                data = self.exact(min(n, _COPY_BUFFER))
                _write_all(out, data)
                moved = len(data)
            if not moved:
                raise EOFError("the archive ends inside a member")
            n -= moved

    def close(self, read_to_end: bool) -> str | None:
        if self.proc is None:
            os.close(self.fd)
            return None
        if read_to_end:  # the padding after the end blocks: zstd must finish, not die of EPIPE
            while self.proc.stdout.read(1 << 20):
                pass
        self.proc.stdout.close()  # a reader that stopped early: zstd ends on EPIPE
        failed = decompression_failed(self.proc)
        return failed if read_to_end else None


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _padded(size: int) -> int:
    return size + (-size % BLOCK)


def _members(src: _Source):
    """(raw header bytes, TarInfo with its real name) per member; None at the end.

    The raw bytes include PAX and GNU long-name records, so a member that is not
    edited is written back exactly as it came.
    """
    while True:
        raw = src.exact(BLOCK)
        if raw == NUL_BLOCK:
            yield None
            return
        info = tarfile.TarInfo.frombuf(raw, tarfile.ENCODING, "surrogateescape")
        name, size = None, None
        while info.type in (tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.GNUTYPE_LONGNAME,
                            tarfile.GNUTYPE_LONGLINK):
            payload = src.exact(_padded(info.size))
            raw += payload
            if info.type == tarfile.GNUTYPE_LONGNAME:
                name = payload[:info.size].rstrip(b"\0").decode("utf-8", "surrogateescape")
            elif info.type == tarfile.XHDTYPE:
                records = _pax_records(payload[:info.size])
                name = records.get("path", name)
                size = int(records["size"]) if "size" in records else size
            header = src.exact(BLOCK)
            raw += header
            info = tarfile.TarInfo.frombuf(header, tarfile.ENCODING, "surrogateescape")
        if name:
            info.name = name
        if size is not None:
            # A member of 8 GiB or more (CRIU's pages of a GPU process) has its
            # size only in the PAX record: Go's tar leaves the header's field 0.
            info.size = size
        yield raw, info


def _pax_records(records: bytes) -> dict[str, str]:
    """PAX extended header records ("<len> <key>=<value>\n"...) by key."""
    found, pos = {}, 0
    while pos < len(records):
        space = records.index(b" ", pos)
        length = int(records[pos:space])
        if length <= 0:
            raise ValueError("a PAX record of no length")
        key, _, value = records[space + 1:pos + length - 1].partition(b"=")
        found[key.decode("utf-8", "surrogateescape")] = value.decode("utf-8", "surrogateescape")
        pos += length
    return found


def _header(name: str, size: int, like: tarfile.TarInfo) -> bytes:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = size, like.mode or 0o600, like.mtime
    info.uid, info.gid, info.uname, info.gname = like.uid, like.gid, like.uname, like.gname
    return info.tobuf(format=tarfile.PAX_FORMAT)


def rewrite_archive(src_path: Path, out: int, remap: DeviceRemap, plan: dict | None) -> None:
    """Write ``src_path`` (a Podman export, any compression) to the file descriptor
    ``out`` as a plain tar with its devices moved per ``remap`` and ``plan`` added as
    checkpoint/gpusnap-plan.json.

    Raises GpusnapError for an archive that cannot be rewritten and OSError when
    the reader goes away (Podman reads only the head of the archive at first).
    On failure the stream ends with a broken header: a reader sees a cut archive.
    """
    try:
        _rewrite(src_path, out, remap, plan)
    except (GpusnapError, ValueError, KeyError, TypeError):
        # A stream cut at a member boundary reads as a whole archive to a tar
        # reader: end it with a header whose checksum is wrong (Go's tar, as in
        # Podman, and GNU tar fail on it; Python's tarfile alone shrugs).
        try:
            _write_all(out, BROKEN_END)
        except OSError:
            pass
        raise


def _rewrite(src_path: Path, out: int, remap: DeviceRemap, plan: dict | None) -> None:
    editor = _Editor(remap)
    src = _Source(src_path)
    plan_data = _json(plan) if plan is not None else None
    read_all = False
    try:
        for item in _members(src):
            if item is None:
                break  # the end blocks only once zstd said its checksum held (below)
            raw, info = item
            name = _norm(info.name)
            if plan is not None and name == _IMAGES + PLAN_NAME and info.isreg():
                src.exact(_padded(info.size))  # an older restore's plan: this one replaces it
                continue
            if plan_data is not None and name.startswith(_IMAGES):
                like = tarfile.TarInfo()
                like.mode, like.mtime = 0o600, info.mtime
                _write_all(out, _header(_IMAGES + PLAN_NAME, len(plan_data), like)
                           + plan_data + NUL * (-len(plan_data) % BLOCK))
                plan_data = None
            if info.isreg() and editor.wants(name):
                data = editor.edit(name, src.exact(_padded(info.size))[:info.size])
                _write_all(out, _header(info.name, len(data), info) + data
                           + NUL * (-len(data) % BLOCK))
            else:
                _write_all(out, raw)
                if info.isreg() and info.size:
                    src.copy(_padded(info.size), out)
        read_all = True
    except (tarfile.TarError, EOFError, ValueError) as exc:
        raise GpusnapError(f"{src_path} is not a readable checkpoint archive ({exc})") from None
    finally:
        complaint = src.close(read_to_end=read_all)
    if complaint:
        raise GpusnapError(f"{src_path} is not a valid archive ({complaint})",
                           "the file is damaged or truncated")
    _write_all(out, NUL_BLOCK * 2)
