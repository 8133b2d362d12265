"""The action script's pre-dump (action/action_dump.py, through action._run) at
its edges: what it leaves when it fails, and what it finds left by others.
The real path runs on a GPU (tests/gpu/); here the driver is faked."""

from __future__ import annotations

import errno
import json

import pytest

from gpusnap import MANIFEST_NAME, PLAN_NAME, journal
from gpusnap.action import action, action_dump
from gpusnap.gpu import staging
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


# --- an earlier checkpoint in the folder stays whole until the dump goes on -----------------

@pytest.fixture
def kept_folder(tmp_path, monkeypatch):
    """Podman's checkpoint folder of a running container, kept from an earlier
    GPU dump (--keep): its manifest, a restore's plan, its staging record, a
    pages link a restore left, and a copy kept aside sharing its files
    (runtime/kept_checkpoint.py)."""
    from gpusnap.runtime import kept_checkpoint

    monkeypatch.setenv("GPUSNAP_STATE_DIR", str(tmp_path / "state"))
    userdata = tmp_path / "storage/overlay-containers/c0ffee/userdata"
    folder = userdata / "checkpoint"
    folder.mkdir(parents=True)
    (userdata / "config.json").write_text("{}")
    (folder / "inventory.img").write_bytes(b"inv")
    (folder / MANIFEST_NAME).write_text('{"earlier": true}')
    (folder / PLAN_NAME).write_text('{"moves": []}')
    staging.record(folder, {(INIT, 1): [(0x1000, 0x2000)]})
    (folder / "pages-1.img").symlink_to(tmp_path / ".gpusnap-pull-x" / "pages-1.img")
    assert kept_checkpoint.keep_aside(folder, "refused") is not None
    monkeypatch.setenv("CRTOOLS_INIT_PID", str(INIT))
    monkeypatch.setenv("CRTOOLS_IMAGE_DIR", str(folder))
    return folder


def _earlier_left(folder) -> list[str]:
    """What of the earlier dump is still there."""
    from gpusnap.runtime import kept_checkpoint

    left = [n for n in (PLAN_NAME, staging.NAME) if (folder / n).exists()]
    left += ["pages link"] if (folder / "pages-1.img").is_symlink() else []
    if (folder / MANIFEST_NAME).exists() and "earlier" in (folder / MANIFEST_NAME).read_text():
        left.append(MANIFEST_NAME)
    return left + (["kept copy"] if kept_checkpoint.why_kept(folder.parent) else [])


def _refused_by(how: str, monkeypatch) -> None:
    from gpusnap import requests
    from gpusnap.errors import GpusnapError
    from gpusnap.gpu import manifest as gpu_manifest

    if how == "late GPU user":  # the containerd client quiesced; a process took the GPU since
        monkeypatch.setattr(requests, "start_time", lambda pid: 1000)
        built = gpu_manifest.build([ProcessGpuUse(pid=INIT, comm="python3")],
                                   inventory(gpu(0, UUID0)), "4.2.1", "gpusnap")
        requests.put_bound(INIT, requests.QUIESCED, manifest=json.loads(built.to_json()),
                           pids=[INIT])
        monkeypatch.setattr(action_dump, "cuda_processes", lambda pid: [ProcessGpuUse(
            pid=705, comm="python3", gpu_minors=[0], opens_nvidia=True, maps_nvidia=True)])
        return
    driver = _on_gpu0(monkeypatch)
    if how == "unsupported":
        def refuse(procs, inventory):
            raise GpusnapError("the driver cannot checkpoint this GPU")
        monkeypatch.setattr(action_dump, "refuse_unsupported", refuse)
    else:  # the driver's lock times out: quiesce rolls back
        driver.fail[("lock", INIT)] = "CUDA_ERROR_TIMEOUT"


