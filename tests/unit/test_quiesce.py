"""gpusnap.gpu.quiesce against a fake driver: parallel, transactional, honest about failures."""

from __future__ import annotations

import threading

import pytest

from gpusnap.gpu.cuda import ProcessState
from gpusnap.errors import GpusnapError
from gpusnap.gpu.quiesce import (QuiesceError, Timing, quiesce, refuse_unmanaged, resume,
                                 resume_onto, states)
from gpusnap.procs import ProcessGpuUse
from tests.unit.fakes import FakeDriver

R, L, C, F = (ProcessState.RUNNING, ProcessState.LOCKED, ProcessState.CHECKPOINTED,
              ProcessState.FAILED)


def all_running(*pids: int) -> dict[int, ProcessState]:
    return {pid: R for pid in pids}


# --- quiesce: the good path ---------------------------------------------------------------

def test_quiesce_checkpoints_every_process_and_returns_them():
    driver = FakeDriver(all_running(101, 102, 103))
    changed = quiesce(driver, [101, 102, 103])
    assert sorted(changed) == [101, 102, 103]
    assert driver.states == {101: C, 102: C, 103: C}


def test_quiesce_locks_all_before_checkpointing_any():
    driver = FakeDriver(all_running(1, 2, 3))
    quiesce(driver, [1, 2, 3])
    steps = [call for call, _ in driver.calls if call in ("lock", "checkpoint")]
    assert steps == ["lock"] * 3 + ["checkpoint"] * 3


def test_quiesce_checkpoints_in_parallel():
    # Each checkpoint waits for all the others: only concurrent calls get through the barrier.
    pids = [11, 12, 13, 14]
    barrier = threading.Barrier(len(pids), timeout=2)

    def meet(call, pid):
        if call == "checkpoint":
            barrier.wait()

    driver = FakeDriver(all_running(*pids), on_call=meet)
    quiesce(driver, pids)
    assert driver.states == {pid: C for pid in pids}


def test_quiesce_passes_the_lock_timeout_to_the_driver():
    driver = FakeDriver(all_running(5, 6))
    quiesce(driver, [5, 6], lock_timeout_ms=1234)
    assert driver.lock_timeouts == {5: 1234, 6: 1234}


def test_quiesce_records_lock_and_checkpoint_timing():
    driver = FakeDriver(all_running(5))
    timing = Timing()
    quiesce(driver, [5], timing=timing)
    assert set(timing.phases) == {"lock", "checkpoint"}
    assert all(seconds >= 0 for seconds in timing.phases.values())


def test_quiesce_leaves_already_checkpointed_processes_alone():
    driver = FakeDriver({1: C, 2: R})
    changed = quiesce(driver, [1, 2])
    assert changed == [2]
    assert ("lock", 1) not in driver.calls and ("checkpoint", 1) not in driver.calls
    assert driver.states == {1: C, 2: C}


def test_quiesce_checkpoints_a_locked_process_without_locking_it_again():
    driver = FakeDriver({1: L, 2: R})
    changed = quiesce(driver, [1, 2])
    assert sorted(changed) == [1, 2]
    assert driver.called("lock") == [2]
    assert driver.states == {1: C, 2: C}


def test_quiesce_ignores_pids_the_driver_does_not_manage():
    driver = FakeDriver(all_running(1))
    changed = quiesce(driver, [1, 999])
    assert changed == [1]
    assert ("lock", 999) not in driver.calls


def test_quiesce_of_no_cuda_process_does_nothing():
    driver = FakeDriver({})
    assert quiesce(driver, [7, 8]) == []
    assert [c for c, _ in driver.calls if c != "state"] == []


# --- quiesce: failures are rolled back ------------------------------------------------------

def test_lock_failure_unlocks_the_processes_already_locked():
    driver = FakeDriver(all_running(1, 2, 3), fail={("lock", 2): "CUDA_ERROR_TIMEOUT"})
    with pytest.raises(QuiesceError) as info:
        quiesce(driver, [1, 2, 3])
    assert driver.states == {1: R, 2: R, 3: R}
    assert driver.called("unlock") == [1, 3]
    assert driver.called("checkpoint") == []
    assert info.value.action == "lock"
    assert list(info.value.failures) == [2]


