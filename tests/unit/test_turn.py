"""gpu/turn.py: one process at a time changes a container's GPU state. Real
flocks held by real processes: a second taker waits, a turn handed to a
child (a real guardian, started as pre-dump starts it) is held until the
child lets go, a killed holder frees it, and doctor --fix leaves a
container whose guardian is at work to it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from gpusnap import journal
from gpusnap.gpu import turn as turns
from gpusnap.waits import Bound, WaitExpired
from tests.unit import turn_holder

INIT = 4242
# a child handed a turn's fd: lets go once told to
HANDED = ("import sys; from gpusnap.gpu import turn; sys.stdin.readline(); "
          "turn.release_fd(int(sys.argv[1]), int(sys.argv[2])); print('released', flush=True); "
          "sys.stdin.read()")


@pytest.fixture(autouse=True)
def state(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUSNAP_STATE_DIR", str(tmp_path / "state"))


def _until(check, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "not within the time"
        time.sleep(0.02)


def test_a_second_taker_waits_until_the_first_lets_go():
    first = turns.try_take(INIT, "freeze")
    assert first is not None and turns.try_take(INIT, "thaw") is None
    threading.Timer(0.3, first.release).start()
    with turns.wait_turn(INIT, "thaw of c", "thaw", Bound("GPU_TURN", 10)) as turn:
        assert turn.waited_s >= 0.25
    assert not turns._path(INIT).exists()  # let go: nothing left in the state folder


def test_a_turn_held_past_its_bound_is_one_line_naming_its_holder():
    with turn_holder.holding(INIT, "freeze") as holder:
        with pytest.raises(WaitExpired) as err:
            turns.wait_turn(INIT, "pre-dump of the container whose init is pid 4242", "pre-dump",
                            Bound("GPU_TURN", 0.3))
        assert err.value.message == (
            f"pre-dump of the container whose init is pid 4242: gpusnap's freeze (pid "
            f"{holder.pid}) is still changing the container's GPU state: no answer within 0 s")
        assert err.value.hint.startswith("nothing was changed; try again once it is done")
        assert "GPUSNAP_WAIT_GPU_TURN=SECONDS" in err.value.hint
    assert turns.try_take(INIT, "test") is not None  # its exit let go


def test_a_turn_handed_to_another_process_is_held_until_that_process_lets_go():
    with turns.wait_turn(INIT, "test", "pre-dump") as turn:
        child = subprocess.Popen([sys.executable, "-c", HANDED, str(INIT), str(turn.fd)],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                 pass_fds=(turn.fd,))
        turn.hand_over()
    try:
        assert turns.try_take(INIT, "test") is None  # this process left; the child holds on
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "released"
        assert turns.try_take(INIT, "test") is not None
    finally:
        child.stdin.close()
        child.wait(timeout=10)


def test_pre_dumps_real_guardian_holds_the_turn_through_criu_and_names_itself():
    """_start_guardian as pre-dump runs it (pass_fds, --turn-fd): pre-dump
    leaves, the guardian holds the turn while "CRIU" (a child here) runs, says
    it is the holder, and lets go once CRIU is gone and nothing is left to resume."""
    from gpusnap.action import action_dump
    criu = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                            stdin=subprocess.PIPE)
    try:
        with turns.wait_turn(INIT, "pre-dump", "pre-dump") as turn:
            sock = action_dump._start_guardian(criu.pid, [], INIT, turn, force=True)
            sock.close()
        _until(lambda: turns.holder(INIT)[1] == "guardian")
        guardian_pid = turns.holder(INIT)[0]
        assert guardian_pid not in (None, os.getpid())
        time.sleep(0.3)
        assert turns.try_take(INIT, "test") is None  # CRIU still runs
    finally:
        criu.stdin.close()
        criu.wait(timeout=10)
    _until(lambda: not turns._path(INIT).exists())  # let go, and its file removed


def test_a_holder_killed_frees_the_turn():
    holder = turn_holder.start(INIT)
    assert turns.try_take(INIT, "test") is None
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait(timeout=10)
    assert turns.try_take(INIT, "test") is not None


def test_a_taker_that_opened_the_file_before_its_holder_removed_it_takes_a_fresh_one(
        monkeypatch):
    """The holder lets go (removes the file, then unlocks) between a taker's
    open and its flock: the taker's lock is on a file no one else will open."""
    first = turns.try_take(INIT, "test")
    real_flock, raced = turns.fcntl.flock, []

    def flock_after_the_release(fd, how):
        if not raced:
            raced.append(fd)
            first.release()
        return real_flock(fd, how)
    monkeypatch.setattr(turns.fcntl, "flock", flock_after_the_release)
    second = turns.try_take(INIT, "test")
    assert second is not None and raced
    assert os.fstat(second.fd).st_ino == os.stat(turns._path(INIT)).st_ino
    monkeypatch.setattr(turns.fcntl, "flock", real_flock)
    assert turns.try_take(INIT, "test") is None  # whoever comes next sees it held


