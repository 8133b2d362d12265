"""ops/containerd_gpu.py and its other ends: gpusnap's containerd client
quiesces a task's GPU before it pauses the task, the action script then
writes the manifest built before the quiesce, and the GPUs come back after
the dump whatever its outcome. The real path runs on a GPU
(tests/gpu/test_gpu_shim.py); these are its edges, with a fake driver."""

from __future__ import annotations

import json
import os
import time
from types import SimpleNamespace

import pytest

from gpusnap import journal, requests
from gpusnap.action import action_dump
from gpusnap.errors import GpusnapError
from gpusnap.gpu.cuda import ProcessState
from gpusnap.gpu import manifest as gpu_manifest
from gpusnap.gpu import turn as turns
from gpusnap.gpu.manifest import MANIFEST_NAME
from gpusnap.ops import containerd_gpu
from gpusnap.ops.containerd_api import ContainerdError
from gpusnap.procs import ProcessGpuUse
from gpusnap.shim import checkpoint as shim_checkpoint
from gpusnap.waits import WaitExpired
from tests.unit import turn_holder
from tests.unit.fakes import UUID0, FakeDriver, gpu, inventory

R, C = ProcessState.RUNNING, ProcessState.CHECKPOINTED
INIT = 700


class FakeGuardian:
    def __init__(self) -> None:
        self.killed = False

    def kill(self) -> None:
        self.killed = True

    def wait(self) -> int:
        return -9


def _use(pid: int, holds: bool = True) -> ProcessGpuUse:
    return ProcessGpuUse(pid=pid, comm="python3", gpu_minors=[0] if holds else [],
                         opens_nvidia=holds, maps_libcuda=True, maps_nvidia=holds)


@pytest.fixture
def host(tmp_path, monkeypatch):
    """A task whose init (700) and worker (701) use GPU 0, the driver faked;
    ``born`` holds each pid's start time (a pid missing from it is gone)."""
    monkeypatch.setenv("GPUSNAP_STATE_DIR", str(tmp_path / "state"))
    driver = FakeDriver({INIT: R, INIT + 1: R})
    guardians: list[FakeGuardian] = []
    born = {INIT: 1000, INIT + 1: 1001}
    frozen: set[int] = set()
    monkeypatch.setattr(containerd_gpu, "cuda_processes", lambda pid: [_use(INIT), _use(INIT + 1)])
    monkeypatch.setattr(containerd_gpu, "read_inventory", lambda *a: inventory(gpu(0, UUID0)))
    monkeypatch.setattr(containerd_gpu, "require_driver", lambda: driver)
    monkeypatch.setattr(containerd_gpu, "cuda_plugin_path", lambda: None)
    monkeypatch.setattr(containerd_gpu, "criu_version", lambda: "4.2.1")
    monkeypatch.setattr(containerd_gpu, "start_time", born.get)
    monkeypatch.setattr(requests, "start_time", born.get)
    monkeypatch.setattr(containerd_gpu, "is_frozen", lambda pid: pid in frozen)


    def guardian(q):  # holds the turn on, as the real one does
        q.turn.hand_over()
        guardians.append(FakeGuardian())
        return guardians[-1]
    monkeypatch.setattr(containerd_gpu, "_guardian", guardian)
    return driver, guardians, born, frozen


def test_the_gpu_is_quiesced_before_the_block_and_given_back_after(host):
    driver, guardians, _, _ = host
    with containerd_gpu.quiesced_first(INIT) as q:
        assert driver.states == {INIT: C, INIT + 1: C}  # before the client's pause
        q.ask()
        request = requests.bound(INIT, requests.QUIESCED)
        assert request["pids"] == [INIT, INIT + 1] == q.pids and request["started"] == 1000
        assert [g["uuid"] for g in request["manifest"]["gpus"]] == [UUID0]  # built while held
        assert requests.bound(INIT, requests.QUIESCED, consume=True)  # as pre-dump takes it
        q.seen()
        assert not guardians[0].killed
    assert driver.states == {INIT: R, INIT + 1: R}
    assert requests.peek(INIT, requests.QUIESCED) == {}
    assert guardians[0].killed  # its job is done
    assert turns.try_take(INIT, "test") is not None  # and the next checkpoint's turn has come


