"""action/guardian.py: no process left without its GPU. A dump still in flight
(CRIU traces the processes) is waited for before any thaw, and so is a task
the containerd shim holds paused for its client (requests.HELD); the
containerd client's guardian drops the client's request once it is gone."""

from __future__ import annotations

import os
import time

import pytest

from gpusnap import requests
from gpusnap.action import guardian


def test_a_freeze_is_not_thawed_while_criu_still_traces_the_processes(monkeypatch):
    traced_until = time.monotonic() + 0.3
    thawed: list[int] = []
    monkeypatch.setattr(guardian, "alive", lambda pid: True)
    monkeypatch.setattr(guardian, "traced_by_criu", lambda pid: time.monotonic() < traced_until)
    monkeypatch.setattr(guardian, "is_frozen", lambda pid: pid not in thawed)
    monkeypatch.setattr(guardian, "thaw", lambda pid: thawed.append(pid) or True)
    monkeypatch.setattr(guardian.journal, "record", lambda *a, **k: None)
    living = guardian.survivors_to_resume([7], time.monotonic() + 10, grace=0.1)
    assert living == [7] and thawed == [7]
    assert time.monotonic() >= traced_until + 0.1  # the grace counted from the dump's end


def test_the_clients_guardian_drops_its_request_once_the_client_is_gone(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUSNAP_STATE_DIR", str(tmp_path))
    monkeypatch.setattr(requests, "start_time", lambda pid: 1)
    requests.put_bound(700, requests.QUIESCED, manifest={"gpus": []}, pids=[701])
    monkeypatch.setattr(guardian, "wait_exit", lambda pid: None)
    monkeypatch.setattr(guardian, "_handed_over", lambda: [])
    monkeypatch.setattr(guardian, "survivors_to_resume", lambda pids, deadline, **kw: [])
    assert guardian.main(["9999", "701", "--init", "700", "--drop-request"]) == 0
    assert requests.peek(700, requests.QUIESCED) == {}


def test_a_task_the_shim_holds_paused_for_its_client_is_not_thawed_nor_restored(monkeypatch):
    """The shim paused it again after the dump; the client resumes it (after its
    rw diff) and only then may the driver restore run, however long after."""
    held_until = time.monotonic() + 0.4
    thawed: list[int] = []
    monkeypatch.setattr(guardian, "alive", lambda pid: True)
    monkeypatch.setattr(guardian, "traced_by_criu", lambda pid: False)
    monkeypatch.setattr(guardian, "is_frozen", lambda pid: time.monotonic() < held_until)
    monkeypatch.setattr(guardian, "thaw", lambda pid: thawed.append(pid) or True)
    living = guardian.survivors_to_resume([7], time.monotonic() + 0.1, grace=0.05,
                                          held=lambda: time.monotonic() < held_until)
    assert living == [7] and thawed == []  # the client's Resume thawed it, not the guardian
    assert time.monotonic() >= held_until


def test_a_debugger_is_no_dump_in_flight(tmp_path):
    from gpusnap.procs import traced_by_criu
    for pid, comm, tracer in ((10, "python3", 20), (11, "python3", 21), (12, "python3", 0)):
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "status").write_text(f"Name:\t{comm}\nTracerPid:\t{tracer}\n")
    for pid, comm in ((20, "criu"), (21, "gdb")):
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "comm").write_text(comm + "\n")
    assert [traced_by_criu(p, tmp_path) for p in (10, 11, 12)] == [True, False, False]


