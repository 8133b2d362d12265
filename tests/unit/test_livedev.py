"""runtime/livedev.py: the child that changes a running container's device nodes
is waited for within a bound, and joins the namespace without dlopen."""

from __future__ import annotations

import json
import os
import signal
import stat
import time
from pathlib import Path

import pytest

from gpusnap.gpu.nodes import DeviceRemap, NodeChange
from gpusnap.runtime import devcgroup, livedev
from gpusnap.waits import Bound, WaitExpired


def _child(run) -> tuple[int, int]:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        run(w)
        os._exit(0)
    os.close(w)
    return pid, r


def test_a_child_that_never_ends_is_killed_at_the_bound():
    pid, r = _child(lambda w: time.sleep(60))
    started = time.monotonic()
    with pytest.raises(WaitExpired, match="device nodes: no answer within"):
        livedev._reap(pid, r, Bound("DEVICES", 0.3))
    assert time.monotonic() - started < 10
    with pytest.raises(ChildProcessError):  # killed and reaped
        os.waitpid(pid, os.WNOHANG)
    os.close(r)


def test_what_the_child_says_comes_back_with_its_status():
    pid, r = _child(lambda w: (os.write(w, b"/dev/nvidia1: File exists"), os._exit(1)))
    err, status = livedev._reap(pid, r, Bound("DEVICES", 10))
    os.close(r)
    assert err == b"/dev/nvidia1: File exists" and os.waitstatus_to_exitcode(status) == 1


def test_a_change_in_our_own_mount_namespace_runs_in_the_child(tmp_path):
    made = tmp_path / "made"
    livedev._in_mount_ns(os.getpid(), lambda: made.write_text("x"))
    assert made.read_text() == "x"
    with pytest.raises(livedev.GpusnapError, match="cannot change the container's device nodes"):
        livedev._in_mount_ns(os.getpid(), lambda: os.stat(tmp_path / "missing"))


def test_ctrl_c_never_cuts_the_childs_change(tmp_path):
    # Ctrl-C goes to the terminal's whole process group, the child included
    made = tmp_path / "made"

    def change() -> None:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.1)
        made.write_text("x")
    livedev._in_mount_ns(os.getpid(), change)
    assert made.read_text() == "x"


def test_ctrl_c_in_the_parent_waits_for_the_child_then_is_raised(tmp_path):
    # an undo begun while the child still changes the nodes would race it
    made = tmp_path / "made"

    def change() -> None:
        os.kill(os.getppid(), signal.SIGINT)
        time.sleep(0.3)
        made.write_text("x")
    with pytest.raises(KeyboardInterrupt):
        livedev._in_mount_ns(os.getpid(), change)
    assert made.read_text() == "x"


def test_what_the_action_returns_comes_back():
    assert livedev._in_mount_ns(os.getpid(), lambda: b"found") == b"found"


# --- the nodes: made one by one, undone from wherever a change was cut -----------------

needs_mknod = pytest.mark.skipif(os.geteuid() != 0, reason="mknod: needs root (make test runs as root)")


def _mknod(path: Path, numbers: tuple[int, int], mode: int = 0o666, uid: int = 0, gid: int = 0) -> None:
    os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(*numbers))
    os.chown(path, uid, gid)
    os.chmod(path, mode)


def _listing(dev: Path) -> dict[str, tuple]:
    """Each entry of ``dev``: a node's numbers, mode and owner, or "file"."""
    out = {}
    for entry in sorted(dev.iterdir()):
        st = entry.lstat()
        out[entry.name] = (os.major(st.st_rdev), os.minor(st.st_rdev), stat.S_IMODE(st.st_mode),
                           st.st_uid, st.st_gid) if stat.S_ISCHR(st.st_mode) else "file"
    return out


@pytest.fixture
def dev(tmp_path, monkeypatch):
    """A /dev of our own mount namespace and a cgroup v1 folder the rules are written to."""
    (tmp_path / "cgroup").mkdir()
    monkeypatch.setattr(livedev, "device_cgroup", lambda pid: (tmp_path / "cgroup", 1))
    (tmp_path / "dev").mkdir()
    return tmp_path / "dev"


def _plan(dev: Path, moves: list[tuple[str, str, tuple[int, int], tuple[int, int]]]):
    spec = {"linux": {"devices": [{"path": str(dev / old), "type": "c", "major": o[0], "minor": o[1]}
                                  for old, _, o, _ in moves]}}
    remap = DeviceRemap(nodes=tuple(NodeChange(str(dev / old), str(dev / new), o, n)
                                    for old, new, o, n in moves))
    return livedev.plan_live(os.getpid(), spec, remap)


@needs_mknod
def test_a_move_and_its_undo_keep_each_nodes_mode_and_owner(dev):
    _mknod(dev / "nvidia0", (1, 3), 0o666, 1000, 44)
    live = _plan(dev, [("nvidia0", "nvidia1", (1, 3), (1, 5))])
    umask = os.umask(0o022)  # the CLI's: mknod's mode would lose the group's and others' write
    try:
        live.apply()
        assert _listing(dev) == {"nvidia1": (1, 5, 0o666, 1000, 44)}
        live.undo()
    finally:
        os.umask(umask)
    assert _listing(dev) == {"nvidia0": (1, 3, 0o666, 1000, 44)}