def test_lock_failure_message_names_the_pid_and_the_cuda_error():
    driver = FakeDriver(all_running(41, 42), fail={("lock", 42): "CUDA_ERROR_TIMEOUT"})
    with pytest.raises(QuiesceError) as info:
        quiesce(driver, [41, 42])
    msg = str(info.value)
    assert msg.startswith("lock failed for 1 process(es): pid 42: ")
    assert "CUDA_ERROR_TIMEOUT" in msg and "cuCheckpointProcessLock(pid 42)" in msg
    assert "pid 41" not in msg


def test_checkpoint_failure_restores_and_unlocks_the_others():
    driver = FakeDriver(all_running(1, 2, 3), fail={("checkpoint", 3): "CUDA_ERROR_OUT_OF_MEMORY"})
    with pytest.raises(QuiesceError) as info:
        quiesce(driver, [1, 2, 3])
    # 1 and 2 were checkpointed: brought back; 3 stayed locked: unlocked.
    assert driver.states == {1: R, 2: R, 3: R}
    assert driver.called("restore") == [1, 2]
    assert driver.called("unlock") == [1, 2, 3]
    assert info.value.action == "checkpoint"
    assert list(info.value.failures) == [3]
    assert info.value.rollback_failures == {}


def test_checkpoint_failure_message_names_the_pid_and_the_cuda_error():
    driver = FakeDriver(all_running(7, 8), fail={("checkpoint", 8): "CUDA_ERROR_OUT_OF_MEMORY"})
    with pytest.raises(QuiesceError) as info:
        quiesce(driver, [7, 8])
    msg = str(info.value)
    assert "checkpoint failed for 1 process(es)" in msg
    assert "pid 8: cuCheckpointProcessCheckpoint(pid 8) failed: CUDA_ERROR_OUT_OF_MEMORY (2)" in msg
    assert "could not undo" not in msg


def test_several_failures_are_all_reported_in_pid_order():
    driver = FakeDriver(all_running(5, 3, 4), fail={("checkpoint", 5): "CUDA_ERROR_OUT_OF_MEMORY",
                                                   ("checkpoint", 3): "CUDA_ERROR_NOT_SUPPORTED"})
    with pytest.raises(QuiesceError) as info:
        quiesce(driver, [5, 3, 4])
    msg = str(info.value)
    assert "failed for 2 process(es)" in msg
    assert msg.index("pid 3:") < msg.index("pid 5:")
    assert driver.states == {3: R, 4: R, 5: R}


def test_a_rollback_that_fails_is_reported_too():
    driver = FakeDriver(all_running(1, 2), fail={("checkpoint", 2): "CUDA_ERROR_OUT_OF_MEMORY",
                                                ("restore", 1): "CUDA_ERROR_OUT_OF_MEMORY"})
    with pytest.raises(QuiesceError) as info:
        quiesce(driver, [1, 2])
    assert list(info.value.rollback_failures) == [1]
    assert "could not undo for pid 1: cuCheckpointProcessRestore(pid 1)" in str(info.value)
    assert driver.states[2] == R  # the failed one was still unlocked


def test_a_process_the_driver_reports_failed_stops_quiesce_before_any_lock():
    driver = FakeDriver({1: R, 2: F})
    with pytest.raises(QuiesceError) as info:
        quiesce(driver, [1, 2])
    assert list(info.value.failures) == [2]
    assert "FAILED" in str(info.value)
    assert driver.called("lock") == []
    assert driver.states == {1: R, 2: F}


def test_lock_failure_leaves_a_process_locked_by_someone_else_locked():
    driver = FakeDriver({1: L, 2: R}, fail={("lock", 2): "CUDA_ERROR_TIMEOUT"})
    with pytest.raises(QuiesceError):
        quiesce(driver, [1, 2])
    assert driver.states == {1: L, 2: R}
    assert driver.called("unlock") == []


# --- resume -------------------------------------------------------------------------------

def test_resume_restores_then_unlocks_every_process():
    driver = FakeDriver({1: C, 2: C})
    changed = resume(driver, [1, 2])
    assert sorted(changed) == [1, 2]
    assert driver.states == {1: R, 2: R}
    steps = [call for call, _ in driver.calls if call in ("restore", "unlock")]
    assert steps == ["restore", "restore", "unlock", "unlock"]


