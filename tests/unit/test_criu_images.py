"""gpusnap.criu.images: CRIU's mount table read from a real checkpoint, without crit."""

from __future__ import annotations

import struct

import pytest

from gpusnap.criu.images import (ImageError, dev_tmpfs_image, external_mount_keys, parse_mountpoints,
                                 read_mounts)
from tests.unit.spec_samples import EXPORT

IMAGES = EXPORT / "checkpoint"


def test_the_real_mount_table_as_crit_shows_it():
    mounts = {m.mountpoint: m for m in read_mounts(IMAGES)}
    assert len(mounts) == len(read_mounts(IMAGES)) == 29  # as `crit show` counts them
    dev = mounts["/dev"]
    assert (dev.mnt_id, dev.fstype, dev.root_dev, dev.source, dev.ext_key) == (124, 5, 56, "tmpfs", None)
    hosts = mounts["/etc/hosts"]
    assert hosts.ext_key == "/etc/hosts" and hosts.root_dev == 254 << 20 and hosts.parent_mnt_id == 122


def test_external_keys_are_the_binds_runc_named():
    assert external_mount_keys(IMAGES) == {
        "/dev/null", "/dev/shm", "/etc/hostname", "/etc/hosts", "/run/.containerenv",
        *(f"/sys/fs/cgroup/{c}" for c in ("blkio", "cpu", "cpuacct", "cpuset", "devices", "freezer",
                                          "memory", "pids", "systemd"))}


def test_the_dev_tmpfs_image_is_found_by_its_device():
    assert dev_tmpfs_image(IMAGES) == IMAGES / "tmpfs-dev-56.tar.gz.img"
    assert dev_tmpfs_image(EXPORT) is None  # no mountpoints image there


@pytest.mark.parametrize("data, message", [
    (b"", "too short"),
    (struct.pack("<II", 0x54564319, 0x12345678), "not a CRIU mountpoints image"),
    (struct.pack("<III", 0x54564319, 0x55563928, 40) + b"\x08\x05", "truncated entry"),
    (struct.pack("<III", 0x54564319, 0x55563928, 2) + b"\x08\xff", "truncated varint"),
])
def test_damaged_images_are_refused(data, message):
    with pytest.raises(ImageError, match=message):
        parse_mountpoints(data)
