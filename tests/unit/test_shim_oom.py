"""shim/oom.py: a task's OOM kills said as TaskOOM, before its TaskExit."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from types import SimpleNamespace

import pytest

from gpusnap.shim import oom
from gpusnap.shim.process import Container, Proc
from gpusnap.shim.reaper import Exit
from gpusnap.shim.service import TaskService
from gpusnap.shim.stats import CGROUP_ROOT, cgroup2_host
from gpusnap.shim.stdio import Paths


def test_an_oom_kill_counted_at_the_exit_is_said_before_the_exit(tmp_path, monkeypatch):
    """The exit checks the cgroup itself: the watch's thread may not have run
    yet, and Delete removes the cgroup right after the exit."""
    monkeypatch.setenv("GPUSNAP_STATE_DIR", str(tmp_path / "state"))
    said: list[str] = []
    svc = TaskService("ns", SimpleNamespace(publish=lambda e: said.append(type(e).__name__)),
                      None, lambda: None)
    p = Proc(id="c1", paths=Paths(), pid=4242, status="running")
    c = Container(id="c1", bundle=str(tmp_path), init=p)
    exited_at_check: list[bool] = []

    def check() -> None:
        exited_at_check.append(p.exited.is_set())
        svc._publish("TaskOOM", container_id="c1")
    c.oom = SimpleNamespace(check=check)
    p.started.set()
    svc._process_exit(c, p, Exit(4242, 137, 1))
    assert said == ["TaskOOM", "TaskExit"]
    # before Wait can answer: a client's Delete right after it removes the cgroup
    assert exited_at_check == [False]


def test_oom_kills_reads_memory_events():
    assert oom.oom_kills("low 0\nhigh 0\nmax 35\noom 1\noom_kill 1\noom_group_kill 0\n") == 1
    assert oom.oom_kills("low 0\nhigh 0\nmax 0\noom 0\n") == 0  # a kernel that counts no kills


def _memory_cgroup(cgroup2: bool):
    """A fresh memory cgroup of 16 MiB (this host's cgroup version), or a skip
    where this process may not make one."""
    if os.geteuid() != 0:
        pytest.skip("making a memory cgroup needs root")
    parent = CGROUP_ROOT if cgroup2 else os.path.join(CGROUP_ROOT, "memory")
    if cgroup2 and "memory" not in open(os.path.join(parent, "cgroup.subtree_control")).read():
        pytest.skip("the memory controller is not delegated at the cgroup root")
    if not cgroup2 and not os.path.isdir(parent):
        pytest.skip("no cgroup v1 memory hierarchy")
    folder = os.path.join(parent, f"gpusnap-oom-{uuid.uuid4().hex[:8]}")
    os.mkdir(folder)
    with open(os.path.join(folder, "memory.max" if cgroup2 else "memory.limit_in_bytes"), "w") as f:
        f.write(str(16 << 20))
    return folder


def test_a_process_the_oom_killer_ends_in_a_watched_cgroup_is_said():
    """A real memory cgroup (v1 or v2, as this host has), a real OOM kill: the
    watch says it, from its thread or the exit's check, whichever reads the
    counter first (v1's eventfd may count one episode more than once); once
    the cgroup is gone the check says so."""
    cgroup2 = cgroup2_host()
    folder = _memory_cgroup(cgroup2)
    said: list[str] = []
    watch = None
    try:
        watch = oom.OomWatch(folder, cgroup2, lambda: said.append("oom"))

        def enter() -> None:
            with open(os.path.join(folder, "cgroup.procs"), "w") as f:
                f.write(str(os.getpid()))
        hog = subprocess.run([sys.executable, "-c", "x = bytearray(256 << 20)\n"
                              "for i in range(0, len(x), 4096): x[i] = 1"],
                             preexec_fn=enter, timeout=60)
        assert hog.returncode == -9, hog
        assert watch.check()  # the exit's check: the cgroup stands
        assert said and set(said) == {"oom"}, said
    finally:
        if watch is not None:
            watch.stop()
        os.rmdir(folder)
    assert not watch.check()  # gone: nothing more to say


def test_cgroup_of_takes_the_controllers_v1_hierarchy_else_the_unified_one(tmp_path):
    from pathlib import Path

    from gpusnap.procs import cgroup_of

    root = Path("/sys/fs/cgroup")
    (tmp_path / "7").mkdir()
    (tmp_path / "7" / "cgroup").write_text("12:devices:/a/b\n5:memory:/a/b\n0::/u/b\n")
    assert cgroup_of(7, "memory", root, tmp_path) == (root / "memory" / "a/b", 1)
    assert cgroup_of(7, "devices", root, tmp_path) == (root / "devices" / "a/b", 1)
    (tmp_path / "7" / "cgroup").write_text("0::/ns/task\n")  # cgroup v2 alone
    assert cgroup_of(7, "memory", root, tmp_path) == (root / "ns/task", 2)
    (tmp_path / "7" / "cgroup").write_text("5:cpu:/a\n")
    assert cgroup_of(7, "memory", root, tmp_path) is None
