"""A running container's device nodes and device cgroup changed live (gpusnap move's
device half), through real Podman/runc containers and a real cgroup v2 device program.

No GPU here: /dev/kmsg (1:11) stands in for the old GPU node and
/dev/loop-control (10:237) for the new one.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from gpusnap.gpu.nodes import DeviceRemap, NodeChange
from gpusnap.runtime import devcgroup
from gpusnap.errors import GpusnapError
from gpusnap.runtime.livedev import LiveDevices, _in_mount_ns, plan_live, set_nodes, survey
from tests.conftest import DEMO_IMAGE, assert_one_line_error, gpusnap, podman

KMSG_TO_LOOP = DeviceRemap(nodes=(NodeChange("/dev/kmsg", "/dev/loop-control", (1, 11), (10, 237)),))


def _opens(name: str, path: str) -> bool:
    """Can the container open ``path`` for writing (kmsg and loop-control need no capability)?"""
    return podman("exec", name, "sh", "-c", f"exec 3>{path}", check=False).returncode == 0


def _mknod(pid: int, path: str, major: int, minor: int) -> None:
    """A node in the container made from outside (Podman drops CAP_MKNOD inside)."""
    _in_mount_ns(pid, lambda: os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(major, minor)))


def _numbers(name: str, path: str) -> list[str]:
    return podman("exec", name, "ls", "-l", path).stdout.split()[4:6]


# As a GPU's move where both hosts have nvidia-drm: its DRM nodes too, which a
# container given /dev/nvidiaN alone does not have (the move failed on them).
WITH_DRM = DeviceRemap(nodes=KMSG_TO_LOOP.nodes + (
    NodeChange("/dev/dri/card7", "/dev/dri/card8", (226, 7), (226, 8)),))


@pytest.mark.parametrize("remap", [KMSG_TO_LOOP, WITH_DRM], ids=["node", "node-and-drm-not-given"])
def test_live_device_move_and_undo_in_a_running_container(name, remap):
    podman("run", "-d", "--name", name, "--network", "none", "--device", "/dev/kmsg",
           DEMO_IMAGE, "sleep", "600")
    pid = int(podman("inspect", name, "--format", "{{.State.Pid}}").stdout)
    spec = json.loads(Path(podman("inspect", name, "--format", "{{.OCIConfigPath}}").stdout.strip())
                      .read_text())
    assert _opens(name, "/dev/kmsg")
    live = plan_live(pid, spec, remap)
    live.apply()
    try:
        assert _numbers(name, "/dev/loop-control") == ["10,", "237"]
        assert podman("exec", name, "ls", "/dev/kmsg", check=False).returncode != 0
        assert _opens(name, "/dev/loop-control")
        # the old numbers are refused by the cgroup, whatever node names them
        _mknod(pid, "/tmp/old", 1, 11)
        assert not _opens(name, "/tmp/old")
    finally:
        live.undo()
        live.close()
    assert _numbers(name, "/dev/kmsg") == ["1,", "11"]
    assert _opens(name, "/dev/kmsg")
    assert podman("exec", name, "ls", "/dev/loop-control", check=False).returncode != 0
    _mknod(pid, "/tmp/new", 10, 237)
    assert not _opens(name, "/tmp/new")
    assert podman("exec", name, "ls", "/dev/dri", check=False).returncode != 0  # none made


def test_a_recorded_change_is_undone_by_another_process(name):
    """doctor --fix's undo of a killed move (ops/moving.py): runc's device program
    went with the move's process, so one built from the rules before replaces
    the move's, and the nodes are made from the record."""
    podman("run", "-d", "--name", name, "--network", "none", "--device", "/dev/kmsg",
           DEMO_IMAGE, "sleep", "600")
    pid = int(podman("inspect", name, "--format", "{{.State.Pid}}").stdout)
    spec = json.loads(Path(podman("inspect", name, "--format", "{{.OCIConfigPath}}").stdout.strip())
                      .read_text())
    live = plan_live(pid, spec, KMSG_TO_LOOP)
    record = json.loads(json.dumps(live.to_dict()))
    live.apply()
    live.close()  # the move's process killed: runc's program is no longer held
    assert _opens(name, "/dev/loop-control")
    LiveDevices.recorded(record).undo()
    LiveDevices.recorded(record).undo()  # doctor run twice: the same state
    assert _numbers(name, "/dev/kmsg") == ["1,", "11"]
    assert _opens(name, "/dev/kmsg")
    assert podman("exec", name, "ls", "/dev/loop-control", check=False).returncode != 0
    _mknod(pid, "/tmp/new", 10, 237)
    assert not _opens(name, "/tmp/new")