@pytest.mark.parametrize("how", ["unsupported", "lock timeout", "late GPU user"])
def test_a_refused_dump_leaves_the_earlier_checkpoint_in_the_folder_whole(kept_folder, how,
                                                                         monkeypatch):
    """pre-dump said no, so CRIU writes nothing: the earlier checkpoint Podman
    kept, and the copy kept aside (maybe the only way back), must stay as they
    were; before, they went as pre-dump started."""
    _refused_by(how, monkeypatch)
    assert action._run("pre-dump", CRIU) == 1
    assert _failed()["init_pid"] == str(INIT)
    assert sorted(_earlier_left(kept_folder)) == sorted(
        [PLAN_NAME, staging.NAME, MANIFEST_NAME, "pages link", "kept copy"])


@pytest.mark.parametrize("cuda", [True, False], ids=["GPU", "CPU"])
def test_a_dump_that_goes_on_leaves_nothing_of_the_earlier_one(kept_folder, cuda, monkeypatch):
    _on_gpu0(monkeypatch)
    monkeypatch.setattr(action_dump, "_start_guardian", lambda *a, **k: None)
    if not cuda:
        monkeypatch.setattr(action_dump, "cuda_processes", lambda pid: [])
    assert action._run("pre-dump", CRIU) == 0
    assert _earlier_left(kept_folder) == []


# --- what a push killed before its dump left is not the next dump's ------------------------

def _left_by_a_killed_push(state, images, aside) -> None:
    """A push's requests and page links, its process gone before Podman's dump
    (tests/unit/test_requests.py's writer)."""
    from tests.unit.test_requests import _writer

    _writer(state, INIT, lock_timeout_ms=1)
    _writer(state, INIT, "pages", images=str(images), aside=str(aside), read_ahead=True)
    _prelink(images, aside)


def _prelink(images, aside) -> None:
    from gpusnap.pages import pages_aside

    aside.mkdir()
    assert pages_aside.prelink(images, aside, 3) == 3


def test_a_dump_after_a_push_killed_before_its_own_obeys_none_of_what_it_left(
        images, tmp_path, monkeypatch):
    """A plain `podman container checkpoint` after a push SIGKILLed before its
    dump: that push's lock timeout is not used, its memory is not read ahead
    into its folder, and CRIU writes no page through its links (into a folder
    no one will read: the checkpoint would lack that memory)."""
    from gpusnap import requests
    from gpusnap.gpu.quiesce import DEFAULT_LOCK_TIMEOUT_MS

    aside = tmp_path / ".gpusnap-push-killed"
    _left_by_a_killed_push(tmp_path / "state", images, aside)
    driver = _on_gpu0(monkeypatch)
    monkeypatch.setattr(action_dump, "_start_guardian", lambda *a, **k: object())
    monkeypatch.setattr(action_dump, "_read_ahead", lambda *a: pytest.fail("not this dump's"))
    assert action._run("pre-dump", CRIU) == 0
    assert driver.lock_timeouts == {INIT: DEFAULT_LOCK_TIMEOUT_MS}
    assert requests.peek(INIT) == {} and requests.peek(INIT, "pages") == {}  # post-dump: none
    assert not [p for p in images.iterdir() if p.is_symlink()]
    said = {e["event"]: e for e in journal.read()}
    assert said["request-dropped"]["why"].startswith("its writer")
    assert said["pages-links-dropped"]["links"] == ["pages-1.img", "pages-2.img", "pages-3.img"]


def test_the_requests_and_links_of_a_push_that_waits_for_this_dump_are_obeyed(
        images, tmp_path, monkeypatch):
    """This very process is the push: its options are used and its links kept;
    a link into any other folder (a push killed before, a restore's) goes."""
    from gpusnap import requests

    aside = tmp_path / ".gpusnap-push-mine"
    _prelink(images, aside)
    (images / "pages-9.img").symlink_to(tmp_path / ".gpusnap-push-killed" / "pages-9.img")
    requests.put_for_dump(INIT, lock_timeout_ms=1234)
    requests.put_for_dump(INIT, "pages", images=str(images), aside=str(aside))
    driver = _on_gpu0(monkeypatch)
    monkeypatch.setattr(action_dump, "_start_guardian", lambda *a, **k: None)
    assert action._run("pre-dump", CRIU) == 0
    assert driver.lock_timeouts == {INIT: 1234}
    assert requests.peek(INIT, "pages")["aside"] == str(aside)  # for post-dump
    assert sorted(p.name for p in images.iterdir() if p.is_symlink()) == [
        "pages-1.img", "pages-2.img", "pages-3.img"]


