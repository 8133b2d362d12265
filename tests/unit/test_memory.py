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


def _roomy(monkeypatch):
    monkeypatch.delenv(memory.ENV, raising=False)
    monkeypatch.setattr(memory.shutil, "disk_usage",
                        lambda path: __import__("types").SimpleNamespace(free=1 << 50))


def test_two_processes_choosing_ram_at_once_do_not_both_take_what_only_one_fits_in(tmp_path):
    """Two replicas started together each saw the same free memory and both
    wrote their pages to RAM that held one: the kernel then kills what it picks."""
    import subprocess
    import sys

    code = (
        "import os, sys, time, types\n"
        "from pathlib import Path\n"
        "from gpusnap.pages import memory\n"
        "memory.shutil.disk_usage = lambda p: types.SimpleNamespace(free=1 << 50)\n"
        "go = Path(sys.argv[1]) / 'go'\n"
        "while not go.exists(): time.sleep(0.005)\n"
        "info = {'MemTotal': 128 << 30, 'MemAvailable': 100 << 30}\n"
        "print('ram' if memory.ram_dir(40 << 30, 40 << 30, info, root=Path(sys.argv[1])) else 'disk', flush=True)\n"
        "sys.stdin.read()\n")  # holds until the test lets go
    env = {k: v for k, v in os.environ.items() if k != memory.ENV}
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=env) for _ in range(2)]
    try:
        (tmp_path / "go").touch()
        said = sorted(p.stdout.readline().strip() for p in procs)
    finally:
        for p in procs:
            p.communicate("", timeout=30)
    assert said == ["disk", "ram"]  # 100 GiB free, 80 held by the first, 8 the reserve
    from gpusnap.pages import holds
    assert [e.name for e in holds.ledger_dir().iterdir() if e.name != "lock"] in (
        [str(procs[0].pid)], [str(procs[1].pid)])


def test_a_hold_counts_less_what_its_folder_holds_and_ends_with_its_process(tmp_path, monkeypatch):
    import json
    import subprocess

    from gpusnap.pages import holds
    from gpusnap.procs import start_time

    _roomy(monkeypatch)
    other = subprocess.Popen(["sleep", "60"])
    try:
        folder = tmp_path / "gpusnap-pull-x"
        folder.mkdir()
        (folder / "pages-1.img").write_bytes(b"x" * (4 << 20))
        book = holds.ledger_dir()
        (book / str(other.pid)).write_text(json.dumps(
            {"started": start_time(other.pid), "bytes": 50 * GiB, "folder": str(folder)}))
        info = {"MemTotal": 128 * GiB, "MemAvailable": 100 * GiB}
        with holds.ledger() as ledger:
            assert ledger.others() == 50 * GiB - (4 << 20)
        assert memory.ram_dir(35 * GiB, 10 * GiB, info, root=tmp_path) is None  # 100 - 50 + 4 MiB < 45 + 8
        assert memory.ram_dir(40 * GiB, 0, info, root=tmp_path, hold=False) == tmp_path
        assert not (book / str(os.getpid())).exists()  # hold=False holds nothing
    finally:
        other.kill()
        other.wait()
    assert memory.ram_dir(30 * GiB, 10 * GiB, info, root=tmp_path) == tmp_path  # its hold ended with it
    assert not (book / str(other.pid)).exists()
    memory.hold_folder(tmp_path / "elsewhere")  # not under a RAM root: nothing to name
    held = json.loads((book / str(os.getpid())).read_text())
    assert held["bytes"] == 40 * GiB and held["folder"] == ""
    memory.let_go()
    assert not (book / str(os.getpid())).exists()


def test_a_ledger_whose_lock_is_held_past_its_bound_sends_the_pages_to_the_disk(tmp_path, monkeypatch):
    import fcntl
    import time

    from gpusnap.pages import holds

    _roomy(monkeypatch)
    monkeypatch.setattr(holds, "LOCK_S", 0.2)
    with open(holds.ledger_dir() / "lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        started = time.monotonic()
        assert memory.ram_dir(1 << 20, 0, {"MemTotal": 128 * GiB, "MemAvailable": 100 * GiB},
                              root=tmp_path) is None
        assert time.monotonic() - started < 5


def test_a_hold_whose_folder_was_renamed_away_counts_nothing(tmp_path, monkeypatch):
    # a prepared folder renamed into place, a pull folder discarded: its pages
    # are counted where they went (MemAvailable), not held a second time
    import json
    import subprocess

    from gpusnap.pages import holds
    from gpusnap.procs import start_time

    _roomy(monkeypatch)
    other = subprocess.Popen(["sleep", "60"])
    try:
        book = holds.ledger_dir()
        (book / str(other.pid)).write_text(json.dumps(
            {"started": start_time(other.pid), "bytes": 50 * GiB, "folder": str(tmp_path / "gone")}))
        with holds.ledger() as ledger:
            assert ledger.others() == 0
        assert memory.shortfall(30 * GiB, 0, {"MemTotal": 128 * GiB, "MemAvailable": 30 * GiB},
                                root=tmp_path) == 8 * GiB  # the reserve it lacks, no more
    finally:
        other.kill()
        other.wait()


def test_a_hold_taken_without_a_check_counts_whole_and_letting_go_needs_no_lock(monkeypatch):
    # a restore from pages prepared in RAM: its process's memory is held as is;
    # its end lets go at once even while a stopped command holds the ledger's lock
    import fcntl
    import json
    import time

    from gpusnap.pages import holds

    memory.hold_only(6 * GiB)
    mine = holds.ledger_dir() / str(os.getpid())
    assert json.loads(mine.read_text())["bytes"] == 6 * GiB and json.loads(mine.read_text())["folder"] == ""
    monkeypatch.setattr(holds, "LOCK_S", 30)
    with open(holds.ledger_dir() / "lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        started = time.monotonic()
        memory.let_go()
        assert time.monotonic() - started < 1 and not mine.exists()