def test_a_change_cut_mid_way_is_undone_node_by_node(name):
    podman("run", "-d", "--name", name, "--network", "none", "--device", "/dev/kmsg",
           DEMO_IMAGE, "sleep", "600")
    pid = int(podman("inspect", name, "--format", "{{.State.Pid}}").stdout)
    mode = podman("exec", name, "ls", "-l", "/dev/kmsg").stdout.split()[0]
    kmsg = survey(pid, ["/dev/kmsg"])
    loop = replace(kmsg[0], path="/dev/loop-control", major=10, minor=237)
    with pytest.raises(GpusnapError):  # the second node's folder is not there: the first is made
        set_nodes(pid, [loop, replace(loop, path="/dev/no-such-dir/x")], ["/dev/kmsg"])
    assert _numbers(name, "/dev/loop-control") == ["10,", "237"]
    set_nodes(pid, kmsg, ["/dev/loop-control", "/dev/no-such-dir/x"])  # the undo, from there
    listing = podman("exec", name, "ls", "-a", "/dev").stdout.split()
    assert "kmsg" in listing and "loop-control" not in listing, listing
    assert not [n for n in listing if n.endswith(".gpusnap")], listing
    assert _numbers(name, "/dev/kmsg") == ["1,", "11"]
    assert podman("exec", name, "ls", "-l", "/dev/kmsg").stdout.split()[0] == mode
    with pytest.raises(GpusnapError, match="not a character device"):  # read before any change
        survey(pid, ["/etc/hostname"])


@pytest.fixture
def cgroup2(tmp_path):
    """A cgroup v2 directory (this host's hierarchy, or one mounted for the test)."""
    root = Path("/sys/fs/cgroup")
    mounted = None
    if not (root / "cgroup.controllers").exists():
        mounted = tmp_path / "cg2"
        mounted.mkdir()
        subprocess.run(["mount", "-t", "cgroup2", "none", str(mounted)], check=True)
        root = mounted
    group = root / f"gpusnap-test-{os.getpid()}"
    group.mkdir()
    yield group
    group.rmdir()
    if mounted:
        subprocess.run(["umount", "-l", str(mounted)], check=True)


def _probe(group: Path, *paths: str) -> dict[str, str]:
    """Open each path read-only from a process inside ``group``."""
    code = ("import sys\nfor p in sys.argv[1:]:\n try:\n  open(p, 'rb').close(); print(p, 'ok')\n"
            " except OSError as e: print(p, e.errno)")  # kmsg: readable by root on the host
    r, w = os.pipe()
    child = os.fork()
    if child == 0:
        os.dup2(w, 1)
        (group / "cgroup.procs").write_text(str(os.getpid()))
        os.execv(sys.executable, [sys.executable, "-c", code, *paths])
    os.close(w)
    with os.fdopen(r) as f:
        out = f.read()
    os.waitpid(child, 0)
    return dict(line.split() for line in out.splitlines())


def test_device_program_swap_on_cgroup_v2(cgroup2):
    before = devcgroup.container_rules({"linux": {"resources": {"devices": [
        {"allow": False, "access": "rwm"},
        {"allow": True, "type": "c", "major": 1, "minor": 11, "access": "r"}]}}})
    after = devcgroup.container_rules({"linux": {"resources": {"devices": [
        {"allow": False, "access": "rwm"},
        {"allow": True, "type": "c", "major": 10, "minor": 237, "access": "rwm"}]}}})
    fd = os.open(cgroup2, os.O_RDONLY | os.O_DIRECTORY)
    try:
        prog = devcgroup.load_program(devcgroup.device_program(before))
        devcgroup.attach_program(fd, prog)  # as runc does at create
        os.close(prog)
        # errno 1: EPERM from the device program; kmsg is readable by root on the host
        assert _probe(cgroup2, "/dev/kmsg", "/dev/loop-control", "/dev/null", "/dev/tty0") == {
            "/dev/kmsg": "ok", "/dev/loop-control": "1", "/dev/null": "ok", "/dev/tty0": "1"}
        access = devcgroup.DeviceAccess(0, cgroup2, 2, before, after)
        access.apply()
        assert _probe(cgroup2, "/dev/kmsg", "/dev/loop-control", "/dev/null") == {
            "/dev/kmsg": "1", "/dev/loop-control": "ok", "/dev/null": "ok"}
        access.undo()
        access.close()
        assert _probe(cgroup2, "/dev/kmsg", "/dev/loop-control") == {
            "/dev/kmsg": "ok", "/dev/loop-control": "1"}
        assert len(devcgroup.attached(fd)[0]) == 1
    finally:
        os.close(fd)


def test_move_of_a_container_without_cuda_processes_is_one_line(counter):
    assert_one_line_error(gpusnap("move", counter, "--gpu", "1"), "has no CUDA processes")
    assert_one_line_error(gpusnap("move", "gpusnap-no-such-ctr", "--gpu", "1"), "no such container")
