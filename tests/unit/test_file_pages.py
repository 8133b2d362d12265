"""pages/file_pages.py: which file pages CRIU will copy on write, found in CRIU's
images (mm, pagemap, files, mountpoints) as CRIU writes them, and read ahead
from the container's root and bind mounts; the real thing runs in tests/gpu (coldstart) and
through Podman in tests/integration/test_page_fill.py."""

from __future__ import annotations

import json
import os
import struct
import time
from pathlib import Path

import pytest

from gpusnap import journal
from gpusnap.criu import mm
from gpusnap.action import action, read_ahead_child
from gpusnap.pages import file_pages, fill_plan
from gpusnap.criu import pagemap as pm
from gpusnap.criu.images import IMG_COMMON_MAGIC, MNTS_MAGIC, ImageError
from tests.unit.test_fill_plan import _msg

PAGE = pm.PAGE
FILE = mm.VMA_AREA_REGULAR | mm.VMA_FILE_PRIVATE
ANON = mm.VMA_AREA_REGULAR | mm.VMA_ANON_PRIVATE
ROOT_MNT, BIND_MNT, OTHER_MNT = 201, 305, 411


def _image(magic: int, entries: list[bytes]) -> bytes:
    return struct.pack("<II", IMG_COMMON_MAGIC, magic) + b"".join(
        struct.pack("<I", len(e)) + e for e in entries)


def _zigzag(n: int) -> int:
    return n << 1 if n >= 0 else (-n << 1) - 1


def _reg(fid: int, name: str, mnt: int, size: int) -> bytes:
    return _msg([(1, fid), (2, 0), (3, 0), (5, b""), (6, name.encode()), (7, _zigzag(mnt)), (8, size)])


def _write(folder: Path, vmas: list[tuple[int, int, int, int, int]], runs: list[tuple[int, int]],
           files: list[bytes], vpid: int = 1) -> None:
    """vmas: (start, end, status, pgoff, shmid); runs: (vaddr, pages) as CRIU's pagemap."""
    folder.mkdir(exist_ok=True)
    body = _msg([(1, 0x400000)] + [(14, _msg([(1, s), (2, e), (3, off), (4, fid), (5, 3), (6, 2),
                                              (7, status), (8, -1 & 0xFFFFFFFF)]))
                                   for s, e, status, off, fid in vmas])
    (folder / f"mm-{vpid}.img").write_bytes(_image(mm.MM_MAGIC, [body]))
    (folder / f"pagemap-{vpid}.img").write_bytes(
        pm.serialize(pm.Pagemap(1, tuple(pm.Run(v, n, pm.PE_PRESENT) for v, n in runs))))
    (folder / "files.img").write_bytes(_image(file_pages.FILES_MAGIC, [
        _msg([(1, file_pages.FD_REG), (2, _fid(f)), (3, f)]) for f in files]))
    (folder / "mountpoints-13.img").write_bytes(_image(MNTS_MAGIC, [
        _msg([(1, 1), (2, ROOT_MNT), (3, 1), (4, 1), (7, b"/")]),
        _msg([(1, 5), (2, BIND_MNT), (3, 2), (4, ROOT_MNT), (7, b"/data")]),
        _msg([(1, 6), (2, OTHER_MNT), (3, 3), (4, ROOT_MNT), (7, b"/scratch")])]))


def _fid(reg: bytes) -> int:
    return next(v for n, _, v in file_pages.fields_of(reg) if n == 1)


