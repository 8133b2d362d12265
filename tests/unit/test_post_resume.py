"""post-resume and the restore's check never leave a process the driver
checkpointed off its GPU without a word: the driver's answer is waited for,
and a process still CHECKPOINTED after Podman is resumed by the CLI."""

from __future__ import annotations

import json

import pytest

from gpusnap import MANIFEST_NAME, journal
from gpusnap.action import action, step_state
from gpusnap.errors import GpusnapError
from gpusnap.gpu import quiesce
from gpusnap.gpu.cuda import ProcessState
from gpusnap.ops import gpu_state, restore as ops_restore, restore_check
from gpusnap.private import write_private
from gpusnap.procs import ProcessGpuUse
from tests.unit.fakes import UUID0, FakeDriver, gpu
from tests.unit.test_plan import manifest

CRIU = 4242
TRAIN = [ProcessGpuUse(pid=77, comm="train", maps_libcuda=True)]


@pytest.fixture
def kept(tmp_path, monkeypatch):
    """pre-restore's kept manifest: one process with 8 GiB on GPU 0."""
    monkeypatch.setenv("GPUSNAP_STATE_DIR", str(tmp_path / "state"))
    m = manifest(gpu(0, UUID0), used={UUID0: 8 << 30})
    write_private(step_state.restore(CRIU), json.dumps({MANIFEST_NAME: m.to_json()}))


def _resumed() -> list[dict]:
    return [r for r in journal.read() if r.get("event") == "resumed"]


def test_post_resume_waits_for_the_drivers_answer_for_a_process_it_checkpointed(kept, monkeypatch):
    driver = FakeDriver({77: ProcessState.CHECKPOINTED},
                        fail={("state", 77): "CUDA_ERROR_NOT_INITIALIZED"})
    ask = driver.state

    def state(pid):
        if driver.calls.count(("state", pid)) == 2:  # it answers from the third question on
            driver.fail.clear()
        return ask(pid)

    monkeypatch.setattr(driver, "state", state)
    monkeypatch.setattr(action, "cuda_processes", lambda pid: TRAIN)
    action.post_resume(init_pid=70, criu_pid=CRIU, driver=driver)
    assert driver.states[77] == ProcessState.RUNNING
    (rec,) = _resumed()
    assert rec["pids"] == [77] and rec["waited_s"] > 0
    assert rec["unanswered"] == {"77": "CUDA_ERROR_NOT_INITIALIZED"}


def test_post_resume_waits_for_the_restored_process_to_be_seen(kept, monkeypatch):
    seen = iter([[], [], TRAIN])
    monkeypatch.setattr(action, "cuda_processes", lambda pid: next(seen, TRAIN))
    driver = FakeDriver({77: ProcessState.CHECKPOINTED})
    action.post_resume(init_pid=70, criu_pid=CRIU, driver=driver)
    assert driver.states[77] == ProcessState.RUNNING


def test_post_resume_says_so_when_the_driver_never_answers(kept, monkeypatch):
    monkeypatch.setenv("GPUSNAP_WAIT_RESUME_SETTLE", "0.2")
    monkeypatch.setattr(action, "cuda_processes", lambda pid: TRAIN)
    driver = FakeDriver({77: ProcessState.CHECKPOINTED},
                        fail={("state", 77): "CUDA_ERROR_NOT_INITIALIZED"})
    with pytest.raises(GpusnapError, match=r"GPU memory of 1 process\(es\), but after 0 s the "
                       r"NVIDIA driver answers for 0 of the 1 restored ones \(pid 77: "
                       r"CUDA_ERROR_NOT_INITIALIZED\); those stay CHECKPOINTED") as err:
        action.post_resume(init_pid=70, criu_pid=CRIU, driver=driver)
    assert "gpusnap doctor --fix" in err.value.hint
    assert driver.states[77] == ProcessState.CHECKPOINTED and not _resumed()