def test_doctor_fix_leaves_only_the_container_whose_guardian_is_at_work(monkeypatch):
    from gpusnap.ops import doctor
    other = INIT + 100
    stuck = [{"pid": INIT + 1, "comm": "python3", "state": "CHECKPOINTED"},
             {"pid": other + 1, "comm": "python3", "state": "LOCKED"}]
    monkeypatch.setattr(doctor, "stuck_processes", lambda: stuck)
    monkeypatch.setattr(doctor.turn, "key_for", lambda pid: pid - 1)  # each one's container init
    monkeypatch.setattr(doctor, "load_driver", lambda: object())
    resumed: list[list[int]] = []

    def resume(driver, pids):
        assert turns.try_take(pids[0] - 1, "test") is None  # under its container's turn
        resumed.append(pids)
        return pids
    monkeypatch.setattr(doctor, "resume", resume)
    with turn_holder.holding(INIT) as holder:
        check, _, fixed = doctor._gpu_processes_check(fix=True)
        assert resumed == [[other + 1]] and fixed == [other + 1] and check.ok
        assert f"left to gpusnap's guardian (pid {holder.pid}), at work on pid {INIT + 1}" \
            in check.detail
        left = [e for e in journal.read() if e["event"] == "doctor-left"]
        assert [(e["pids"], e["holder"], e["role"]) for e in left] == \
            [([INIT + 1], holder.pid, "guardian")]  # what --fix chose not to touch, recorded
        check, _, fixed = doctor._gpu_processes_check(fix=False)
        assert not check.ok and "doctor --fix" in check.fix  # the other one is stuck
    monkeypatch.setattr(doctor, "stuck_processes", lambda: stuck[:1])
    with turn_holder.holding(INIT):
        check, _, fixed = doctor._gpu_processes_check(fix=False)
        assert check.ok and not check.fix and fixed == []  # at work, not stuck
    resumed.clear()
    check, _, fixed = doctor._gpu_processes_check(fix=True)  # its guardian gone: --fix does it
    assert [INIT + 1] in resumed and check.ok
    assert list(turns.state_subdir("turns").iterdir()) == []  # no file left behind


def test_a_failed_dumps_clean_up_leaves_processes_to_a_guardian_still_at_work(monkeypatch):
    from gpusnap.ops import gpu_state
    from tests.unit.fakes import FakeDriver
    from gpusnap.gpu.cuda import ProcessState
    driver = FakeDriver({INIT + 1: ProcessState.CHECKPOINTED})
    monkeypatch.setattr(gpu_state, "load_driver", lambda: driver)
    monkeypatch.setattr(gpu_state, "alive", lambda pid: True)
    with turn_holder.holding(INIT) as holder:
        assert gpu_state.ensure_running(INIT, [INIT + 1], wait_s=0.2) == []
        assert driver.called("restore") == []
        left = journal.read()[-1]
        assert left["event"] == "resume-left" and left["holder"] == holder.pid
    assert gpu_state.ensure_running(INIT, [INIT + 1], wait_s=0.2) == [INIT + 1]
    assert driver.states[INIT + 1] == ProcessState.RUNNING


def test_a_turn_never_takes_fds_0_to_2_where_criu_leaves_them_closed():
    """The guardian gets its socket as stdin: a turn opened on a closed fd 0
    and handed over would be overwritten by it."""
    saved = os.dup(0)
    os.close(0)
    try:
        turn = turns.try_take(INIT, "pre-dump")
        assert turn.fd > 2
        turn.release()
    finally:
        os.dup2(saved, 0)
        os.close(saved)


def test_a_turn_is_keyed_by_the_nearest_ancestor_that_has_one(tmp_path):
    """doctor --fix finds a stuck process's turn under the init pid pre-dump
    keyed it by (runc's init, whatever the pid namespaces), up its parents."""
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                             stdin=subprocess.PIPE)
    try:
        with turns.wait_turn(os.getpid(), "test", "pre-dump"):
            assert turns.key_for(child.pid) == os.getpid()
        assert turns.key_for(child.pid) != os.getpid()  # no turn file above it now
    finally:
        child.stdin.close()
        child.wait(timeout=10)


