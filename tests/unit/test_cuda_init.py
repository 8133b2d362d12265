"""gpu/cuda.CudaDriver's cuInit has a bound (waits.Bound DRIVER): a wedged driver
never answers it, and doctor, restore's check and the driver calls would wait
with it. Past the bound one line says so; later calls fail at once; the CLI
then leaves without libcuda's exit handlers, which would wait on it too."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from gpusnap.gpu import cuda, driver_calls
from gpusnap import procs
from gpusnap.waits import WaitExpired


class _Lib:
    """libcuda with a cuInit that returns when ``go`` is set."""

    def __init__(self) -> None:
        self.go = threading.Event()
        self.calls = 0

    def cuInit(self, flags: int) -> int:
        self.calls += 1
        self.go.wait(30)
        return cuda.CUDA_SUCCESS

    def cuCheckpointProcessGetState(self, pid, state) -> int:
        return cuda.CUDA_SUCCESS


def _driver(lib: _Lib) -> cuda.CudaDriver:
    driver = object.__new__(cuda.CudaDriver)
    driver._lib = lib
    driver._init_lock = threading.Lock()
    driver._initialised = False
    driver._init_call = None
    driver._left = {}
    return driver


def test_a_cuinit_that_does_not_answer_ends_at_its_bound_and_later_calls_at_once(monkeypatch):
    monkeypatch.setenv("GPUSNAP_WAIT_DRIVER", "0.3")
    monkeypatch.setattr(driver_calls, "_HUNG", [])
    lib = _Lib()
    driver = _driver(lib)
    started = time.monotonic()
    with pytest.raises(WaitExpired) as err:
        driver.state(1)
    assert 0.3 <= time.monotonic() - started < 5
    assert err.value.message.startswith("the NVIDIA driver's cuInit: no answer within")
    assert "wedged" in err.value.hint and driver_calls.driver_hung()
    started = time.monotonic()
    with pytest.raises(WaitExpired):
        driver.state(1)  # the same cuInit, still in flight: not waited for again
    assert time.monotonic() - started < 0.2 and lib.calls == 1
    lib.go.set()  # the driver answers after all
    deadline = time.monotonic() + 10
    while driver_calls.driver_hung() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert driver.state(1) == cuda.ProcessState.RUNNING and lib.calls == 1


def test_a_healthy_cuinit_is_called_once():
    lib = _Lib()
    lib.go.set()
    driver = _driver(lib)
    driver.init()
    driver.state(1)
    assert lib.calls == 1


HUNG_CLI = """
import sys, threading
from gpusnap.gpu import driver_calls
stuck = threading.Thread(target=threading.Event().wait)  # not a daemon: exit would join it
stuck.start()
driver_calls._HUNG.append(stuck)
sys.argv = ["gpusnap", "--version"]
from gpusnap.cli.main import main
main()
"""


BUSY_CLI = """
import atexit, sys, threading
from gpusnap.gpu import driver_calls
call = driver_calls.Call("gpusnap-lock", lambda: threading.Event().wait() or 0)  # in flight, in bound
atexit.register(threading.Event().wait)  # as libcuda's exit handlers wait on that call
sys.argv = ["gpusnap", "--version"]
from gpusnap.cli.main import main
main()
"""


def test_the_cli_leaves_while_a_driver_call_is_in_flight_within_its_bound():
    """Ctrl-C or an early failure during a lock, a checkpoint or cuInit ahead:
    the exit must not wait on the call, as it would in libcuda's exit handlers."""
    res = subprocess.run([sys.executable, "-c", BUSY_CLI], capture_output=True, text=True,
                         timeout=20)
    assert res.returncode == 0 and res.stdout.strip(), (res.returncode, res.stderr)


def test_the_cli_leaves_while_a_cuinit_hangs():
    res = subprocess.run([sys.executable, "-c", HUNG_CLI], capture_output=True, text=True,
                         timeout=20)
    assert res.returncode == 0 and res.stdout.strip(), (res.returncode, res.stderr)


class _Stuck(_Lib):
    """libcuda whose checkpoint-API calls wait until ``answer`` is set, as the
    state query does about a process that does not run, and every call does
    on a GPU fallen off the bus."""

    def __init__(self) -> None:
        super().__init__()
        self.go.set()
        self.asked: list[int] = []
        self.answer = threading.Event()

    def _wait(self, pid, args) -> int:
        self.asked.append(pid)
        self.answer.wait(30)
        return cuda.CUDA_SUCCESS

    cuCheckpointProcessGetState = cuCheckpointProcessCheckpoint = _wait
    cuCheckpointProcessLock = _wait