@needs_mknod
def test_a_swap_of_two_nodes_keeps_both_paths_and_undoes(dev):
    _mknod(dev / "nvidia0", (1, 3), 0o666)
    _mknod(dev / "nvidia1", (1, 5), 0o660, 0, 44)
    was = _listing(dev)
    live = _plan(dev, [("nvidia0", "nvidia1", (1, 3), (1, 5)), ("nvidia1", "nvidia0", (1, 5), (1, 3))])
    live.apply()
    assert _listing(dev) == {"nvidia0": (1, 3, 0o660, 0, 44), "nvidia1": (1, 5, 0o666, 0, 0)}
    live.undo()
    assert _listing(dev) == was


CHAIN = [("nvidia0", "nvidia1", (1, 3), (1, 5)), ("nvidia1", "nvidia2", (1, 5), (1, 7))]


def _cut_at(call: str, nth: int, kill: bool):
    """``os.<call>`` failing at its ``nth`` call, or the child killed there."""
    real = getattr(os, call)
    seen = [0]

    def cut(*args, **kwargs):
        seen[0] += 1
        if seen[0] == nth:
            if kill:
                os.kill(os.getpid(), signal.SIGKILL)
            raise OSError(28, "No space left on device", str(args[0]))
        return real(*args, **kwargs)
    return cut


@needs_mknod
@pytest.mark.parametrize("call,nth", [("mknod", 1), ("mknod", 2), ("rename", 1), ("rename", 2),
                                      ("unlink", 3), ("unlink", 4)])
@pytest.mark.parametrize("kill", [False, True], ids=["failed", "killed"])
def test_an_undo_puts_every_node_back_from_wherever_the_change_was_cut(dev, monkeypatch, call,
                                                                       nth, kill):
    _mknod(dev / "nvidia0", (1, 3))
    _mknod(dev / "nvidia1", (1, 5), 0o660)
    was = _listing(dev)
    live = _plan(dev, CHAIN)
    with monkeypatch.context() as m:
        m.setattr(os, call, _cut_at(call, nth, kill))
        with pytest.raises(livedev.GpusnapError, match="cannot change the container's device nodes"):
            live.apply()
    live.undo()
    assert _listing(dev) == was
    live.undo()  # again: the same step, nothing left to do
    assert _listing(dev) == was


@needs_mknod
def test_a_node_that_is_no_device_is_refused_before_anything_changes(dev):
    (dev / "nvidia0").write_text("")
    with pytest.raises(livedev.GpusnapError, match="nvidia0: not a character device"):
        _plan(dev, [("nvidia0", "nvidia1", (1, 3), (1, 5))])


def test_a_cgroup_v2_undo_without_runcs_program_puts_one_built_from_the_rules_back(tmp_path,
                                                                                    monkeypatch):
    # a change marked before it starts, or one doctor undoes for a killed move:
    # runc's program was not kept, so the rules before make one
    before = devcgroup.container_rules({"linux": {"devices": [
        {"path": "/dev/nvidia0", "type": "c", "major": 195, "minor": 0}]}})
    after = devcgroup.container_rules({"linux": {"devices": [
        {"path": "/dev/nvidia1", "type": "c", "major": 195, "minor": 1}]}})
    loaded, replaced = [], []

    def load(insns: bytes) -> int:
        loaded.append(insns)
        return os.open("/dev/null", os.O_RDONLY)
    monkeypatch.setattr(devcgroup, "attached", lambda fd: ([7], 2))
    monkeypatch.setattr(devcgroup, "program_fd", lambda prog_id: os.open("/dev/null", os.O_RDONLY))
    monkeypatch.setattr(devcgroup, "load_program", load)
    monkeypatch.setattr(devcgroup, "replace_program",
                        lambda fd, new, old, flags: replaced.append((new, old, flags)))
    devcgroup.DeviceAccess(1, tmp_path, 2, before, after).undo()
    assert loaded == [devcgroup.device_program(before)] and len(replaced) == 1


@needs_mknod
def test_a_recorded_change_is_undone_by_another_process(dev):
    # doctor --fix, for a move killed once its devices changed: nothing of its
    # LiveDevices is left but the record
    _mknod(dev / "nvidia0", (195, 0), 0o666, 1000, 44)
    live = _plan(dev, [("nvidia0", "nvidia1", (195, 0), (195, 1))])
    record = json.loads(json.dumps(live.to_dict()))
    live.apply()
    livedev.LiveDevices.recorded(record).undo()
    assert _listing(dev) == {"nvidia0": (195, 0, 0o666, 1000, 44)}
    assert (dev.parent / "cgroup" / "devices.allow").read_text() == "c 195:0 rwm"
    assert (dev.parent / "cgroup" / "devices.deny").read_text() == "c 195:1 rwm"


def test_a_cgroup_v2_the_move_could_not_undo_is_refused_before_anything_changes(tmp_path, monkeypatch):
    """systemd's own device program beside runc's: apply would refuse it after
    the quiesce, and so would the undo, leaving the processes off their GPUs."""
    from gpusnap.errors import GpusnapError
    monkeypatch.setattr(devcgroup, "attached", lambda fd: ([7, 8], 0))
    access = devcgroup.DeviceAccess(1, tmp_path, 2, [], [])
    with pytest.raises(GpusnapError, match="has 2 device programs"):
        access.check()


def test_a_cgroup_v2_change_cut_anywhere_is_undone():
    """Marked before the swap: a Ctrl-C just after it still has it undone
    (plan_live checked that the undo can always be made)."""
    class Access:
        version, undone = 2, []

        def apply(self):
            raise KeyboardInterrupt  # after the swap, before its mark would have been

        def undo(self):
            self.undone.append(True)
    live = livedev.LiveDevices(1, Access())
    with pytest.raises(KeyboardInterrupt):
        live.apply()
    live.undo()
    assert Access.undone == [True]