def test_resume_is_the_inverse_of_quiesce():
    driver = FakeDriver(all_running(1, 2, 3))
    quiesce(driver, [1, 2, 3])
    resume(driver, [1, 2, 3])
    assert driver.states == {1: R, 2: R, 3: R}


def test_resume_hands_gpu_pairs_to_every_restore():
    pairs = [("GPU-a", "GPU-b")]
    driver = FakeDriver({1: C, 2: C})
    resume(driver, [1, 2], gpu_pairs=pairs)
    assert driver.gpu_pairs == {1: pairs, 2: pairs}


def test_resume_unlocks_a_locked_process_without_restoring_it():
    driver = FakeDriver({1: L, 2: R, 3: C})
    changed = resume(driver, [1, 2, 3])
    assert sorted(changed) == [1, 3]
    assert driver.called("restore") == [3]
    assert driver.states == {1: R, 2: R, 3: R}


def test_resume_records_restore_and_unlock_timing():
    driver = FakeDriver({1: C})
    timing = Timing()
    resume(driver, [1], timing=timing)
    assert set(timing.phases) == {"restore", "unlock"}


def test_resume_restore_failure_names_the_pid_and_unlocks_nobody():
    driver = FakeDriver({1: C, 2: C}, fail={("restore", 2): "CUDA_ERROR_OUT_OF_MEMORY"})
    with pytest.raises(QuiesceError) as info:
        resume(driver, [1, 2])
    assert info.value.action == "restore"
    assert "pid 2: cuCheckpointProcessRestore(pid 2) failed: CUDA_ERROR_OUT_OF_MEMORY" in str(info.value)
    # All-or-nothing: no process runs again while another is still without its GPU state.
    assert driver.called("unlock") == []
    assert driver.states == {1: L, 2: C}


def test_resume_after_a_failed_restore_finishes_the_job():
    driver = FakeDriver({1: C, 2: C}, fail={("restore", 2): "CUDA_ERROR_OUT_OF_MEMORY"})
    with pytest.raises(QuiesceError):
        resume(driver, [1, 2])
    driver.fail.clear()
    assert sorted(resume(driver, [1, 2])) == [1, 2]
    assert driver.states == {1: R, 2: R}


def test_resume_unlock_failure_is_reported_and_the_others_still_run():
    driver = FakeDriver({1: C, 2: C}, fail={("unlock", 1): "CUDA_ERROR_ILLEGAL_STATE"})
    with pytest.raises(QuiesceError) as info:
        resume(driver, [1, 2])
    assert info.value.action == "unlock"
    assert list(info.value.failures) == [1]
    assert "unlock failed for 1 process(es): pid 1" in str(info.value)
    assert driver.states == {1: L, 2: R}


# --- states -------------------------------------------------------------------------------

def test_states_skips_pids_the_driver_does_not_manage():
    driver = FakeDriver({1: R, 3: C}, fail={("state", 4): "CUDA_ERROR_NOT_SUPPORTED"})
    assert states(driver, [1, 2, 3, 4]) == {1: R, 3: C}


def test_states_keeps_running_processes_although_running_is_zero():
    # ProcessState.RUNNING == 0 is falsy: a truth test would drop it.
    driver = FakeDriver({1: R})
    assert states(driver, [1]) == {1: R}


# --- refuse_unmanaged: what CRIU could not dump, refused before anything is locked ------------

def _use(pid: int, comm: str = "python3", fds: bool = True, maps: bool = True) -> ProcessGpuUse:
    return ProcessGpuUse(pid=pid, comm=comm, opens_nvidia=fds, maps_libcuda=True, maps_nvidia=maps)


def test_a_forked_child_the_driver_does_not_know_is_refused_by_pid_and_name():
    # a child forked after cuInit inherits the fds and mappings: NOT_INITIALIZED for it
    driver = FakeDriver(all_running(10), fail={("state", 11): "CUDA_ERROR_NOT_INITIALIZED"})
    with pytest.raises(GpusnapError) as err:
        refuse_unmanaged(driver, [_use(10), _use(11, "pt_compile")])
    e = err.value
    assert e.message.startswith("process 11 (pt_compile) holds the GPU driver's files without "
                                "a CUDA context of its own, as a child forked from a CUDA "
                                "process does:"), e.message
    assert "nothing was quiesced" in e.message and "shutdown_compile_workers()" in e.hint
    assert [c for c, _ in driver.calls if c != "state"] == [], "nothing is locked before"