def test_a_tree_without_gpu_memory_or_cuda_processes_needs_no_driver(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUSNAP_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setattr(action, "cuda_processes", lambda pid: [])
    monkeypatch.setattr(quiesce, "require_driver", lambda: pytest.fail("no driver needed"))
    action.post_resume(init_pid=70, criu_pid=CRIU)


@pytest.fixture
def check(tmp_path, monkeypatch):
    """The restore's check over TRAIN (its container's init is pid 70)."""
    monkeypatch.setenv("GPUSNAP_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setattr(restore_check, "cuda_processes", lambda pid: TRAIN)
    monkeypatch.setattr(gpu_state, "key_for", lambda pid: 70)

    def driving(driver):
        monkeypatch.setattr(restore_check, "load_driver", lambda: driver)
        return driver
    return driving


def test_the_restores_check_resumes_a_process_post_resume_left_checkpointed(check):
    check(FakeDriver({77: ProcessState.CHECKPOINTED}))
    report = restore_check.gpu_report(70)
    assert report == [{"pid": 77, "comm": "train", "state": "RUNNING", "resumed_late": True}]
    (rec,) = _resumed()
    assert rec["by"] == "restore's check" and rec["pids"] == [77]


def _refused_for_good(check) -> FakeDriver:
    """Driver 580 as seen on an H200 (2026-11-30): post-resume's restore refused for
    memory, and every restore of that process after it refused too."""
    journal.record("failed", action="post-resume", init_pid="70",
                   error="cuCheckpointProcessRestore(pid 77) failed: CUDA_ERROR_OUT_OF_MEMORY (2)")
    return check(FakeDriver({77: ProcessState.CHECKPOINTED},
                            fail={("restore", 77): "CUDA_ERROR_OPERATING_SYSTEM"}))


def test_a_process_the_driver_will_not_bring_back_is_said_with_both_refusals(check):
    _refused_for_good(check)
    with pytest.raises(restore_check.OffTheGpu) as err:
        restore_check.gpu_report(70)
    msg = err.value.message
    assert msg.startswith("the NVIDIA driver did not bring back the GPU state of restored "
                          "process(es) 77 (post-resume: cuCheckpointProcessRestore(pid 77) "
                          "failed: CUDA_ERROR_OUT_OF_MEMORY (2); tried again: "), msg
    assert msg.endswith("tried again: cuCheckpointProcessRestore(pid 77) failed: "
                        "CUDA_ERROR_OPERATING_SYSTEM (304))"), msg
    assert err.value.hint == "restore the checkpoint again once the GPU has the memory free"


def test_an_imported_restore_off_the_gpu_removes_its_container_and_keeps_the_source(
        check, tmp_path, monkeypatch):
    import contextlib

    from gpusnap.gpu.plan import Plan
    from gpusnap.runtime import podman
    from gpusnap.runtime.stream import ImportStream

    _refused_for_good(check)
    ctr = podman.Container(id="c0ffee", name="r2-1", status="running", pid=70, image="img",
                           checkpointed=False, userdata=tmp_path, devices=[])
    removed = []
    monkeypatch.setattr(podman, "restore", lambda *a, **k: None)
    monkeypatch.setattr(podman, "inspect", lambda name: ctr)
    monkeypatch.setattr(podman, "remove", lambda name, force=False: removed.append((name, force)))
    contents = type("C", (), {"json_file": lambda self, n: {"name": "r2-1"}})()
    with pytest.raises(GpusnapError) as err:
        ops_restore.import_archive(contextlib.nullcontext(ImportStream(tmp_path / "fifo")),
                                   contents, Plan([], [], False), "r2-1", False, False, "REF")
    assert removed == [("r2-1", True)]
    assert err.value.message.endswith("; the restored container r2-1 is removed; nothing was "
                                      "restored; REF is unchanged"), err.value.message
    assert "restore it again once the GPU has the memory free" in err.value.hint
    assert [r["event"] for r in journal.read()][-1] == "restore-off-the-gpu"


def test_post_resume_resumes_what_answered_before_it_says_what_did_not(kept, monkeypatch):
    """A process the checkpoint holds GPU memory of that never answers (it exited,
    say) must not keep the others off their GPU."""
    monkeypatch.setenv("GPUSNAP_WAIT_RESUME_SETTLE", "0.2")
    m = manifest(gpu(0, UUID0), used={UUID0: 8 << 30})
    m.processes.append(type(m.processes[0])(pid=101, comm="worker", gpus=[UUID0],
                                            gpu_memory={UUID0: 1 << 30}))
    write_private(step_state.restore(CRIU), json.dumps({MANIFEST_NAME: m.to_json()}))
    monkeypatch.setattr(action, "cuda_processes", lambda pid: TRAIN + [
        ProcessGpuUse(pid=78, comm="worker", maps_libcuda=True)])
    driver = FakeDriver({77: ProcessState.CHECKPOINTED},
                        fail={("state", 78): "CUDA_ERROR_NOT_INITIALIZED"})
    with pytest.raises(GpusnapError, match=r"answers for 1 of the 2 restored ones \(pid 78: "
                       r"CUDA_ERROR_NOT_INITIALIZED\); those stay CHECKPOINTED"):
        action.post_resume(init_pid=70, criu_pid=CRIU, driver=driver)
    assert driver.states[77] == ProcessState.RUNNING
    (rec,) = _resumed()
    assert rec["pids"] == [77] and rec["unanswered"] == {"78": "CUDA_ERROR_NOT_INITIALIZED"}


def test_the_restores_check_waits_for_a_held_turn_then_says_the_process_is_left(
        check, monkeypatch):
    from gpusnap.gpu import turn
    monkeypatch.setattr(gpu_state, "TURN_WAIT_S", 0.2)
    driver = check(FakeDriver({77: ProcessState.CHECKPOINTED}))
    held = turn.try_take(70, "guardian")
    try:
        with pytest.raises(GpusnapError, match=r"restored, but process 77 \(train\) is "
                           "CHECKPOINTED on the GPU") as err:
            restore_check.gpu_report(70)
    finally:
        held.release()
    assert "gpusnap doctor --fix" in err.value.hint and driver.states[77] == ProcessState.CHECKPOINTED
    (left,) = [r for r in journal.read() if r["event"] == "resume-left"]
    assert left["role"] == "guardian" and left["by"] == "restore's check"


def test_a_refusal_that_is_not_for_good_keeps_the_container_and_says_doctor(check):
    check(FakeDriver({77: ProcessState.CHECKPOINTED},
                     fail={("restore", 77): "CUDA_ERROR_ILLEGAL_STATE"}))
    with pytest.raises(GpusnapError) as err:
        restore_check.gpu_report(70)
    assert not isinstance(err.value, restore_check.OffTheGpu)
    assert err.value.message == ("restored, but the driver did not resume process(es) 77 "
                                 "(cuCheckpointProcessRestore(pid 77) failed: "
                                 "CUDA_ERROR_ILLEGAL_STATE (401))")
    assert "gpusnap doctor --fix" in err.value.hint


def test_a_process_post_resume_waited_for_in_vain_is_not_a_success(check):
    journal.record("failed", action="post-resume", init_pid="70", pids=[77],
                   error="the checkpoint holds GPU memory of 1 process(es), but ...")
    check(FakeDriver({}, fail={("state", 77): "CUDA_ERROR_NOT_INITIALIZED"}))
    with pytest.raises(GpusnapError, match="restored, but its post-resume step failed"):
        restore_check.gpu_report(70)


def test_a_helper_without_a_context_does_not_fail_a_restore_the_check_completed(check,
                                                                                monkeypatch):
    """A process that maps libcuda without a context of its own answers
    NOT_INITIALIZED: beside a failed post-resume whose process the check brought
    back, it is no reason to fail the restore."""
    journal.record("failed", action="post-resume", init_pid="70",
                   error="cuCheckpointProcessRestore(pid 77) failed: CUDA_ERROR_INVALID_VALUE (1)")
    monkeypatch.setattr(restore_check, "cuda_processes", lambda pid: TRAIN + [
        ProcessGpuUse(pid=79, comm="helper", maps_libcuda=True)])
    check(FakeDriver({77: ProcessState.CHECKPOINTED}))
    report = restore_check.gpu_report(70)
    assert [(e["pid"], e["state"]) for e in report] == [(77, "RUNNING"), (79, "unknown")]


def test_an_earlier_restores_failure_is_not_this_ones(check, monkeypatch):
    """The journal is searched by init pid, which an earlier restore may have had."""
    import time
    journal.record("failed", action="post-resume", init_pid="70", pids=[77],
                   at=round(time.time() - 3600, 3), error="an hour ago")
    monkeypatch.setattr(restore_check, "age_s", lambda pid: 5.0)
    check(FakeDriver({}, fail={("state", 77): "CUDA_ERROR_NOT_INITIALIZED"}))
    assert restore_check.gpu_report(70)[0]["state"] == "unknown"


def test_a_process_that_exited_is_said_apart_not_left_checkpointed(kept, monkeypatch):
    monkeypatch.setenv("GPUSNAP_WAIT_RESUME_SETTLE", "0.2")
    monkeypatch.setattr(action, "cuda_processes", lambda pid: [])
    action.post_resume(init_pid=70, criu_pid=CRIU, driver=FakeDriver({}))
    (rec,) = [r for r in journal.read() if r["event"] == "resume-short"]
    assert "1 of them gone from the restored tree" in rec["error"]


def test_the_steps_record_names_the_processes_left_for_the_restores_check(kept, monkeypatch):
    monkeypatch.setenv("GPUSNAP_WAIT_RESUME_SETTLE", "0.2")
    monkeypatch.setenv("CRTOOLS_INIT_PID", "70")
    monkeypatch.setenv("CRTOOLS_IMAGE_DIR", "")
    monkeypatch.setattr(action, "cuda_processes", lambda pid: TRAIN)
    driver = FakeDriver({77: ProcessState.CHECKPOINTED},
                        fail={("state", 77): "CUDA_ERROR_NOT_INITIALIZED"})
    assert action._run("post-resume", CRIU, driver=driver) == 1
    (rec,) = [r for r in journal.read() if r["event"] == "failed"]
    assert rec["action"] == "post-resume" and rec["pids"] == [77] and rec["init_pid"] == "70"


def test_a_restore_whose_processes_run_reads_no_journal(check, monkeypatch):
    """The journal grows until the host reboots: a replica's check reads it only
    where a process is not running."""
    check(FakeDriver({77: ProcessState.RUNNING}))
    monkeypatch.setattr(journal, "read", lambda *a, **k: pytest.fail("journal read"))
    assert restore_check.gpu_report(70) == [{"pid": 77, "comm": "train", "state": "RUNNING"}]