def test_a_task_without_cuda_processes_is_left_to_the_usual_path(host, monkeypatch):
    driver, guardians, _, _ = host
    monkeypatch.setattr(containerd_gpu, "cuda_processes", lambda pid: [])
    with containerd_gpu.quiesced_first(INIT) as q:
        assert q is None and requests.peek(INIT, requests.QUIESCED) == {}
        turn = turns.try_take(INIT, "test")  # pre-dump, asked nothing, takes the turn itself
        assert turn is not None
        turn.release()
    assert driver.calls == [] and guardians == []


def test_a_failed_dump_gives_the_gpu_back_and_says_its_own_error(host):
    driver, guardians, _, _ = host
    with pytest.raises(ContainerdError, match="criu failed"):
        with containerd_gpu.quiesced_first(INIT) as q:
            q.ask()
            raise ContainerdError("criu failed")
    assert driver.states == {INIT: R, INIT + 1: R} and guardians[0].killed
    assert requests.peek(INIT, requests.QUIESCED) == {}


def test_processes_the_dump_stopped_are_not_given_back_nor_their_pids_reused(host):
    driver, guardians, born, _ = host
    with containerd_gpu.quiesced_first(INIT):
        del born[INIT]  # exit_after: CRIU killed them
        born[INIT + 1] = 5000  # and another process has the pid now
        driver.states[INIT + 1] = C  # mid-checkpoint of its own
    assert driver.called("restore") == [] and guardians[0].killed
    assert driver.states[INIT + 1] == C


def test_a_gpu_that_cannot_be_given_back_is_said_and_the_guardian_stays(host):
    driver, guardians, _, _ = host
    driver.fail[("restore", INIT + 1)] = "CUDA_ERROR_OUT_OF_MEMORY"
    with pytest.raises(ContainerdError) as err:
        with containerd_gpu.quiesced_first(INIT):
            pass
    assert "checkpointed but its GPU could not be given back" in str(err.value)
    assert "gpusnap doctor --fix" in str(err.value)
    assert not guardians[0].killed  # it tries again once this process is gone


def test_a_lock_that_fails_leaves_the_task_running_and_no_request(host):
    driver, guardians, _, _ = host
    driver.fail[("lock", INIT + 1)] = "CUDA_ERROR_TIMEOUT"
    with pytest.raises(ContainerdError, match="GPU quiesce failed: lock failed"):
        with containerd_gpu.quiesced_first(INIT):
            pytest.fail("the block runs only once the GPU is quiesced")
    assert driver.states == {INIT: R, INIT + 1: R} and guardians == []
    assert requests.peek(INIT, requests.QUIESCED) == {}


def test_a_forked_child_is_refused_before_the_gpu_is_touched(host):
    driver, _, _, _ = host
    driver.fail[("state", INIT + 1)] = "CUDA_ERROR_NOT_INITIALIZED"
    with pytest.raises(GpusnapError, match="forked from a CUDA process"):
        with containerd_gpu.quiesced_first(INIT):
            pytest.fail("refused first")
    assert driver.called("lock") == []


def test_a_failure_right_after_the_quiesce_gives_the_gpu_back(host, monkeypatch):
    driver, _, _, _ = host

    def no_guardian(q):
        raise OSError("fork failed")
    monkeypatch.setattr(containerd_gpu, "_guardian", no_guardian)
    with pytest.raises(OSError, match="fork failed"):
        with containerd_gpu.quiesced_first(INIT):
            pytest.fail("the block never runs")
    assert driver.states == {INIT: R, INIT + 1: R}