def test_the_guardian_restores_a_held_task_only_once_the_shims_resume_dropped_the_mark(
        tmp_path, monkeypatch):
    """pre-dump starts it with --init; the shim's HELD mark, under that pid, holds it."""
    monkeypatch.setenv("GPUSNAP_STATE_DIR", str(tmp_path))
    monkeypatch.setattr(requests, "start_time", lambda pid: 1)
    requests.put_bound(700, requests.HELD)
    resumed_at: list[float] = []
    dropped_at = time.monotonic() + 0.5
    monkeypatch.setattr(guardian, "wait_exit", lambda pid: None)
    monkeypatch.setattr(guardian, "_handed_over", lambda: [])
    monkeypatch.setattr(guardian, "alive", lambda pid: True)
    monkeypatch.setattr(guardian, "traced_by_criu", lambda pid: False)
    # not frozen: as between CRIU's end and the shim's pause again, the riskiest moment
    monkeypatch.setattr(guardian, "is_frozen", lambda pid: False)
    monkeypatch.setattr(guardian, "thaw", lambda pid: pytest.fail("the client's to thaw"))
    monkeypatch.setattr(guardian, "CudaDriver", lambda: None)
    monkeypatch.setattr(guardian, "resume",
                        lambda driver, pids: resumed_at.append(time.monotonic()) or pids)

    def the_shims_resume():
        time.sleep(max(0.0, dropped_at - time.monotonic()))
        requests.drop(700, requests.HELD)
    import threading
    threading.Thread(target=the_shims_resume).start()
    assert guardian.main(["9999", "701", "--init", "700"]) == 0
    assert resumed_at and resumed_at[0] >= dropped_at


def test_the_guardian_lets_go_of_the_turn_once_the_gpus_are_back(tmp_path, monkeypatch):
    """pre-dump handed it the container's turn (gpu/turn.py): the next
    checkpoint may quiesce once the resume has returned, not before."""
    from gpusnap.gpu import turn as turns
    monkeypatch.setenv("GPUSNAP_STATE_DIR", str(tmp_path))
    turn = turns.try_take(700, "pre-dump")
    real_guard = guardian._guard
    resumed: list[list[int]] = []
    monkeypatch.setattr(guardian, "wait_exit", lambda pid: None)
    monkeypatch.setattr(guardian, "_handed_over", lambda: [])
    monkeypatch.setattr(guardian, "survivors_to_resume", lambda pids, deadline, **kw: pids)
    monkeypatch.setattr(guardian, "CudaDriver", lambda: None)

    def resume(driver, pids):
        assert turns.try_take(700, "test") is None  # held all through the resume
        resumed.append(pids)
        return pids
    monkeypatch.setattr(guardian, "resume", resume)
    monkeypatch.setattr(guardian.journal, "record", lambda *a, **k: None)
    monkeypatch.setattr(guardian, "_guard", lambda *a: (
        turns.holder(700) == (os.getpid(), "guardian") or pytest.fail("not named the holder"))
        and real_guard(*a))
    assert guardian.main(["9999", "701", "--init", "700", "--turn-fd", str(turn.fd)]) == 0
    assert resumed == [[701]]
    with pytest.raises(OSError):
        os.fstat(turn.fd)  # its copy is closed
    assert turns.try_take(700, "test") is not None


def test_the_guardian_says_when_it_waits_for_the_clients_resume(tmp_path, monkeypatch):
    """Its role in the turn flips to "guardian-held" while the shim holds the
    task for its client (pre-dump of the shim's next try may go on) and back."""
    from gpusnap.gpu import turn as turns
    monkeypatch.setenv("GPUSNAP_STATE_DIR", str(tmp_path))
    turn = turns.try_take(700, "pre-dump")
    now = [True]
    monkeypatch.setattr(guardian.requests, "held", lambda init: now[0])
    held = guardian._held(700, turn.fd)
    assert held() and turns.holder(700) == (os.getpid(), "guardian-held")
    now[0] = False
    assert not held() and turns.holder(700) == (os.getpid(), "guardian")
    turn.release()


