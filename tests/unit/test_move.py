"""`gpusnap move`'s record and its undo (ops/move.py, ops/moving.py): a move cut
anywhere, by a failure or a kill, ends with every process on its old GPUs
behind the old nodes and rule, from the move itself or from doctor --fix."""

from __future__ import annotations

import contextlib
import json
from types import SimpleNamespace

import pytest

from gpusnap import journal
from gpusnap.errors import GpusnapError
from gpusnap.gpu import turn
from gpusnap.gpu.cuda import ProcessState
from gpusnap.gpu.quiesce import Timing, quiesce
from gpusnap.ops import doctor, freeze, move, moving
from gpusnap.runtime import podman
from tests.unit.fakes import FakeDriver

R, L, C = ProcessState.RUNNING, ProcessState.LOCKED, ProcessState.CHECKPOINTED
INIT = 4000
FORWARD = [("GPU-old", "GPU-new")]
CHOICES = [("every GPU", FORWARD), ("none", None)]
BACK = [("GPU-new", "GPU-old")]


@pytest.fixture(autouse=True)
def state_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUSNAP_STATE_DIR", str(tmp_path / "state"))
    # every pid runs, born at 7 (a record outliving its processes is tested apart)
    monkeypatch.setattr(moving, "start_time", lambda pid: 7)


class FakeLive:
    """LiveDevices' part a move sees; its apply and undo go into the driver's calls,
    so that their order against the driver's is checked."""

    def __init__(self, driver: FakeDriver, fail_apply: bool = False) -> None:
        self.driver, self.fail_apply = driver, fail_apply

    def apply(self) -> None:
        self.driver.calls.append(("apply", 0))
        if self.fail_apply:
            raise GpusnapError("cannot change the container's device nodes (/dev/nvidia1: EIO)")

    def undo(self) -> None:
        self.driver.calls.append(("undo", 0))

    def close(self) -> None:
        pass

    def to_dict(self) -> dict:
        return {"nodes": "as recorded"}


CTR = SimpleNamespace(pid=INIT, name="web", id="c0ffee")


def _restores(driver: FakeDriver, pid: int) -> list:
    """The pairs of each restore of ``pid``, in order (FakeDriver keeps the last only)."""
    return [pairs for call, pairs in driver.restored if call == pid]


def _driver(states: dict, refuse_forward: set[int] = frozenset()) -> FakeDriver:
    """A driver that refuses the forward pairs' restore of the ``refuse_forward`` pids."""
    driver = FakeDriver(states)
    driver.restored = []

    def on_call(call: str, pid: int) -> None:
        if call != "restore":
            return
        driver.restored.append((pid, driver.gpu_pairs[pid]))
        if pid in refuse_forward and driver.gpu_pairs[pid] == FORWARD:
            driver.fail[("restore", pid)] = "CUDA_ERROR_OUT_OF_MEMORY"
        else:
            driver.fail.pop(("restore", pid), None)
    driver.on_call = on_call
    return driver


def _act(driver: FakeDriver, live: FakeLive, choices=None):
    return move._act(CTR, sorted(driver.states), driver, live, choices or [("every GPU", FORWARD)],
                     1000, Timing())


def test_a_move_is_recorded_before_anything_changes_and_forgotten_once_done():
    driver = _driver({1: R, 2: R})
    seen = {}

    class Looking(FakeLive):
        def apply(self) -> None:
            seen["record"] = [(m.container, m.phase, sorted(m.pids)) for m in moving.under_way()]
            seen["states"] = dict(driver.states)
            super().apply()
    assert _act(driver, Looking(driver)) == ("every GPU", [])
    assert seen == {"record": [("web", moving.DEVICES, [1, 2])], "states": {1: C, 2: C}}
    assert moving.under_way() == [] and driver.states == {1: R, 2: R}


def test_a_quiesce_that_fails_leaves_no_record():
    driver = _driver({1: R})
    driver.fail[("lock", 1)] = "CUDA_ERROR_TIMEOUT"
    with pytest.raises(GpusnapError, match="could not stop web's GPU work, nothing was changed"):
        _act(driver, FakeLive(driver))
    assert moving.under_way() == [] and ("apply", 0) not in driver.calls


def test_a_record_that_cannot_be_written_on_the_way_does_not_stop_the_undo(monkeypatch):
    # the state folder filled up after the record was begun: the move fails at its
    # next step and puts itself back all the same, its processes on their old GPUs
    driver = _driver({1: R, 2: R})
    begun = moving.Move.save

    def full(self):
        if self.phase != moving.QUIESCE:
            raise OSError(28, "No space left on device")
        begun(self)
    monkeypatch.setattr(moving.Move, "save", full)
    with pytest.raises(GpusnapError, match="moving web failed, it runs on its old GPUs again: "
                       "cannot record the move's progress .*No space left") as info:
        _act(driver, FakeLive(driver))
    assert info.value.hint.startswith("free space under ")
    assert driver.states == {1: R, 2: R} and ("apply", 0) not in driver.calls
    assert [e["phase"] for e in journal.read(50) if e["event"] == "move-record-unsaved"] == \
        [moving.DEVICES, moving.UNDONE]


