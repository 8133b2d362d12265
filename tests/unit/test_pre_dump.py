"""The action script's pre-dump (action/action_dump.py, through action._run) at
its edges: what it leaves when it fails, and what it finds left by others.
The real path runs on a GPU (tests/gpu/); here the driver is faked."""

from __future__ import annotations

import errno

import pytest

from gpusnap import journal
from gpusnap.action import action, action_dump
from gpusnap.gpu.cuda import ProcessState
from gpusnap.procs import ProcessGpuUse
from tests.unit.fakes import UUID0, FakeDriver, gpu, inventory

R, C = ProcessState.RUNNING, ProcessState.CHECKPOINTED
INIT, CRIU = 700, 9999


@pytest.fixture
def images(tmp_path, monkeypatch):
    """CRIU's images folder of a dump of the container whose init (700) is its
    one CUDA process, on GPU 0, as the action script's environment names it."""
    monkeypatch.setenv("GPUSNAP_STATE_DIR", str(tmp_path / "state"))
    folder = tmp_path / "images"
    folder.mkdir()
    monkeypatch.setenv("CRTOOLS_INIT_PID", str(INIT))
    monkeypatch.setenv("CRTOOLS_IMAGE_DIR", str(folder))
    return folder


def _on_gpu0(monkeypatch, state: ProcessState = R) -> FakeDriver:
    process = ProcessGpuUse(pid=INIT, comm="python3", maps_libcuda=True)
    monkeypatch.setattr(action_dump, "cuda_processes", lambda pid: [process])
    monkeypatch.setattr(action_dump, "read_inventory", lambda *a: inventory(gpu(0, UUID0)))
    monkeypatch.setattr(action_dump, "cuda_plugin_path", lambda: None)
    monkeypatch.setattr(action_dump, "criu_version", lambda: "4.2.1")
    monkeypatch.setattr(action_dump, "refuse_unmanaged", lambda driver, procs: None)
    driver = FakeDriver({INIT: state})
    monkeypatch.setattr(action_dump, "require_driver", lambda: driver)
    return driver


def _failed() -> dict:
    return [e for e in journal.read() if e.get("event") == "failed"][-1]


# --- an OSError is one line, and leaves the container as it was ----------------------------

def test_a_full_disk_in_pre_dump_is_one_line_and_a_refusal(images, monkeypatch, capsys):
    """A folder pre-dump cannot write (disk full, read-only, gone) fails the
    dump in the words of the script's other failures, never a traceback; the
    guardian started before it gives the GPU back once CRIU stops."""
    _on_gpu0(monkeypatch)
    monkeypatch.setattr(action_dump, "_start_guardian", lambda *a, **k: None)

    def full(manifest, folder):
        raise OSError(errno.ENOSPC, "No space left on device", f"{folder}/gpu-manifest.json")
    monkeypatch.setattr(action_dump.gpu_manifest, "write", full)
    assert action._run("pre-dump", CRIU) == 1
    said = capsys.readouterr().err.splitlines()
    assert said == [f"gpusnap: pre-dump: could not prepare the dump: No space left on device "
                    f"({images}/gpu-manifest.json); nothing was dumped (fix the cause it names, "
                    "then checkpoint again; `gpusnap doctor` checks the host)"], said
    failed = _failed()
    assert failed["refused"] and failed["init_pid"] == str(INIT)
    assert failed["error"].startswith("could not prepare the dump: No space left on device")


def test_a_guardian_that_cannot_start_gives_the_gpu_back_before_pre_dump_fails(
        images, monkeypatch, capsys):
    """Quiesced, and then no guardian (no memory, no process slot): CRIU stops
    the dump, and nothing else would bring the process back from CHECKPOINTED."""
    driver = _on_gpu0(monkeypatch)

    def no_fork(*a, **k):
        raise OSError(errno.EAGAIN, "Resource temporarily unavailable")
    monkeypatch.setattr(action_dump.subprocess, "Popen", no_fork)
    assert action._run("pre-dump", CRIU) == 1
    assert driver.states == {INIT: R}
    assert ("checkpoint", INIT) in driver.calls and ("unlock", INIT) in driver.calls
    assert capsys.readouterr().err.startswith(
        "gpusnap: pre-dump: could not prepare the dump: Resource temporarily unavailable;")
