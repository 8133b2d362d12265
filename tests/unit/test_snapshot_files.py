"""ops/snapshot_files: CRIU's own open-file check, made on what an export holds."""

from __future__ import annotations

import io
import struct
import subprocess
import tarfile
from pathlib import Path

import pytest

from gpusnap.criu.images import IMG_COMMON_MAGIC, MNTS_MAGIC, ImageError
from gpusnap.ops.snapshot_files import REMAP_FPATH_MAGIC, unrestorable
from gpusnap.pages.file_pages import FILES_MAGIC


def _varint(n: int) -> bytes:
    out = b""
    while True:
        b, n = n & 0x7F, n >> 7
        out += bytes([b | (0x80 if n else 0)])
        if not n:
            return out


def _field(num: int, value: int | bytes) -> bytes:
    if isinstance(value, int):
        return _varint(num << 3) + _varint(value)
    return _varint(num << 3 | 2) + _varint(len(value)) + value


def _image(magic: int, entries: list[bytes]) -> bytes:
    return struct.pack("<II", IMG_COMMON_MAGIC, magic) + b"".join(
        struct.pack("<I", len(e)) + e for e in entries)


def _reg(fid: int, name: str, mnt_id: int, size: int | None) -> bytes:
    reg = _field(1, fid) + _field(6, name.encode()) + _field(7, mnt_id * 2)  # sint32: zigzag
    if size is not None:
        reg += _field(8, size)
    return _field(1, 1) + _field(2, fid) + _field(3, reg)  # file_entry: type REG, id, reg


def _folder(tmp_path: Path, regs: list[bytes], diff: dict[str, bytes],
            remapped: tuple[int, ...] = ()) -> Path:
    images = tmp_path / "checkpoint"
    images.mkdir()
    (images / "inventory.img").write_bytes(b"")
    mounts = [_field(1, 1) + _field(2, 77) + _field(7, b"/"),
              _field(1, 5) + _field(2, 79) + _field(7, b"/dev")]
    (images / "mountpoints-13.img").write_bytes(_image(MNTS_MAGIC, mounts))
    (images / "files.img").write_bytes(_image(FILES_MAGIC, regs))
    if remapped:
        (images / "remap-fpath.img").write_bytes(
            _image(REMAP_FPATH_MAGIC, [_field(1, i) + _field(2, 100 + i) for i in remapped]))
    with tarfile.open(tmp_path / "rootfs-diff.tar", "w") as tar:
        for name, data in diff.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return tmp_path


def test_a_file_renamed_before_the_export_is_named(tmp_path):
    layer = tmp_path / "layer"
    (layer / "bin").mkdir(parents=True)
    (layer / "bin" / "busybox").write_bytes(b"x" * 10)
    folder = _folder(tmp_path, [_reg(1, "/bin/busybox", 77, 10), _reg(2, "/tmp/c.new", 77, 0),
                                _reg(3, "/dev/null", 79, None)],
                     {"tmp/c": b"41\n"})
    assert unrestorable(folder, folder / 'x.tar', [str(layer)]) == ["/tmp/c.new (gone)"]


def test_a_file_resized_before_the_export_is_named(tmp_path):
    folder = _folder(tmp_path, [_reg(2, "/tmp/c.new", 77, 0)], {"tmp/c.new": b"42\n"})
    assert unrestorable(folder, folder / 'x.tar', []) == ["/tmp/c.new (3 bytes, 0 at the dump)"]


def test_what_criu_restores_itself_or_does_not_check_passes(tmp_path):
    # a ghost (unlinked at the dump: remapped), an append-only log (no size), a layer's file
    layer = tmp_path / "layer"
    layer.mkdir()
    (layer / "app").write_bytes(b"abc")
    folder = _folder(tmp_path, [_reg(1, "/tmp/ghost", 77, 5), _reg(2, "/var/log/app.log", 77, None),
                                _reg(3, "/app", 77, 3), _reg(4, "/tmp/c", 77, 3)],
                     {"tmp/c": b"41\n"}, remapped=(1,))
    assert unrestorable(folder, folder / 'x.tar', [str(layer)]) == []


def test_a_dot_file_in_the_diff_is_found_by_its_name(tmp_path):
    folder = _folder(tmp_path, [_reg(2, "/.cache/x", 77, 3)], {"./.cache/x": b"abc"})
    assert unrestorable(folder, folder / 'x.tar', []) == []


@pytest.mark.parametrize("suffix", [".tar", ".tar.zst"])
def test_without_a_kept_rootfs_diff_the_export_is_read(tmp_path, suffix):
    """Podman 5.8 removes rootfs-diff.tar after the export, --keep or not."""
    folder = _folder(tmp_path, [_reg(2, "/tmp/c.new", 77, 0)], {"tmp/c": b"41\n"})
    export = tmp_path / f"x{suffix}"
    with tarfile.open(tmp_path / "x.tar", "w") as tar:
        tar.add(tmp_path / "checkpoint", "checkpoint")
        tar.add(tmp_path / "rootfs-diff.tar", "rootfs-diff.tar")
    if suffix == ".tar.zst":
        subprocess.run(["zstd", "-q", "--rm", str(tmp_path / "x.tar"), "-o", str(export)], check=True)
    (tmp_path / "rootfs-diff.tar").unlink()
    assert unrestorable(folder, export, []) == ["/tmp/c.new (gone)"]


def test_no_images_is_an_error_not_a_pass(tmp_path):
    with pytest.raises(ImageError, match="no CRIU images"):
        unrestorable(tmp_path, tmp_path / "x.tar", [])


def test_a_damaged_rootfs_diff_is_a_finding_not_a_skip(tmp_path):
    """containers/storage's archiver logs a file that shrank while it copied it and
    goes on: the tar it leaves ends mid-member, and Podman's restore fails on it
    (a host push of a container rewriting /tmp/c: 'unexpected end of data')."""
    folder = _folder(tmp_path, [_reg(2, "/tmp/c", 77, 3)], {"tmp/c": b"41\n", "tmp/d": b"x" * 4096})
    diff = tmp_path / "rootfs-diff.tar"
    diff.write_bytes(diff.read_bytes()[:2048])  # cut in the second member's data, as Go's writer stops
    found = unrestorable(folder, tmp_path / "x.tar", [])
    assert len(found) == 1 and found[0].startswith("the root filesystem in the export (damaged: "), found