def test_many_forked_children_are_counted_and_three_named():
    fail = {("state", pid): "CUDA_ERROR_NOT_INITIALIZED" for pid in range(20, 31)}
    driver = FakeDriver(all_running(10), fail=fail)
    with pytest.raises(GpusnapError) as err:
        refuse_unmanaged(driver, [_use(10)] + [_use(pid) for pid in range(20, 31)])
    assert err.value.message.startswith("11 processes (20, 21, 22 and more; python3) hold the "
                                        "GPU driver's files without a CUDA context of their own")


def test_a_mapping_alone_is_refused_too():
    driver = FakeDriver({})
    with pytest.raises(GpusnapError, match="process 5 "):
        refuse_unmanaged(driver, [_use(5, fds=False, maps=True)])


def test_processes_the_driver_manages_or_that_hold_nothing_pass():
    # managed: the driver drops their files at its checkpoint (NVML-only and
    # cuInit-only processes are, on driver 580); libcuda mapped alone holds nothing
    driver = FakeDriver({1: R, 2: C})
    refuse_unmanaged(driver, [_use(1), _use(2), _use(3, fds=False, maps=False)])
    refuse_unmanaged(driver, [])


def test_resume_onto_one_choice_says_the_drivers_words_once():
    driver = FakeDriver({7: C}, fail={("restore", 7): "CUDA_ERROR_OUT_OF_MEMORY"})
    with pytest.raises(QuiesceError) as info:
        resume_onto(driver, [7], [("none", None)])
    assert str(info.value).count("failed for") == 1, str(info.value)
    assert str(info.value).startswith("restore failed for 1 process(es): pid 7: ")
    assert "CUDA_ERROR_OUT_OF_MEMORY" in str(info.value)


def test_resume_onto_names_each_refused_choice_per_process():
    driver = FakeDriver({7: C, 8: C}, fail={("restore", 7): "CUDA_ERROR_OUT_OF_MEMORY"})
    with pytest.raises(QuiesceError) as info:
        resume_onto(driver, [7, 8], [("as planned", None), ("swapped", None)])
    assert set(info.value.failures) == {7}
    said = str(info.value.failures[7])
    assert said.startswith("as planned: ") and "; swapped: " in said, said
    assert said.count("CUDA_ERROR_OUT_OF_MEMORY") == 2 and "failed for" not in said, said


def test_resume_onto_reports_what_was_refused_before_the_choice_taken():
    driver = FakeDriver({7: C})
    refusals = iter(["CUDA_ERROR_OUT_OF_MEMORY"])

    def refuse_once(call, pid):
        if call == "restore" and (name := next(refusals, None)):
            driver.fail[("restore", pid)] = name
        else:
            driver.fail.pop(("restore", pid), None)
    driver.on_call = refuse_once
    label, changed, refused = resume_onto(driver, [7], [("as planned", None), ("swapped", None)])
    assert (label, changed) == ("swapped", [7])
    assert len(refused) == 1 and refused[0].startswith("as planned: restore failed"), refused


def test_ctrl_c_in_the_quiesce_puts_every_process_back(monkeypatch):
    # Ctrl-C reaches the CLI (freeze, move) while the driver's calls run: the
    # pool waits them out, then every process goes back to RUNNING
    from gpusnap.gpu import quiesce as module

    driver = FakeDriver({1: ProcessState.RUNNING, 2: ProcessState.RUNNING})
    timed = module._timed

    def interrupted(timing, phase, pids, fn):
        done = timed(timing, phase, pids, fn)
        if phase == "checkpoint":
            raise KeyboardInterrupt
        return done
    monkeypatch.setattr(module, "_timed", interrupted)
    with pytest.raises(KeyboardInterrupt):
        quiesce(driver, [1, 2])
    assert driver.states == {1: ProcessState.RUNNING, 2: ProcessState.RUNNING}