@pytest.fixture
def stopped():
    """A process stopped by SIGSTOP, as G11 stops a restore's agent."""
    proc = subprocess.Popen(["sleep", "60"])
    try:
        proc.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while not procs.stopped(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        yield proc.pid
    finally:
        proc.kill()
        proc.wait()


def test_the_driver_is_not_asked_about_a_stopped_process(stopped, monkeypatch):
    """Driver 580 answered a state query about a SIGSTOPped process only once it
    was continued (G11, 2026-11-29): the query is refused, with the way out."""
    monkeypatch.setattr(driver_calls, "_HUNG", [])
    lib = _Stuck()
    driver = _driver(lib)
    assert procs.stopped(stopped)
    with pytest.raises(cuda.ProcessHalted) as err:
        driver.state(stopped)
    assert lib.asked == [] and err.value.hint == f"`kill -CONT {stopped}`"
    assert f"process {stopped} is stopped" in err.value.message
    os.kill(stopped, signal.SIGCONT)
    deadline = time.monotonic() + 10
    while procs.stopped(stopped) and time.monotonic() < deadline:
        time.sleep(0.01)
    lib.answer.set()
    assert driver.state(stopped) == cuda.ProcessState.RUNNING and lib.asked == [stopped]


def test_a_state_query_that_does_not_answer_ends_at_its_bound(monkeypatch):
    """A process can stop between the check and the query: the query is bounded
    like cuInit, and the CLI then leaves without libcuda's exit handlers."""
    monkeypatch.setenv("GPUSNAP_WAIT_DRIVER", "0.3")
    monkeypatch.setattr(driver_calls, "_HUNG", [])
    lib = _Stuck()
    driver = _driver(lib)
    started = time.monotonic()
    with pytest.raises(WaitExpired) as err:
        driver.state(os.getpid())
    assert 0.3 <= time.monotonic() - started < 5
    assert err.value.message.startswith(f"the NVIDIA driver's state of process {os.getpid()}: "
                                         "no answer within")
    assert driver_calls.driver_hung()
    lib.answer.set()


def test_states_raises_what_the_driver_could_not_answer(stopped):
    """quiesce.states leaves out processes the driver says are not its own; a
    stopped one is not such a process, and a checkpoint must say so, not call it
    unmanaged."""
    from gpusnap.gpu.quiesce import states
    driver = _driver(_Stuck())
    with pytest.raises(cuda.ProcessHalted):
        states(driver, [stopped])


def test_the_calls_that_move_gpu_memory_end_at_their_bound(monkeypatch):
    """lock, checkpoint, restore and unlock are bounded by DRIVER_MOVE (the lock
    by its own timeout on top): a wedged driver ends the command with one line
    instead of holding it, and the CLI leaves without libcuda's exit handlers."""
    monkeypatch.setenv("GPUSNAP_WAIT_DRIVER_MOVE", "0.3")
    monkeypatch.setattr(driver_calls, "_HUNG", [])
    lib = _Stuck()
    driver = _driver(lib)
    started = time.monotonic()
    with pytest.raises(WaitExpired) as err:
        driver.checkpoint(os.getpid())
    assert 0.3 <= time.monotonic() - started < 5
    assert err.value.message.startswith(f"the NVIDIA driver's checkpoint of process {os.getpid()}")
    assert "wedged" in err.value.hint and "may still complete" in err.value.hint
    assert driver_calls.driver_hung()
    # the driver serialises a process's calls: the next one about it is not waited for
    started = time.monotonic()
    with pytest.raises(WaitExpired) as err:
        driver.unlock(os.getpid())
    assert time.monotonic() - started < 0.2 and "still without an answer" in err.value.message
    with pytest.raises(WaitExpired):  # the lock: its own timeout on top, however set
        driver.lock(os.getpid() + 1, 700)
    assert 1.0 <= time.monotonic() - started < 5
    lib.answer.set()


def test_a_driver_call_that_raises_is_not_taken_for_a_hang(monkeypatch):
    monkeypatch.setattr(driver_calls, "_HUNG", [])
    lib = _Stuck()

    def broken(pid, args):
        raise ctypes.ArgumentError("bad argument")
    lib.cuCheckpointProcessCheckpoint = broken
    started = time.monotonic()
    with pytest.raises(ctypes.ArgumentError):
        _driver(lib).checkpoint(os.getpid())
    assert time.monotonic() - started < 1 and not driver_calls.driver_hung()


def test_a_call_left_behind_is_waited_for_and_its_pid_asked_about_again_once_it_landed(
        monkeypatch):
    """CudaDriver.landed: what a rollback waits on before it puts the process back."""
    monkeypatch.setenv("GPUSNAP_WAIT_DRIVER_MOVE", "0.3")
    monkeypatch.setattr(driver_calls, "_HUNG", [])
    lib = _Stuck()
    driver = _driver(lib)
    assert driver.landed(os.getpid(), 0)  # nothing left behind: at once
    with pytest.raises(WaitExpired):
        driver.checkpoint(os.getpid())
    started = time.monotonic()
    assert not driver.landed(os.getpid(), 0.2)
    assert 0.2 <= time.monotonic() - started < 5
    threading.Timer(0.2, lib.answer.set).start()
    assert driver.landed(os.getpid(), 10)
    assert driver.state(os.getpid()) == cuda.ProcessState.RUNNING  # asked, not refused


class _Machine(_Lib):
    """libcuda with the driver's state per pid, whose ``slow`` call about
    ``slow_pid`` waits until ``land`` is set, then lands as it would have."""

    _MOVES = {"lock": (0, 1), "checkpoint": (1, 2), "restore": (2, 1), "unlock": (1, 0)}

    def __init__(self, slow: str, slow_pid: int) -> None:
        super().__init__()
        self.go.set()
        self.states: dict[int, int] = {}
        self.slow, self.slow_pid = slow, slow_pid
        self.land = threading.Event()

    def cuCheckpointProcessGetState(self, pid, state) -> int:
        state._obj.value = self.states.get(pid, 0)
        return cuda.CUDA_SUCCESS

    def _move(self, call: str, pid: int) -> int:
        if (call, pid) == (self.slow, self.slow_pid):
            self.land.wait(30)
        need, leave = self._MOVES[call]
        assert self.states.get(pid, 0) == need, (call, pid, self.states)
        self.states[pid] = leave
        return cuda.CUDA_SUCCESS

    def cuCheckpointProcessLock(self, pid, args) -> int:
        return self._move("lock", pid)

    def cuCheckpointProcessCheckpoint(self, pid, args) -> int:
        return self._move("checkpoint", pid)

    def cuCheckpointProcessRestore(self, pid, args) -> int:
        return self._move("restore", pid)

    def cuCheckpointProcessUnlock(self, pid, args) -> int:
        return self._move("unlock", pid)


@pytest.fixture
def two_running():
    """Two running processes the driver is asked about (it refuses stopped ones)."""
    procs = [subprocess.Popen(["sleep", "60"]) for _ in range(2)]
    yield [p.pid for p in procs]
    for p in procs:
        p.kill()
        p.wait()


@pytest.mark.parametrize("slow", ["lock", "checkpoint"])
def test_a_call_left_at_its_bound_that_lands_during_the_rollback_is_undone(
        monkeypatch, two_running, slow):
    """A wedged driver's lock (or checkpoint) of one process outlives DRIVER_MOVE:
    the others are put back at once, and that one once its call lands, within
    DRIVER_LATE, instead of staying LOCKED (or CHECKPOINTED) with no guardian."""
    from gpusnap.gpu.quiesce import QuiesceError, quiesce
    monkeypatch.setenv("GPUSNAP_WAIT_DRIVER_MOVE", "0.3")
    monkeypatch.setenv("GPUSNAP_WAIT_DRIVER_LATE", "20")
    monkeypatch.setattr(driver_calls, "_HUNG", [])
    ok, wedged = two_running
    lib = _Machine(slow, wedged)
    threading.Timer(1.5, lib.land.set).start()  # lands after the bound, within the late wait
    with pytest.raises(QuiesceError) as err:
        quiesce(_driver(lib), [ok, wedged], lock_timeout_ms=100)
    assert lib.states == {ok: 0, wedged: 0}  # both RUNNING again
    assert list(err.value.failures) == [wedged] and err.value.rollback_failures == {}
    said = str(err.value)
    assert f"the NVIDIA driver's {slow} of process {wedged}: no answer within" in said
    assert said.endswith("; the call answered later, and the process was put back")
    assert not driver_calls.driver_hung()


def test_a_lock_that_has_not_landed_by_the_late_bound_says_what_to_do(monkeypatch, two_running):
    from gpusnap.gpu.quiesce import QuiesceError, quiesce
    monkeypatch.setenv("GPUSNAP_WAIT_DRIVER_MOVE", "0.3")
    monkeypatch.setenv("GPUSNAP_WAIT_DRIVER_LATE", "0.5")
    monkeypatch.setattr(driver_calls, "_HUNG", [])
    ok, wedged = two_running
    lib = _Machine("lock", wedged)
    try:
        started = time.monotonic()
        with pytest.raises(QuiesceError) as err:
            quiesce(_driver(lib), [ok, wedged], lock_timeout_ms=100)
        assert time.monotonic() - started < 5  # bounded: DRIVER_MOVE (+ the lock's), DRIVER_LATE
        assert lib.states[ok] == 0  # the other one was unlocked, without waiting
        assert list(err.value.rollback_failures) == [wedged]
        assert str(err.value).endswith(
            f"-- and could not undo for pid {wedged}: the call had not answered 0 s later "
            "either: should it still, the process stays off its GPU until `gpusnap doctor "
            "--fix` gives it back")
    finally:
        lib.land.set()