@pytest.fixture
def layout(tmp_path):
    """A bundle as Podman lays it out: config.json (its root, a bind mount of a
    host folder on /data), the root, checkpoint/ beside."""
    root, host = tmp_path / "merged", tmp_path / "host-data"
    (root / "usr/lib").mkdir(parents=True)
    host.mkdir()
    (root / "usr/lib/libbig.so").write_bytes(b"\0" * (64 * PAGE))
    (root / "usr/lib/libchanged.so").write_bytes(b"\0" * PAGE)
    (host / "x.so").write_bytes(b"\0" * (2 * PAGE))
    (tmp_path / "config.json").write_text(json.dumps({
        "root": {"path": str(root)},
        "mounts": [{"destination": "/data", "type": "bind", "source": str(host),
                    "options": ["rbind", "ro"]},
                   {"destination": "/scratch", "type": "tmpfs", "source": "tmpfs"}]}))
    folder = tmp_path / "checkpoint"
    _write(folder,
           [(0x10000, 0x30000, FILE, 0x3000, 7),   # libbig.so's data, from offset 0x3000
            (0x30000, 0x40000, ANON, 0, 0),          # anonymous: CRIU writes no file page
            (0x40000, 0x42000, FILE, PAGE, 8),       # a file of the bind mount
            (0x50000, 0x52000, FILE, 0, 9),          # not in the root (removed since)
            (0x60000, 0x62000, FILE, 0, 10),         # changed since: not the size CRIU saw
            (0x70000, 0x72000, FILE, 0, 11)],        # on a mount the bundle does not bind
           [(0x11000, 2), (0x14000, 1), (0x2f000, 3), (0x41000, 1), (0x50000, 1), (0x60000, 1),
            (0x70000, 1)],
           [_reg(7, "/usr/lib/libbig.so", ROOT_MNT, 64 * PAGE),
            _reg(8, "/data/x.so", BIND_MNT, 2 * PAGE),
            _reg(9, "/usr/lib/gone.so", ROOT_MNT, PAGE),
            _reg(10, "/usr/lib/libchanged.so", ROOT_MNT, 2 * PAGE),
            _reg(11, "/scratch/y.so", OTHER_MNT, PAGE)])
    return folder, root, host


def test_the_pages_criu_writes_over_are_found_as_file_ranges(layout):
    folder, _, _ = layout
    ranges = file_pages.wanted(folder)
    # 0x11000 + 2 pages and 0x14000 (within GAP) merged; 0x2f000 runs past the area's end
    assert ranges[7] == [(0x3000 + 0x1000, 4 * PAGE), (0x3000 + 0x1f000, PAGE)]
    assert ranges[8] == [(2 * PAGE, PAGE)]  # the area maps x.so from its second page
    assert set(ranges) == {7, 8, 9, 10, 11}  # the anonymous area's page is no file's


def test_read_ahead_asks_for_the_files_criu_saw_where_the_bundle_mounts_them(layout):
    folder, root, host = layout
    dirs = file_pages.host_dirs(folder)
    assert dirs == {"/": root, "/data": host}  # the tmpfs is no host folder
    done = file_pages.read_ahead(folder, dirs)
    assert (done.files, done.bytes, done.skipped) == (2, 6 * PAGE, 3)


def test_a_file_bind_mounted_on_its_own_and_paths_outside_a_mount():
    reg = file_pages.RegFile("/etc/ld.so.cache", 9, 100)
    dirs = {"/": Path("/r"), "/etc/ld.so.cache": Path("/host/ld.so.cache")}
    assert file_pages.host_path(reg, {9: "/etc/ld.so.cache"}, dirs) == Path("/host/ld.so.cache")
    assert file_pages.host_path(file_pages.RegFile("/etc/x", 9, 1), {9: "/etc/ld.so.cache"},
                                dirs) is None
    assert file_pages.host_path(file_pages.RegFile("/a/b", 1, 1), {1: "/"}, dirs) == Path("/r/a/b")
    assert file_pages.host_path(file_pages.RegFile("/a/b", 2, 1), {1: "/"}, dirs) is None


def test_a_folder_without_a_bundle_or_files_image_reads_nothing(tmp_path, layout):
    folder, _, _ = layout
    assert file_pages.host_dirs(tmp_path / "elsewhere" / "checkpoint") is None
    (folder / "files.img").unlink()
    assert file_pages.read_ahead(folder, file_pages.host_dirs(folder)).files == 0


def test_a_damaged_files_image_is_an_image_error(layout):
    folder, _, _ = layout
    (folder / "files.img").write_bytes(struct.pack("<II", IMG_COMMON_MAGIC, 0x1234))
    with pytest.raises(ImageError, match="files image"):
        file_pages.read_ahead(folder, file_pages.host_dirs(folder))