def test_a_task_still_paused_is_left_to_the_guardian_not_restored_under_its_freeze(host):
    driver, guardians, _, frozen = host
    with pytest.raises(ContainerdError, match="stayed paused after its checkpoint"):
        with containerd_gpu.quiesced_first(INIT):
            frozen.update({INIT, INIT + 1})  # the client's Resume failed
    assert driver.called("restore") == [] and not guardians[0].killed


@pytest.mark.parametrize("exit_after", [False, True])
def test_a_request_pre_dump_never_took_is_said(host, exit_after):
    _, _, born, _ = host
    with pytest.raises(ContainerdError, match="did not see gpusnap's quiesce"):
        with containerd_gpu.quiesced_first(INIT) as q:
            q.ask()
            if exit_after:  # the dump stopped the task: its init is gone
                born.clear()
            q.seen()
    assert requests.peek(INIT, requests.QUIESCED) == {}


def test_a_request_left_for_an_earlier_process_of_the_same_pid_is_dropped(host):
    _, _, born, _ = host
    requests.put_bound(INIT, requests.QUIESCED, manifest={"gpus": []}, pids=[INIT])
    born[INIT] = 2000  # the client died; a new process has the pid
    assert requests.bound(INIT, requests.QUIESCED) == {} and requests.peek(INIT, requests.QUIESCED) == {}


def test_the_shim_thaws_a_paused_cuda_task_unless_the_client_quiesced_it(host, monkeypatch):
    _, _, born, _ = host
    monkeypatch.setattr(shim_checkpoint, "cuda_processes", lambda pid: [_use(pid)])
    assert shim_checkpoint.thaw_for_the_driver("paused", INIT)
    assert not shim_checkpoint.thaw_for_the_driver("running", INIT)
    requests.put_bound(INIT, requests.QUIESCED, manifest={"gpus": []}, pids=[INIT])
    assert not shim_checkpoint.thaw_for_the_driver("paused", INIT)
    born[INIT] = 2000  # that request was another process's
    assert shim_checkpoint.thaw_for_the_driver("paused", INIT)


# --- the action script's pre-dump, after the client quiesced ---------------------------------

def _manifest() -> dict:
    built = gpu_manifest.build([_use(INIT)], inventory(gpu(0, UUID0)), "4.2.1", "gpusnap")
    return json.loads(built.to_json())


def test_pre_dump_writes_the_manifest_the_client_built_and_quiesces_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUSNAP_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setattr(requests, "start_time", lambda pid: 1000)
    requests.put_bound(INIT, requests.QUIESCED, manifest=_manifest(), pids=[INIT])
    checkpointed = ProcessGpuUse(pid=INIT, comm="python3", maps_libcuda=True)  # no fds, no maps
    monkeypatch.setattr(action_dump, "cuda_processes", lambda pid: [checkpointed])
    monkeypatch.setattr(action_dump, "require_driver",
                        lambda: pytest.fail("the client quiesced: no driver call here"))
    images = tmp_path / "images"
    images.mkdir()
    action_dump.pre_dump(INIT, str(images), 9999)
    written = json.loads((images / MANIFEST_NAME).read_text())
    assert written["gpus"][0]["uuid"] == UUID0 and written["processes"][0]["pid"] == INIT
    assert journal.read()[-1]["event"] == "gpu-manifest-written"
    assert requests.bound(INIT, requests.QUIESCED) == {}  # taken: the client knows it was seen