def _cut_after_the_swap(driver: FakeDriver, restored: list[int] = ()) -> None:
    """A move killed (SIGKILL) once its devices changed, ``restored`` already
    restored onto the new GPUs: its record, as it left it."""
    pids = sorted(driver.states)
    record = moving.begin(INIT, "web", pids, FakeLive(driver), CHOICES)
    quiesce(driver, pids)
    record.advance(moving.DEVICES)
    driver.calls.append(("apply", 0))
    for pid in restored:
        driver.restore(pid, FORWARD)


@pytest.fixture
def doctor_here(monkeypatch):
    """doctor with a fake driver, a fake /proc of CUDA processes and recorded
    devices that log their undo into the driver's calls."""
    def use(driver: FakeDriver, proc) -> None:
        for pid in driver.states:
            (proc / str(pid)).mkdir(parents=True)
        monkeypatch.setattr(doctor, "PROC", proc)
        monkeypatch.setattr(doctor, "gpu_use", lambda pid, root: SimpleNamespace(
            pid=pid, comm="python", maps_libcuda=True))
        monkeypatch.setattr(doctor, "stopped", lambda pid: False)
        monkeypatch.setattr(doctor, "is_frozen", lambda pid: False)
        monkeypatch.setattr(doctor, "load_driver", lambda: driver)
        monkeypatch.setattr(moving.LiveDevices, "recorded", staticmethod(lambda d: FakeLive(driver)))
    return use


def test_doctor_undoes_a_killed_move_before_its_generic_fix_can_resume_the_processes(
        tmp_path, doctor_here):
    driver = _driver({1: R, 2: R})
    _cut_after_the_swap(driver)
    doctor_here(driver, tmp_path / "proc")
    assert doctor.stuck_processes() == []  # the move's own: never resumed onto the old nodes' GPU
    check, said = doctor._moves_check(fix=False)
    assert not check.ok and check.level == "error" and "gpusnap doctor --fix" in check.fix
    assert "web (pids 1, 2): cut off with its GPU nodes and device rule changed" in check.detail
    check, said = doctor._moves_check(fix=True)
    assert check.ok and said[0]["state"] == "undone", said
    gpu_check, stuck, fixed = doctor._gpu_processes_check(fix=True)
    assert gpu_check.ok and stuck == [] and fixed == []
    undone_at = driver.calls.index(("undo", 0))
    assert all(driver.calls.index(("restore", p)) > undone_at for p in (1, 2))
    assert driver.states == {1: R, 2: R} and moving.under_way() == []


def test_doctor_leaves_a_move_at_work_alone(doctor_here, tmp_path):
    driver = _driver({1: R})
    _cut_after_the_swap(driver)
    doctor_here(driver, tmp_path / "proc")
    with turn.try_take(INIT, "move"):  # the move itself, still at work
        check, said = doctor._moves_check(fix=True)
    assert check.ok and said[0]["state"] == "at work"
    assert ("undo", 0) not in driver.calls and driver.states == {1: C}


def test_a_record_outliving_its_container_names_nothing(monkeypatch):
    driver = _driver({1: R})
    _cut_after_the_swap(driver)
    monkeypatch.setattr(moving, "start_time", lambda pid: 8)  # pids reused by other processes
    assert moving.under_way() == [] and moving.moving() == {}


@pytest.mark.parametrize("command,verb", [("move", "be moved"), ("freeze", "be frozen"),
                                          ("thaw", "be thawed")])
def test_a_container_with_a_cut_move_is_refused_until_doctor_undoes_it(monkeypatch, command, verb):
    _cut_after_the_swap(_driver({1: R}))
    ctr = podman.Container(id="c0ffee", name="web", status="running", pid=INIT, image="img",
                           checkpointed=False, userdata=podman.Path("/nonexistent"), devices=[])
    monkeypatch.setattr(podman, "inspect", lambda name: ctr)
    monkeypatch.setattr(freeze, "wait_turn", lambda *a: contextlib.nullcontext())
    monkeypatch.setattr(freeze, "cuda_of", lambda *a: ([SimpleNamespace(pid=1)], object()))
    with pytest.raises(GpusnapError, match=f"a move of web was cut off .* cannot {verb}") as info:
        with freeze.gpu_turn("web", verb, command):
            pass
    assert info.value.hint == "`gpusnap doctor --fix` puts it back on its old GPUs"


def test_a_checkpoint_during_a_move_at_work_is_told_to_wait_not_sent_to_doctor():
    # checkpoint.plan asks outside the turn: a record whose turn is held is a move
    # at work, which doctor --fix would leave alone (the advice would do nothing)
    _cut_after_the_swap(_driver({1: R}))
    with turn.try_take(INIT, "move"):
        with pytest.raises(GpusnapError, match="web is being moved") as info:
            moving.refuse(INIT, "web", "be checkpointed", holding_turn=False)
    assert info.value.hint == "run it again once the move is done"
    with pytest.raises(GpusnapError, match="a move of web was cut off"):
        moving.refuse(INIT, "web", "be checkpointed", holding_turn=False)