def test_pre_restore_reads_ahead_and_says_so_unless_turned_off(layout, tmp_path, monkeypatch):
    folder, _, _ = layout
    monkeypatch.setenv("GPUSNAP_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setattr(fill_plan, "SETTINGS", tmp_path / "page-fill.json")
    action.pre_restore(str(folder), 4301, action.fill_settings())
    said = [e for e in journal.read() if e["event"] == "file-pages-read-ahead"]
    assert [(e["files"], e["bytes"], e["skipped"]) for e in said] == [(2, 6 * PAGE, 3)]
    fill_plan.SETTINGS.write_text('{"read_ahead": false}')
    action.pre_restore(str(folder), 4302, action.fill_settings())
    assert len([e for e in journal.read() if e["event"] == "file-pages-read-ahead"]) == 1


def test_a_read_ahead_that_hangs_is_stopped_and_the_restore_goes_on(tmp_path, monkeypatch):
    """The child that reads ahead (beside fill planning) is always reaped before
    pre-restore ends; one stuck on a mount that does not answer is killed."""
    monkeypatch.setenv("GPUSNAP_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setattr(read_ahead_child, "READ_AHEAD_WAIT_S", 0.3)
    monkeypatch.setattr(read_ahead_child, "read_ahead", lambda folder: time.sleep(60))
    started = time.monotonic()
    pid = read_ahead_child.start(tmp_path)
    read_ahead_child.reap(pid)
    assert time.monotonic() - started < 5
    with pytest.raises(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)  # reaped: nothing left for CRIU
    assert [e["error"] for e in journal.read() if e["event"] == "file-pages-not-read-ahead"] \
        == ["stopped after 0.3 s"]


def test_the_agents_pre_restore_answers_before_its_read_ahead_ends(tmp_path, monkeypatch):
    """The agent is not CRIU's child: its read-ahead is reaped after the step
    (read_ahead_child.Later), never in CRIU's stop; one that hangs is killed."""
    monkeypatch.setenv("GPUSNAP_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setattr(read_ahead_child, "READ_AHEAD_WAIT_S", 1.0)
    monkeypatch.setattr(read_ahead_child, "read_ahead", lambda folder: time.sleep(0.4))
    images = tmp_path / "images"
    images.mkdir()
    later = read_ahead_child.Later()
    started = time.monotonic()
    action.pre_restore(str(images), os.getpid(), fill_plan.Settings(enabled=False), later)
    assert time.monotonic() - started < 0.3 and later.pending()
    later.reap_ended()
    assert later.pending()  # still reading: left running
    time.sleep(0.6)
    later.reap_ended()
    assert not later.pending()
    monkeypatch.setattr(read_ahead_child, "read_ahead", lambda folder: time.sleep(60))
    hung = read_ahead_child.start(images)
    later.add(hung)
    time.sleep(1.1)
    started = time.monotonic()
    later.reap_ended()  # past its time: killed, never waited for
    assert time.monotonic() - started < 0.1
    deadline = time.monotonic() + 10
    while later.pending() and time.monotonic() < deadline:
        time.sleep(0.02)
        later.reap_ended()  # reaped once it has ended
    assert not later.pending()
    with pytest.raises(ChildProcessError):
        os.waitpid(hung, os.WNOHANG)
    left = read_ahead_child.start(images)
    later.add(left)
    later.kill_all()  # the agent leaves: killed at once, not waited for
    assert not later.pending()
    os.waitpid(left, 0)
    assert [e["error"] for e in journal.read() if e["event"] == "file-pages-not-read-ahead"] \
        == ["stopped after 1 s"]


def test_no_host_file_outside_the_mount_and_no_fifo_or_device_is_opened(layout):
    """Names come from the images, links from the container's files: a link out of
    the root, a FIFO (whose open would wait) or a device (whose open may act) is
    skipped, never opened."""
    folder, root, _ = layout
    outside = root.parent / "host-secret.so"
    outside.write_bytes(b"\0" * (64 * PAGE))
    (root / "usr/lib/libbig.so").unlink()
    (root / "usr/lib/libbig.so").symlink_to(outside)  # same size: only the link gives it away
    dirs = file_pages.host_dirs(folder)
    assert file_pages.read_ahead(folder, dirs).files == 1  # x.so of the bind mount only
    (root / "usr/lib/libbig.so").unlink()
    os.mkfifo(root / "usr/lib/libbig.so")
    started = time.monotonic()
    assert file_pages.read_ahead(folder, dirs).files == 1
    assert time.monotonic() - started < 5


def test_a_fork_that_fails_skips_the_read_ahead(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUSNAP_STATE_DIR", str(tmp_path / "state"))

    def no_fork():
        raise BlockingIOError(11, "Resource temporarily unavailable")

    monkeypatch.setattr(os, "fork", no_fork)
    monkeypatch.setattr(read_ahead_child, "read_ahead",
                        lambda folder: pytest.fail("read inline, without its time limit"))
    assert read_ahead_child.start(tmp_path) is None
    assert any(e["event"] == "file-pages-not-read-ahead" and "fork" in e["error"]
               for e in journal.read())
