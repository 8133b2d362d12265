"""runtime/livedev.py: the child that changes a running container's device nodes
is waited for within a bound, and joins the namespace without dlopen."""

from __future__ import annotations

import os
import signal
import time

import pytest

from gpusnap.runtime import livedev
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