# --- a resume that half succeeded: none left on the new GPUs behind the old nodes ------

def test_a_resume_that_half_succeeded_is_checkpointed_again_then_resumed_on_the_old_gpus():
    # pid 1 restored onto the new GPU, pid 2 refused there: the old nodes back,
    # pid 1 would have stayed on the new GPU, split from pid 2
    driver = _driver({1: R, 2: R}, refuse_forward={2})
    with pytest.raises(GpusnapError, match="moving web failed, it runs on its old GPUs again"):
        _act(driver, FakeLive(driver))
    checkpoints = [i for i, call in enumerate(driver.calls) if call == ("checkpoint", 1)]
    assert len(checkpoints) == 2 and checkpoints[1] < driver.calls.index(("undo", 0))
    assert _restores(driver, 1) == [FORWARD, BACK]  # checkpointed on the new GPU: paired back
    assert _restores(driver, 2) == [FORWARD, None]  # checkpointed on the old one: as it was
    assert driver.states == {1: R, 2: R} and moving.under_way() == []


def test_a_failed_checkpoint_off_the_new_gpus_says_doctor_and_keeps_the_record(
        tmp_path, doctor_here):
    driver = _driver({1: R, 2: R}, refuse_forward={2})
    restore = driver.on_call

    def no_second_checkpoint(call: str, pid: int) -> None:
        restore(call, pid)
        if (call, pid) == ("restore", 1):  # on the new GPU now: its checkpoint fails
            driver.fail[("checkpoint", 1)] = "CUDA_ERROR_TIMEOUT"
    driver.on_call = no_second_checkpoint
    with pytest.raises(GpusnapError) as info:
        _act(driver, FakeLive(driver))
    said = str(info.value)
    assert "putting it back did not finish: process(es) restored onto the new GPUs could " \
           "not be checkpointed again" in said and "\n" not in said, said
    assert info.value.hint == "`gpusnap doctor --fix` puts it back on its old GPUs"
    assert ("undo", 0) not in driver.calls
    [record] = moving.under_way()
    assert (record.phase, record.on_new) == (moving.DEVICES, [1])
    driver.fail.pop(("checkpoint", 1))
    driver.on_call = restore
    doctor_here(driver, tmp_path / "proc")
    check, _ = doctor._moves_check(fix=True)
    assert check.ok, check.detail
    assert _restores(driver, 1) == [FORWARD, BACK] and driver.states == {1: R, 2: R}


def test_doctor_finishes_a_move_killed_on_its_way_back(tmp_path, doctor_here):
    driver = _driver({1: R, 2: R})
    _cut_after_the_swap(driver, restored=[1])
    [record] = moving.under_way()
    quiesce(driver, [1])  # the move's undo, killed once it had resumed pid 2 alone
    record.advance(moving.DEVICES, [1])
    driver.calls.append(("undo", 0))
    record.advance(moving.UNDONE)
    driver.restore(2)
    doctor_here(driver, tmp_path / "proc")
    check, _ = doctor._moves_check(fix=True)
    assert check.ok, check.detail
    assert driver.calls.count(("undo", 0)) == 1  # the nodes were back already
    assert _restores(driver, 1) == [FORWARD, BACK] and _restores(driver, 2) == [None]
    assert driver.states == {1: R, 2: R}


def test_the_pairs_back_are_each_choice_the_other_way_round():
    record = moving.Move(INIT, 7, "web", {1: 7}, {}, CHOICES)
    assert record.back_choices() == [("every GPU, back", BACK), ("none, back", None)]


def test_the_pairs_the_driver_took_back_are_journaled():
    driver = _driver({1: R, 2: R}, refuse_forward={2})
    with pytest.raises(GpusnapError):
        _act(driver, FakeLive(driver))
    lines = [json.loads(line) for line in (journal.state_dir() / "journal.jsonl").read_text()
             .splitlines()]
    [back] = [line for line in lines if line["event"] == "move-resumed-back"]
    assert (back["pids"], back["gpu_pairs"]) == ([1], "every GPU, back")


def test_a_ctrl_c_during_the_undo_waits_until_the_move_is_put_back():
    import os
    import signal
    driver = _driver({1: R, 2: R}, refuse_forward={2})

    class Interrupted(FakeLive):
        def undo(self) -> None:
            os.kill(os.getpid(), signal.SIGINT)  # the user's Ctrl-C, mid-undo
            super().undo()
    with pytest.raises(KeyboardInterrupt):
        _act(driver, Interrupted(driver))
    assert driver.states == {1: R, 2: R} and moving.under_way() == []
    assert [e["event"] for e in journal.read(20)][-1] == "move-undone"