def test_a_claim_on_a_file_that_is_not_the_turns_writes_nothing(tmp_path):
    turn = turns.try_take(INIT, "pre-dump")
    other = os.open(tmp_path / "other", os.O_RDWR | os.O_CREAT, 0o600)
    r, w = os.pipe()
    try:
        assert not turns.claim(INIT, other, "guardian") and os.fstat(other).st_size == 0
        assert not turns.claim(INIT, r, "guardian")  # a socket or pipe on its fd
        assert turns.claim(INIT, turn.fd, "guardian")
        assert turns.holder(INIT) == (os.getpid(), "guardian")
    finally:
        for fd in (other, r, w):
            os.close(fd)
        turn.release()


def test_doctor_reads_the_gpu_processes_before_it_asks_podman(monkeypatch):
    """`podman info` waits for the lock of a container a restore holds: doctor
    takes the processes' states before it, or sees a restore's only once it is over."""
    from gpusnap.ops import doctor
    asked: list[str] = []

    def processes(fix):
        asked.append("processes")
        return doctor.Check("gpu processes", True, "none"), [], []
    monkeypatch.setattr(doctor, "_gpu_processes_check", processes)
    monkeypatch.setattr(doctor, "_criu_checks", lambda: asked.append("criu") or [])
    monkeypatch.setattr(doctor.podman, "default_runtime", lambda: asked.append("podman") or "runc")
    report = doctor.run(fix=False)
    assert asked[0] == "processes" and "podman" in asked, asked
    assert [c["name"] for c in report["checks"]].index("gpu processes") > 0  # shown where it was


def test_doctor_asks_the_driver_nothing_about_gpusnaps_own_helpers(monkeypatch, tmp_path):
    """The agent and the guardians map libcuda to call the checkpoint API on other
    processes and hold no GPU state: doctor leaves them out of its questions (G11
    holds a restore's agent stopped while doctor runs)."""
    from gpusnap.ops import doctor
    from gpusnap.gpu.cuda import ProcessState

    def proc(pid: int, *argv: str) -> None:
        d = tmp_path / str(pid)
        d.mkdir()
        (d / "comm").write_text("python3\n")
        (d / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")
        (d / "maps").write_text("7f00-7f10 r-xp 0 00:00 1 /usr/lib/libcuda.so.580\n")
    proc(101, "/usr/bin/python3", "-m", "gpusnap.action.agent", "7", "--driver")
    proc(102, "/usr/bin/python3", "-m", "gpusnap.action.guardian", "7", "103")
    proc(103, "/usr/bin/python3", "/work/workload.py", "--worker", "0", "8")
    asked: list[int] = []

    class Driver:
        def state(self, pid):
            asked.append(pid)
            return ProcessState.CHECKPOINTED
    monkeypatch.setattr(doctor, "PROC", tmp_path)
    monkeypatch.setattr(doctor, "load_driver", Driver)
    monkeypatch.setattr(doctor, "is_frozen", lambda pid: False)
    monkeypatch.setattr(doctor, "stopped", lambda pid: False)
    assert [s["pid"] for s in doctor.stuck_processes()] == [103] and asked == [103]
    # a stopped one is not asked either: the driver would wait until it runs
    monkeypatch.setattr(doctor, "stopped", lambda pid: pid == 103)
    asked.clear()
    assert doctor.stuck_processes() == [] and asked == []


def test_doctor_fix_says_where_the_driver_refuses_a_process_for_good(monkeypatch):
    """Driver 580 refuses every restore of a process once one was refused for memory
    (H200, 2026-11-30): doctor says so, and not to run --fix again."""
    from gpusnap.gpu.quiesce import QuiesceError
    from gpusnap.ops import doctor
    stuck = [{"pid": INIT + 1, "comm": "python3", "state": "CHECKPOINTED"}]
    monkeypatch.setattr(doctor, "stuck_processes", lambda: stuck)
    monkeypatch.setattr(doctor.turn, "key_for", lambda pid: pid - 1)
    monkeypatch.setattr(doctor, "load_driver", lambda: object())

    def resume(driver, pids):
        raise QuiesceError("restore", {INIT + 1: RuntimeError(
            "cuCheckpointProcessRestore(pid 1) failed: CUDA_ERROR_OPERATING_SYSTEM (304)")})
    monkeypatch.setattr(doctor, "resume", resume)
    check, _, fixed = doctor._gpu_processes_check(fix=True)
    assert not check.ok and fixed == []
    assert f"the driver refused to bring back pid {INIT + 1}: cuCheckpointProcessRestore" \
        in check.detail and "CUDA_ERROR_OPERATING_SYSTEM" in check.detail
    assert "podman rm -f" in check.fix and "doctor --fix" not in check.fix
