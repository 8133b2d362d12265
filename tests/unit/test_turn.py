"""gpu/turn.py: one process at a time changes a container's GPU state. Real
flocks held by real processes: a second taker waits, a turn handed to a
child is held until the child lets go, and a killed holder frees it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from gpusnap.gpu import turn as turns
from gpusnap.waits import Bound, WaitExpired

INIT = 4242
# a child that takes the turn, says so, and holds it until stdin closes
HOLDER = ("import sys; from gpusnap.gpu import turn; t = turn.try_take(int(sys.argv[1])); "
          "print('held' if t else 'busy', flush=True); sys.stdin.read()")
# a child handed a turn's fd: lets go once told to
HANDED = ("import sys; from gpusnap.gpu import turn; sys.stdin.readline(); "
          "turn.release_fd(int(sys.argv[1]), int(sys.argv[2])); print('released', flush=True); "
          "sys.stdin.read()")


@pytest.fixture(autouse=True)
def state(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUSNAP_STATE_DIR", str(tmp_path / "state"))


def _child(code: str, *args: object) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code, *map(str, args)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)


def test_a_second_taker_waits_until_the_first_lets_go():
    first = turns.try_take(INIT)
    assert first is not None and turns.try_take(INIT) is None
    threading.Timer(0.3, first.release).start()
    started = time.monotonic()
    with turns.wait_turn(INIT, "test", Bound("GPU_TURN", 10)):
        assert time.monotonic() - started >= 0.25
    assert not turns._path(INIT).exists()  # let go: nothing left in the state folder


def test_a_turn_held_past_its_bound_is_one_line_naming_its_holder():
    holder = _child(HOLDER, INIT)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(WaitExpired) as err:
            turns.wait_turn(INIT, "pre-dump of the container whose init is pid 4242",
                            Bound("GPU_TURN", 0.3))
        assert err.value.message.startswith("pre-dump of the container whose init is pid 4242: "
                                            "the container's GPUs are still being given back")
        assert f"(pid {holder.pid})" in err.value.message and "resume it" in err.value.hint
    finally:
        holder.stdin.close()
        holder.wait(timeout=10)
    assert turns.try_take(INIT) is not None  # its exit let go


def test_a_turn_handed_to_another_process_is_held_until_that_process_lets_go():
    with turns.wait_turn(INIT, "test") as turn:
        child = subprocess.Popen([sys.executable, "-c", HANDED, str(INIT), str(turn.fd)],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                 pass_fds=(turn.fd,))
        turn.hand_over()
    try:
        assert turns.try_take(INIT) is None  # this process left; the child holds on
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "released"
        assert turns.try_take(INIT) is not None
    finally:
        child.stdin.close()
        child.wait(timeout=10)


def test_a_holder_killed_frees_the_turn():
    holder = _child(HOLDER, INIT)
    assert holder.stdout.readline().strip() == "held"
    assert turns.try_take(INIT) is None
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait(timeout=10)
    assert turns.try_take(INIT) is not None


def test_a_taker_that_opened_the_file_before_its_holder_removed_it_takes_a_fresh_one(
        monkeypatch):
    """The holder lets go (removes the file, then unlocks) between a taker's
    open and its flock: the taker's lock is on a file no one else will open."""
    first = turns.try_take(INIT)
    real_flock, raced = turns.fcntl.flock, []

    def flock_after_the_release(fd, how):
        if not raced:
            raced.append(fd)
            first.release()
        return real_flock(fd, how)
    monkeypatch.setattr(turns.fcntl, "flock", flock_after_the_release)
    second = turns.try_take(INIT)
    assert second is not None and raced
    assert os.fstat(second.fd).st_ino == os.stat(turns._path(INIT)).st_ino
    monkeypatch.setattr(turns.fcntl, "flock", real_flock)
    assert turns.try_take(INIT) is None  # whoever comes next sees it held


def test_doctor_fix_leaves_gpu_processes_to_a_guardian_still_at_work(monkeypatch):
    from gpusnap.ops import doctor
    stuck = [{"pid": 701, "comm": "python3", "state": "CHECKPOINTED"}]
    monkeypatch.setattr(doctor, "stuck_processes", lambda: stuck)
    monkeypatch.setattr(doctor, "load_driver", lambda: object())
    resumed: list[list[int]] = []
    monkeypatch.setattr(doctor, "resume", lambda driver, pids: resumed.append(pids) or pids)
    holder = _child(HOLDER, INIT)
    try:
        assert holder.stdout.readline().strip() == "held"
        check, _, _ = doctor._gpu_processes_check(fix=True)
        assert resumed == [] and not check.ok
        assert f"gpusnap is still giving GPUs back (pid {holder.pid} for the container whose " \
               f"init is {INIT})" in check.detail and check.fix.startswith("wait for it")
    finally:
        holder.stdin.close()
        holder.wait(timeout=10)
    check, _, fixed = doctor._gpu_processes_check(fix=True)  # its guardian gone: --fix does it
    assert resumed == [[701]] and fixed == [701] and check.ok
    assert list(turns.state_subdir("turns").iterdir()) == []  # no file left behind