def test_a_guardian_that_fails_says_so_and_lets_go(tmp_path, monkeypatch):
    from gpusnap import journal
    from gpusnap.gpu import turn as turns
    monkeypatch.setenv("GPUSNAP_STATE_DIR", str(tmp_path))
    turn = turns.try_take(700, "pre-dump")
    monkeypatch.setattr(guardian, "wait_exit", lambda pid: None)
    monkeypatch.setattr(guardian, "_handed_over", lambda: 1 / 0)
    assert guardian.main(["9999", "701", "--init", "700", "--turn-fd", str(turn.fd)]) == 1
    failed, done = journal.read()[-2:]
    assert failed["event"] == "guardian-failed" and "ZeroDivisionError" in failed["error"]
    assert done["event"] == guardian.DONE and not done["ok"]
    assert turns.try_take(700, "test") is not None


def test_memory_read_ahead_stays_held_from_a_driver_restore_until_written_back(tmp_path,
                                                                                monkeypatch):
    # pre-dump dropped the processes' memory into the guardian's files: until
    # they are written back, a driver restore (doctor --fix, a failed dump's
    # clean-up) would bring back zeros; a write-back that failed keeps the hold
    from types import SimpleNamespace

    from gpusnap.gpu import quiesce, staging
    from gpusnap.gpu.cuda import ProcessState
    from tests.unit.fakes import FakeDriver

    monkeypatch.setenv("GPUSNAP_STATE_DIR", str(tmp_path))
    me, parent = os.getpid(), os.getppid()
    for pid in (me, parent):
        staging.hold(pid, [])  # as pre-dump does before its drop
    monkeypatch.setattr(guardian, "wait_exit", lambda pid: None)
    monkeypatch.setattr(guardian, "_handed_over",
                        lambda: [(SimpleNamespace(pid=me), 0), (SimpleNamespace(pid=parent), 1)])
    monkeypatch.setattr(guardian, "survivors_to_resume", lambda pids, deadline, **kw: pids)
    monkeypatch.setattr(guardian, "write_back", lambda taken, init=None: {parent})
    monkeypatch.setattr(guardian, "CudaDriver", lambda: None)
    monkeypatch.setattr(guardian, "resume", lambda driver, pids: pids)
    guardian._guard(["9999", str(me), str(parent)], None, False, None)
    assert staging.held(me) is None and staging.held(parent) == []
    driver = FakeDriver({parent: ProcessState.CHECKPOINTED})
    with pytest.raises(quiesce.QuiesceError):
        quiesce.resume(driver, [parent])  # doctor --fix: refused, never zeros


def test_a_guardian_ends_with_its_verdict_before_it_lets_go_of_the_turn(tmp_path, monkeypatch):
    """`gpusnap checkpoint --leave-running` waits for the turn, then reads this
    record (ops/gpu_back.py): it must be there once the turn is free."""
    from gpusnap import journal
    from gpusnap.gpu import turn as turns
    monkeypatch.setenv("GPUSNAP_STATE_DIR", str(tmp_path))
    monkeypatch.setattr(guardian, "wait_exit", lambda pid: None)
    monkeypatch.setattr(guardian, "_handed_over", lambda: [])
    monkeypatch.setattr(guardian, "survivors_to_resume", lambda pids, deadline, **kw: pids)
    monkeypatch.setattr(guardian, "CudaDriver", lambda: None)
    seen_free: list[bool] = []
    real_release = guardian.release_fd

    def release(init, fd):
        seen_free.append(journal.read()[-1]["event"] == guardian.DONE)
        real_release(init, fd)
    monkeypatch.setattr(guardian, "release_fd", release)
    for resume, ok in ((lambda driver, pids: pids, True),
                       (lambda driver, pids: (_ for _ in ()).throw(RuntimeError("refused")), False)):
        monkeypatch.setattr(guardian, "resume", resume)
        turn = turns.try_take(700, "pre-dump")
        guardian.main(["9999", "701", "--init", "700", "--turn-fd", str(turn.fd)])
        events = journal.read()
        assert events[-1] == {**events[-1], "event": guardian.DONE, "init_pid": 700, "ok": ok}
        if not ok:
            assert events[-2]["event"] == "guardian-failed" and events[-2]["init_pid"] == 700
    assert seen_free == [True, True]