def test_a_dump_into_a_kept_folder_carries_neither_its_old_manifest_nor_a_restores_plan(
        tmp_path, monkeypatch):
    # Podman dumps again into a checkpoint folder it kept (restore --keep): a
    # container without GPU processes now must not export the old GPU manifest,
    # nor any dump the plan an earlier `gpusnap restore` left beside it.
    from gpusnap import PLAN_NAME

    monkeypatch.setenv("GPUSNAP_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setattr(requests, "start_time", lambda pid: 1000)
    monkeypatch.setattr(action_dump, "cuda_processes", lambda pid: [])
    images = tmp_path / "images"
    images.mkdir()
    (images / MANIFEST_NAME).write_text(json.dumps(_manifest()))
    (images / PLAN_NAME).write_text('{"moves": []}')
    action_dump.pre_dump(INIT, str(images), 9999)
    assert not (images / MANIFEST_NAME).exists() and not (images / PLAN_NAME).exists()


def test_pre_dump_refuses_a_process_that_took_the_gpu_after_the_client_quiesced(tmp_path,
                                                                               monkeypatch):
    monkeypatch.setenv("GPUSNAP_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setattr(requests, "start_time", lambda pid: 1000)
    requests.put_bound(INIT, requests.QUIESCED, manifest=_manifest(), pids=[INIT])
    monkeypatch.setattr(action_dump, "cuda_processes", lambda pid: [
        ProcessGpuUse(pid=INIT, comm="python3", maps_libcuda=True), _use(705)])
    images = tmp_path / "images"
    images.mkdir()
    with pytest.raises(GpusnapError) as err:
        action_dump.pre_dump(INIT, str(images), 9999)
    assert err.value.message.startswith("process 705 (python3) took the GPU after gpusnap had "
                                        "quiesced"), err.value.message
    assert err.value.hint == "checkpoint again" and not (images / MANIFEST_NAME).exists()


# --- one at a time: a checkpoint waits for the guardian of the last one (gpu/turn.py) -------

@pytest.fixture
def guardian_at_work(monkeypatch):
    """A process holding the task's turn, as a guardian still giving back the
    GPUs of the last checkpoint does; the wait for it bounded at 0.3 s."""
    monkeypatch.setenv("GPUSNAP_WAIT_GPU_TURN", "0.3")
    with turn_holder.holding(INIT) as holder:
        yield holder


def test_a_checkpoint_waits_for_the_guardian_of_the_last_one_and_touches_nothing(
        host, guardian_at_work):
    driver, guardians, _, _ = host
    with pytest.raises(WaitExpired, match=f"gpusnap's guardian \\(pid {guardian_at_work.pid}\\) "
                                          "still holds the container's GPUs"):
        with containerd_gpu.quiesced_first(INIT):
            pytest.fail("nothing runs before the last guardian is done")
    assert driver.calls == [] and guardians == []


def test_pre_dump_waits_for_the_guardian_of_the_last_checkpoint(host, guardian_at_work,
                                                                monkeypatch):
    monkeypatch.setattr(action_dump, "cuda_processes",
                        lambda pid: pytest.fail("nothing is read before the turn"))
    with pytest.raises(WaitExpired, match="pre-dump of the container whose init is pid 700"):
        action_dump.pre_dump(INIT, "", 9999)


def test_pre_dump_inside_the_clients_quiesce_does_not_wait_for_the_clients_turn(
        host, tmp_path, monkeypatch):
    monkeypatch.setenv("GPUSNAP_WAIT_GPU_TURN", "0.3")
    monkeypatch.setattr(action_dump, "cuda_processes", lambda pid: [
        ProcessGpuUse(pid=INIT, comm="python3", maps_libcuda=True)])
    images = tmp_path / "images"
    images.mkdir()
    with containerd_gpu.quiesced_first(INIT) as q:
        q.ask()
        action_dump.pre_dump(INIT, str(images), 9999)
        q.seen()
        assert turns.try_take(INIT, "test") is None  # still the client's
    assert (images / MANIFEST_NAME).exists()


@pytest.fixture
def held_guardian(host, monkeypatch):
    """An earlier try's guardian waiting for the client's Resume ("guardian-held")."""
    monkeypatch.setenv("GPUSNAP_WAIT_GPU_TURN", "0.3")
    with turn_holder.holding(INIT, "guardian-held") as holder:
        yield holder


def _pre_dump_on_gpu0(monkeypatch, state: ProcessState) -> FakeDriver:
    """pre-dump's view of a task whose init is its one CUDA process, on GPU 0,
    in ``state`` for the faked driver (returned)."""
    process = ProcessGpuUse(pid=INIT, comm="python3", maps_libcuda=True)
    monkeypatch.setattr(action_dump, "cuda_processes", lambda pid: [process])
    monkeypatch.setattr(action_dump, "read_inventory", lambda *a: inventory(gpu(0, UUID0)))
    monkeypatch.setattr(action_dump, "cuda_plugin_path", lambda: None)
    monkeypatch.setattr(action_dump, "criu_version", lambda: "4.2.1")
    driver = FakeDriver({INIT: state})
    monkeypatch.setattr(action_dump, "require_driver", lambda: driver)
    return driver


def test_pre_dump_of_a_task_the_shim_holds_does_not_wait_for_its_earlier_trys_guardian(
        host, held_guardian, monkeypatch, tmp_path):
    """CRIU could not seize the task on the shim's first try: that try's
    guardian holds the turn until the client's Resume, which the shim refuses
    during the dump. The next try's pre-dump goes on: the processes are still
    checkpointed, and that guardian gives them back after the Resume."""
    requests.put_bound(INIT, requests.HELD)
    driver = _pre_dump_on_gpu0(monkeypatch, C)
    monkeypatch.setattr(action_dump.subprocess, "Popen",
                        lambda *a, **k: pytest.fail("nothing changed: no second guardian"))
    images = tmp_path / "images"
    images.mkdir()
    action_dump.pre_dump(INIT, str(images), 9999)
    assert (images / MANIFEST_NAME).exists()
    assert set(driver.calls) == {("state", INIT)}  # read, not changed
    assert driver.states == {INIT: C} and turns.try_take(INIT, "test") is None
    assert journal.read()[-1]["turn_waited_s"] is None
    assert journal.read()[-1]["guardian"] is False  # nothing for a checkpoint -R to wait for


def test_pre_dump_journals_the_gpu_free_once_the_quiesce_returned(host, monkeypatch, tmp_path):
    """``quiesced``'s ``at`` (the GPU free for the next job: bench/gpu_scale.py,
    `migrate --detach`) is when the driver's checkpoint returned, not when
    pre-dump was done: the read-ahead and the manifest come after it, seconds
    at 32 GiB."""
    driver = _pre_dump_on_gpu0(monkeypatch, R)
    monkeypatch.setattr(action_dump, "refuse_unmanaged", lambda driver, procs: None)
    monkeypatch.setattr(action_dump, "_start_guardian", lambda *a, **k: None)
    writing = []
    write = gpu_manifest.write

    def slow_write(manifest, folder):
        writing.append(time.time())
        time.sleep(0.5)
        write(manifest, folder)
    monkeypatch.setattr(action_dump.gpu_manifest, "write", slow_write)
    images = tmp_path / "images"
    images.mkdir()
    action_dump.pre_dump(INIT, str(images), 9999)
    quiesced = journal.read()[-1]
    assert quiesced["event"] == "quiesced" and driver.states == {INIT: C}
    assert quiesced["at"] <= writing[0] + 0.001, (quiesced["at"], writing)


def test_pre_dump_journals_whether_a_guardian_gives_the_gpus_back(host, monkeypatch, tmp_path):
    """`gpusnap checkpoint --leave-running` waits for that guardian's verdict
    (ops/gpu_back.py): one that never said it is a guardian gone, not none."""
    _pre_dump_on_gpu0(monkeypatch, R)
    monkeypatch.setattr(action_dump, "refuse_unmanaged", lambda driver, procs: None)
    started = []
    monkeypatch.setattr(action_dump, "_start_guardian",
                        lambda *a, **k: started.append(a) or object())
    images = tmp_path / "images"
    images.mkdir()
    action_dump.pre_dump(INIT, str(images), 9999)
    quiesced = journal.read()[-1]
    assert started and quiesced["event"] == "quiesced" and quiesced["guardian"] is True


def test_the_clients_real_guardian_holds_the_turn_it_was_handed(host, monkeypatch):
    """containerd_gpu._guardian as it runs (pass_fds, --turn-fd): the guardian
    names itself the holder, and its end lets go."""
    state = os.environ["GPUSNAP_STATE_DIR"]  # the test's own, not the host's
    monkeypatch.undo()  # the real _guardian, over the host fixture's fakes
    monkeypatch.setenv("GPUSNAP_STATE_DIR", state)
    turn = turns.try_take(INIT, "containerd client")
    q = containerd_gpu.Quiesced(INIT, {INIT + 1: None}, FakeDriver({}), {}, turn=turn)
    q.guardian = containerd_gpu._guardian(q)
    try:
        assert turn.handed
        deadline = time.monotonic() + 10
        while turns.holder(INIT) != (q.guardian.pid, "guardian"):
            assert time.monotonic() < deadline, turns.holder(INIT)
            time.sleep(0.02)
        turn.close()  # the client is gone: the guardian holds on
        assert turns.try_take(INIT, "test") is None
    finally:
        q.guardian.kill()
        q.guardian.wait(timeout=10)
    after = turns.try_take(INIT, "test")
    assert after is not None
    after.release()


@pytest.mark.parametrize("role", ["guardian", "freeze"])
def test_pre_dump_of_a_held_task_waits_for_any_other_holder(host, monkeypatch, role):
    """A guardian mid-resume (not waiting for the client) or a freeze would
    change the processes under the dump: HELD or not, pre-dump waits for them."""
    monkeypatch.setenv("GPUSNAP_WAIT_GPU_TURN", "0.3")
    requests.put_bound(INIT, requests.HELD)
    monkeypatch.setattr(action_dump, "cuda_processes",
                        lambda pid: pytest.fail("nothing is read before the turn"))
    with turn_holder.holding(INIT, role):
        with pytest.raises(WaitExpired):
            action_dump.pre_dump(INIT, "", 9999)


def test_a_held_mark_whose_shim_died_is_no_hold(host):
    _, _, born, _ = host
    born[4321] = 777  # the shim that wrote it
    requests.put_bound(INIT, requests.HELD, holder=4321, holder_started=777)
    assert requests.held(INIT)
    del born[4321]  # that shim is gone: no Resume will ever drop it
    assert not requests.held(INIT) and requests.peek(INIT, requests.HELD) == {}


def test_a_restore_reads_the_image_manifest_of_this_hosts_architecture(monkeypatch):
    # on an arm64 host (GH200) containerd pulled the arm64 layers: the amd64
    # manifest's would name a snapshot that is not there
    from gpusnap.ops import containerd_checkpoint as cc
    blobs = {"sha256:index": {"manifests": [
        {"digest": "sha256:amd", "platform": {"os": "linux", "architecture": "amd64"}},
        {"digest": "sha256:arm", "platform": {"os": "linux", "architecture": "arm64"}}]},
        "sha256:amd": {"config": {"digest": "sha256:amdcfg"}},
        "sha256:arm": {"config": {"digest": "sha256:armcfg"}},
        "sha256:amdcfg": {"rootfs": {"diff_ids": ["sha256:" + "a" * 64]}},
        "sha256:armcfg": {"rootfs": {"diff_ids": ["sha256:" + "b" * 64]}}}
    target = SimpleNamespace(digest="sha256:index", media_type=cc._INDEX_TYPES[0])
    client = SimpleNamespace(call=lambda *a, **k: SimpleNamespace(image=SimpleNamespace(target=target)),
                             namespace="default")
    monkeypatch.setattr(cc, "_json_blob", lambda c, digest: blobs[digest])
    monkeypatch.setattr(cc, "host_arch", lambda: "arm64")
    assert cc._image_chain_id(client, "img") == "sha256:" + "b" * 64
