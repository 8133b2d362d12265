"""ops/containerd_gpu.py and its other ends: gpusnap's containerd client
quiesces a task's GPU before it pauses the task, the action script then
writes the manifest built before the quiesce, and the GPUs come back after
the dump whatever its outcome. The real path runs on a GPU
(tests/gpu/test_gpu_shim.py); these are its edges, with a fake driver."""

from __future__ import annotations

import json

import pytest

from gpusnap import journal, requests
from gpusnap.action import action_dump
from gpusnap.errors import GpusnapError
from gpusnap.gpu.cuda import ProcessState
from gpusnap.gpu import manifest as gpu_manifest
from gpusnap.gpu.manifest import MANIFEST_NAME
from gpusnap.ops import containerd_gpu
from gpusnap.ops.containerd_api import ContainerdError
from gpusnap.procs import ProcessGpuUse
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
    """A task whose init (700) and worker (701) use GPU 0, the driver faked."""
    monkeypatch.setenv("GPUSNAP_STATE_DIR", str(tmp_path / "state"))
    driver = FakeDriver({INIT: R, INIT + 1: R})
    guardians: list[FakeGuardian] = []
    gone: set[int] = set()
    monkeypatch.setattr(containerd_gpu, "cuda_processes", lambda pid: [_use(INIT), _use(INIT + 1)])
    monkeypatch.setattr(containerd_gpu, "read_inventory", lambda: inventory(gpu(0, UUID0)))
    monkeypatch.setattr(containerd_gpu, "require_driver", lambda: driver)
    monkeypatch.setattr(containerd_gpu, "cuda_plugin_path", lambda: None)
    monkeypatch.setattr(containerd_gpu, "criu_version", lambda: "4.2.1")
    monkeypatch.setattr(containerd_gpu, "alive", lambda pid: pid not in gone)
    monkeypatch.setattr(containerd_gpu, "_guardian",
                        lambda pids: guardians.append(FakeGuardian()) or guardians[-1])
    return driver, guardians, gone


def test_the_gpu_is_quiesced_before_the_block_and_given_back_after(host):
    driver, guardians, _ = host
    with containerd_gpu.quiesced_first(INIT) as q:
        assert driver.states == {INIT: C, INIT + 1: C}  # before the client's pause
        request = requests.peek(INIT, requests.QUIESCED)
        assert request["pids"] == [INIT, INIT + 1] == q.pids
        assert [g["uuid"] for g in request["manifest"]["gpus"]] == [UUID0]  # built while held
        assert not guardians[0].killed
    assert driver.states == {INIT: R, INIT + 1: R}
    assert requests.peek(INIT, requests.QUIESCED) == {}
    assert guardians[0].killed  # its job is done


def test_a_task_without_cuda_processes_is_left_to_the_usual_path(host, monkeypatch):
    driver, guardians, _ = host
    monkeypatch.setattr(containerd_gpu, "cuda_processes", lambda pid: [])
    with containerd_gpu.quiesced_first(INIT) as q:
        assert q is None and requests.peek(INIT, requests.QUIESCED) == {}
    assert driver.calls == [] and guardians == []


def test_a_failed_dump_gives_the_gpu_back_and_says_its_own_error(host):
    driver, guardians, _ = host
    with pytest.raises(ContainerdError, match="criu failed"):
        with containerd_gpu.quiesced_first(INIT):
            raise ContainerdError("criu failed")
    assert driver.states == {INIT: R, INIT + 1: R} and guardians[0].killed
    assert requests.peek(INIT, requests.QUIESCED) == {}


def test_processes_the_dump_stopped_are_not_given_back(host):
    driver, guardians, gone = host
    with containerd_gpu.quiesced_first(INIT):
        gone.update({INIT, INIT + 1})  # exit_after: CRIU killed them
    assert driver.called("restore") == [] and guardians[0].killed


def test_a_gpu_that_cannot_be_given_back_is_said_and_the_guardian_stays(host):
    driver, guardians, _ = host
    driver.fail[("restore", INIT + 1)] = "CUDA_ERROR_OUT_OF_MEMORY"
    with pytest.raises(ContainerdError) as err:
        with containerd_gpu.quiesced_first(INIT):
            pass
    assert "checkpointed but its GPU could not be given back" in str(err.value)
    assert "gpusnap doctor --fix" in str(err.value)
    assert not guardians[0].killed  # it tries again once this process is gone


def test_a_lock_that_fails_leaves_the_task_running_and_no_request(host):
    driver, guardians, _ = host
    driver.fail[("lock", INIT + 1)] = "CUDA_ERROR_TIMEOUT"
    with pytest.raises(ContainerdError, match="GPU quiesce failed: lock failed"):
        with containerd_gpu.quiesced_first(INIT):
            pytest.fail("the block runs only once the GPU is quiesced")
    assert driver.states == {INIT: R, INIT + 1: R} and guardians == []
    assert requests.peek(INIT, requests.QUIESCED) == {}


def test_a_forked_child_is_refused_before_the_gpu_is_touched(host):
    driver, _, _ = host
    driver.fail[("state", INIT + 1)] = "CUDA_ERROR_NOT_INITIALIZED"
    with pytest.raises(GpusnapError, match="forked from a CUDA process"):
        with containerd_gpu.quiesced_first(INIT):
            pytest.fail("refused first")
    assert driver.called("lock") == []


# --- the action script's pre-dump, after the client quiesced ---------------------------------

def _manifest() -> dict:
    built = gpu_manifest.build([_use(INIT)], inventory(gpu(0, UUID0)), "4.2.1", "gpusnap")
    return json.loads(built.to_json())


def test_pre_dump_writes_the_manifest_the_client_built_and_quiesces_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUSNAP_STATE_DIR", str(tmp_path / "state"))
    requests.put(INIT, requests.QUIESCED, manifest=_manifest(), pids=[INIT])
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


def test_pre_dump_refuses_a_process_that_took_the_gpu_after_the_client_quiesced(tmp_path,
                                                                               monkeypatch):
    monkeypatch.setenv("GPUSNAP_STATE_DIR", str(tmp_path / "state"))
    requests.put(INIT, requests.QUIESCED, manifest=_manifest(), pids=[INIT])
    monkeypatch.setattr(action_dump, "cuda_processes", lambda pid: [
        ProcessGpuUse(pid=INIT, comm="python3", maps_libcuda=True), _use(705)])
    images = tmp_path / "images"
    images.mkdir()
    with pytest.raises(GpusnapError) as err:
        action_dump.pre_dump(INIT, str(images), 9999)
    assert err.value.message.startswith("process 705 (python3) took the GPU after gpusnap had "
                                        "quiesced"), err.value.message
    assert err.value.hint == "checkpoint again" and not (images / MANIFEST_NAME).exists()
