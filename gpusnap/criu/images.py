"""Read the mount table CRIU saved (mountpoints-*.img) without crit or protobuf.

A CRIU image is two little-endian u32 magics, then entries of a u32 length and
a protobuf message. Only a few scalar fields of mnt_entry (images/mnt.proto)
are needed: which mounts are external (ext_key, field 18) and which tmpfs is
the container's /dev (its contents travel as tmpfs-dev-<root_dev>.tar.gz.img).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

from gpusnap.proto.wire import WireError
from gpusnap.proto.wire import fields as wire_fields

IMG_COMMON_MAGIC = 0x54564319
MNTS_MAGIC = 0x55563928
FSTYPE_TMPFS = 5
_FIELDS = {1: "fstype", 2: "mnt_id", 3: "root_dev", 4: "parent_mnt_id", 7: "mountpoint",
           8: "source", 18: "ext_key"}


class ImageError(ValueError):
    pass


@dataclass(frozen=True)
class MountEntry:
    mnt_id: int
    parent_mnt_id: int
    fstype: int
    root_dev: int  # kernel encoding: major << 20 | minor
    mountpoint: str
    source: str
    ext_key: str | None = None


def fields_of(data: bytes) -> list[tuple[int, int, int | bytes | None]]:
    """A message's (number, wire type, value) fields; a broken one is an ImageError."""
    try:
        return list(wire_fields(data))
    except WireError as exc:
        raise ImageError(str(exc)) from None


def _message(data: bytes) -> dict[str, int | str]:
    out: dict[str, int | str] = {}
    for number, _, value in fields_of(data):
        if number in _FIELDS and value is not None:
            out[_FIELDS[number]] = value.decode() if isinstance(value, bytes) else value
    return out


def messages(data: bytes) -> list[bytes]:
    """The u32-sized protobuf messages after an image's two magics (the caller checked them)."""
    out, pos = [], 8
    while pos < len(data):
        if pos + 4 > len(data):
            raise ImageError("truncated entry size")
        (size,) = struct.unpack_from("<I", data, pos)
        pos += 4
        if pos + size > len(data):
            raise ImageError("truncated entry")
        out.append(data[pos:pos + size])
        pos += size
    return out


def checked_messages(data: bytes, magic: int, kind: str, name: str = "") -> list[bytes]:
    """The messages of a CRIU ``kind`` image (second magic ``magic``); an
    ImageError, naming ``name`` where given, for anything else."""
    if len(data) < 8 or struct.unpack_from("<II", data) != (IMG_COMMON_MAGIC, magic):
        raise ImageError(f"{name + ' is ' if name else ''}not a CRIU {kind} image")
    return messages(data)


def parse_mountpoints(data: bytes) -> list[MountEntry]:
    if len(data) < 8:
        raise ImageError("not a CRIU image: too short")
    common, magic = struct.unpack_from("<II", data, 0)
    if common != IMG_COMMON_MAGIC or magic != MNTS_MAGIC:
        raise ImageError(f"not a CRIU mountpoints image (magic {common:#x} {magic:#x})")
    entries = []
    for message in messages(data):
        f = _message(message)
        entries.append(MountEntry(mnt_id=int(f.get("mnt_id", 0)),
                                  parent_mnt_id=int(f.get("parent_mnt_id", 0)),
                                  fstype=int(f.get("fstype", 0)), root_dev=int(f.get("root_dev", 0)),
                                  mountpoint=str(f.get("mountpoint", "")),
                                  source=str(f.get("source", "")),
                                  ext_key=f.get("ext_key")))  # type: ignore[arg-type]
    return entries


def read_mounts(image_dir: str | Path) -> list[MountEntry]:
    entries: list[MountEntry] = []
    for path in sorted(Path(image_dir).glob("mountpoints-*.img")):
        entries += parse_mountpoints(path.read_bytes())
    return entries


def external_mount_keys(image_dir: str | Path) -> set[str]:
    return {e.ext_key for e in read_mounts(image_dir) if e.ext_key}


def dev_tmpfs_name(entries: list[MountEntry]) -> str | None:
    """The image file name of the container's /dev tmpfs, from the mount table."""
    for entry in entries:
        if entry.mountpoint == "/dev" and entry.fstype == FSTYPE_TMPFS:
            return f"tmpfs-dev-{entry.root_dev}.tar.gz.img"
    return None


def dev_tmpfs_image(image_dir: str | Path) -> Path | None:
    """The tarball CRIU saved the container's /dev tmpfs in (device nodes included)."""
    name = dev_tmpfs_name(read_mounts(image_dir))
    path = Path(image_dir) / name if name else None
    return path if path is not None and path.exists() else None
