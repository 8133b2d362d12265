"""pages/memory.py: pages in RAM only where the host can spare it."""

from __future__ import annotations

import os

from gpusnap.pages import memory

GiB = 1 << 30


def test_meminfo_reads_bytes(tmp_path):
    f = tmp_path / "meminfo"
    f.write_text("MemTotal:       131072000 kB\nMemAvailable:   100000000 kB\nHugePages_Total:  0\n")
    info = memory.meminfo(f)
    assert info["MemTotal"] == 131072000 * 1024 and info["HugePages_Total"] == 0
    assert memory.meminfo(tmp_path / "missing") == {}


def test_ram_only_with_the_reserve_left(tmp_path, monkeypatch):
    monkeypatch.delenv(memory.ENV, raising=False)
    # the memory reserve alone: the folder's room is the next test's (this host's disk
    # had under 37 GiB free once the suite's temporary files were there)
    monkeypatch.setattr(memory.shutil, "disk_usage",
                        lambda path: __import__("types").SimpleNamespace(free=1 << 50))
    info = {"MemTotal": 128 * GiB, "MemAvailable": 100 * GiB}
    # 128 GiB host: 8 GiB reserve. 37 GB of pages + 34 GB moved off the GPU first: fits
    assert memory.ram_dir(37 * GiB, 34 * GiB, info, root=tmp_path) == tmp_path
    # the target: the pages file and the process restored from it
    assert memory.ram_dir(37 * GiB, 37 * GiB, info, root=tmp_path) == tmp_path
    assert memory.ram_dir(47 * GiB, 47 * GiB, info, root=tmp_path) is None
    assert memory.reserve(8 * GiB) == 2 * GiB and memory.reserve(128 * GiB) == 8 * GiB
    assert memory.ram_dir(1 << 20, 0, {}, root=tmp_path) is None  # meminfo unreadable


def test_the_folder_must_have_the_room_and_the_switch_wins(tmp_path, monkeypatch):
    info = {"MemTotal": 1 << 50, "MemAvailable": 1 << 50}
    monkeypatch.delenv(memory.ENV, raising=False)
    assert memory.ram_dir(1 << 50, 0, info, root=tmp_path) is None  # more than the disk holds
    assert memory.ram_dir(1 << 20, 0, info, root=tmp_path / "absent") is None
    monkeypatch.setenv(memory.ENV, "0")
    assert memory.ram_dir(1 << 20, 0, info, root=tmp_path) is None
    monkeypatch.setenv(memory.ENV, "1")
    assert memory.ram_dir(1 << 20, 0, {}, root=tmp_path) == tmp_path


MOUNTINFO = """\
22 1 0:21 / /dev/shm rw,nosuid,nodev shared:3 - tmpfs tmpfs rw,inode64
98 25 0:45 / /run/gpusnap/ram rw,relatime shared:50 - tmpfs gpusnap-ram rw,size=22020096k,mode=700,huge=always,inode64
99 25 0:46 / /mnt/plain rw,relatime shared:51 - tmpfs tmpfs rw,size=1024k,inode64
100 25 0:47 / /mnt/ext rw,relatime shared:52 - ext4 /dev/vdb rw,huge=always
"""


def test_huge_mounted_reads_the_super_options(tmp_path):
    info = tmp_path / "mountinfo"
    info.write_text(MOUNTINFO)
    assert memory.huge_mounted(memory.HUGE_ROOT, info)
    assert not memory.huge_mounted(memory.Path("/mnt/plain"), info)  # tmpfs, 4 KiB pages
    assert not memory.huge_mounted(memory.Path("/mnt/ext"), info)  # not a tmpfs
    assert not memory.huge_mounted(memory.Path("/dev/shm"), info)
    assert not memory.huge_mounted(memory.HUGE_ROOT, tmp_path / "missing")


def test_the_switch_keeps_dev_shm(monkeypatch):
    monkeypatch.setenv(memory.HUGE_ENV, "0")
    assert memory.ram_root() == memory.RAM_ROOT


def test_in_ram_knows_both_roots(tmp_path):
    assert memory.in_ram(memory.HUGE_ROOT / "gpusnap-push-x" / "pages-1.img")
    assert memory.in_ram(memory.RAM_ROOT / "gpusnap-pull-x" / "pages-1.img")
    assert not memory.in_ram(tmp_path / "pages-1.img")
    assert memory.in_ram(tmp_path / "a", root=tmp_path)


def test_a_held_mount_lock_is_waited_for_within_a_bound(tmp_path, monkeypatch):
    """A command stopped (Ctrl-Z) holding the huge-page mount's lock must not
    hold every later push and restore: they go on without huge pages."""
    import fcntl
    import time

    monkeypatch.setattr(memory, "MOUNT_S", 0.2)
    monkeypatch.setattr(memory.os, "geteuid", lambda: 0)
    point = tmp_path / "ram"
    with open(tmp_path / ".ram.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        started = time.monotonic()
        assert memory.mount_huge(point) is False
        assert time.monotonic() - started < 5
    assert not memory.huge_mounted(point)


def test_folder_bytes_counts_the_regular_files_and_nothing_of_what_is_gone(tmp_path):
    (tmp_path / "000.img").write_bytes(b"x" * 10)
    (tmp_path / "000.img.chunks").write_bytes(b"y" * 3)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "deep").write_bytes(b"z" * 100)  # not this folder's own file
    os.symlink("/nonexistent", tmp_path / "dangling")
    assert memory.folder_bytes(tmp_path) == 13
    assert memory.folder_bytes(tmp_path / "gone") == 0
    assert memory.mtime(tmp_path / "gone") == 0.0 < memory.mtime(tmp_path)