def test_links_a_dump_run_meanwhile_dropped_are_made_again_for_the_push_that_waited(
        images, tmp_path, monkeypatch):
    """The push linked its pages and waited on Podman's lock; someone's plain
    checkpoint ran first, dropped the links as not its own and left its pages
    in their place. The push's own dump links them all again (its
    ``prelink`` count): CRIU would write over that dump's files in place."""
    from gpusnap import requests

    aside = tmp_path / ".gpusnap-push-mine"
    aside.mkdir()
    (images / "pages-2.img").write_bytes(b"written by the plain dump")
    requests.put_for_dump(INIT, "pages", images=str(images), aside=str(aside), prelink=4)
    _on_gpu0(monkeypatch)
    monkeypatch.setattr(action_dump, "_start_guardian", lambda *a, **k: None)
    assert action._run("pre-dump", CRIU) == 0
    links = {p.name: p.readlink() for p in images.iterdir() if p.is_symlink()}
    assert links == {f"pages-{n}.img": aside / f"pages-{n}.img" for n in range(1, 5)}
    said = [e for e in journal.read() if e["event"] == "pages-links-made-again"]
    assert [(e["links"], e["replaced"]) for e in said] == [(4, ["pages-2.img"])]


def test_no_links_are_made_into_a_push_folder_that_is_gone(images, tmp_path, monkeypatch):
    """CRIU creates the file a link names: a folder gone would fail the dump."""
    from gpusnap import requests

    requests.put_for_dump(INIT, "pages", images=str(images), aside=str(tmp_path / "gone"),
                          prelink=4)
    _on_gpu0(monkeypatch)
    monkeypatch.setattr(action_dump, "_start_guardian", lambda *a, **k: None)
    assert action._run("pre-dump", CRIU) == 0
    assert not [p for p in images.iterdir() if p.is_symlink()]


def test_a_plain_dumps_steps_take_nothing_of_a_cli_that_waits_for_its_own(
        images, tmp_path, monkeypatch):
    """Another process (the waiting CLI) wrote the requests: this dump's pre-dump
    neither uses its lock timeout nor consumes it, and post-dump moves no page
    into its folder; both requests stay for the CLI's own dump."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from gpusnap import requests
    from gpusnap.gpu.quiesce import DEFAULT_LOCK_TIMEOUT_MS

    aside = tmp_path / ".gpusnap-push-waiting"
    aside.mkdir()
    code = ("import sys; from gpusnap import requests; "
            f"requests.put_for_dump({INIT}, lock_timeout_ms=4321); "
            f"requests.put_for_dump({INIT}, 'pages', images=sys.argv[1], aside=sys.argv[2]); "
            "print('put', flush=True); sys.stdin.read()")
    cli = subprocess.Popen([sys.executable, "-c", code, str(images), str(aside)],
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                           env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])})
    try:
        assert cli.stdout.readline().strip() == "put"
        driver = _on_gpu0(monkeypatch)
        monkeypatch.setattr(action_dump, "_start_guardian", lambda *a, **k: None)
        assert action._run("pre-dump", CRIU) == 0
        assert driver.lock_timeouts == {INIT: DEFAULT_LOCK_TIMEOUT_MS}
        (images / "pages-1.img").write_bytes(b"the plain dump's memory")
        assert action._run("post-dump", CRIU) == 0
        assert not (images / "pages-1.img").is_symlink() and not list(aside.iterdir())
        assert requests.peek(INIT)["lock_timeout_ms"] == 4321
        assert requests.peek(INIT, "pages")["aside"] == str(aside)
    finally:
        cli.communicate("", timeout=30)
