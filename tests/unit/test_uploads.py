"""gpusnap.ops.uploads: the state files of background uploads, and cli.detach's argv."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpusnap.cli.detach import child_args
from gpusnap.ops import uploads


@pytest.fixture
def state_dir(tmp_path: Path, monkeypatch) -> Path:
    path = tmp_path / "state"
    monkeypatch.setenv("GPUSNAP_STATE_DIR", str(path))
    return path


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_create_writes_a_private_state_that_reads_back(state_dir):
    path = uploads.create("migrate", "web", "reg/app:v1", leave_running=False)
    assert path.parent == state_dir / "uploads"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    state = uploads.read(path)
    assert state["phase"] == "checkpointing" and state["pid"] is None
    assert state["id"] == path.stem and state["log"] == str(path.with_suffix(".log"))
    assert uploads.find(state["id"])["container"] == "web"


def test_write_is_atomic(state_dir, monkeypatch):
    path = uploads.create("push", "web", "reg/app:v1", leave_running=True)
    before = path.read_text()

    def broken(*_args):
        raise OSError("disk full")
    monkeypatch.setattr(os, "replace", broken)
    with pytest.raises(OSError):
        uploads.write(path, {"id": "x", "phase": "done"})
    assert path.read_text() == before  # the old state whole, no temporary left
    assert [p.name for p in path.parent.iterdir()] == [path.name]


def test_a_running_upload_whose_process_is_gone_is_failed_with_its_export(state_dir, tmp_path):
    path = uploads.create("migrate", "web", "reg/app:v1", leave_running=False)
    export = tmp_path / ".gpusnap-push-x" / "checkpoint.tar"
    export.parent.mkdir()
    export.write_bytes(b"tar")
    state = {**uploads.read(path), "phase": "uploading", "pid": _dead_pid(), "export": str(export)}
    uploads.write(path, state)
    seen = uploads.find(state["id"])
    assert seen["phase"] == "failed"
    assert seen["error"] == ("the upload was killed; web is checkpointed and stopped, its "
                             f"checkpoint is kept in {export}")
    assert f"`gpusnap push {export} reg/app:v1` tries again " \
           "(chunks already sent are skipped)" in seen["hint"]
    assert f"gpusnap restore {export}` brings it back here" in seen["hint"]
    assert json.loads(path.read_text())["phase"] == "uploading"  # derived, never rewritten
    export.unlink()  # killed after its push dropped the export: nothing offers it
    seen = uploads.find(state["id"])
    assert "is gone: pushed, or removed since" in seen["error"] and str(export) in seen["error"]
    assert "gpusnap inspect reg/app:v1" in seen["hint"] and "gpusnap push" not in seen["hint"]


def test_a_live_process_is_only_alive_with_the_state_file_on_its_command_line(state_dir):
    path = uploads.create("push", "web", "reg/app:v1", leave_running=True)
    uploads.write(path, {**uploads.read(path), "phase": "uploading", "pid": os.getpid()})
    # This pid lives, but it is not that upload's process (a reused pid).
    assert uploads.find(path.stem)["phase"] == "failed"
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", str(path)])
    try:
        uploads.write(path, {**uploads.read(path), "pid": proc.pid})
        assert uploads.find(path.stem)["phase"] == "uploading"
        assert uploads.live_work_dirs() == set()  # no export yet
    finally:
        proc.kill()
        proc.wait()
    assert uploads.find(path.stem)["phase"] == "failed"


def test_killed_before_the_checkpoint_was_complete_says_so(state_dir):
    path = uploads.create("migrate", "web", "reg/app:v1", leave_running=False)
    uploads.write(path, {**uploads.read(path), "pid": _dead_pid()})
    seen = uploads.find(path.stem)
    assert seen["phase"] == "failed" and "before web's checkpoint was complete" in seen["error"]


def test_a_state_whose_process_never_started_fails_after_a_while(state_dir):
    path = uploads.create("migrate", "web", "reg/app:v1", leave_running=False)
    assert uploads.find(path.stem)["phase"] == "checkpointing"  # being started
    uploads.write(path, {**uploads.read(path), "started": time.time() - 3600})
    assert uploads.find(path.stem)["phase"] == "failed"


def test_tracker_records_the_phases(state_dir):
    path = uploads.create("migrate", "web", "reg/app:v1", leave_running=False)
    tracker = uploads.Tracker(path)
    assert uploads.read(path)["pid"] == os.getpid()
    tracker.total(1000)
    tracker.checkpointed({"export": "/x/checkpoint.tar", "init_pid": 1, "bytes": 2000})
    state = uploads.read(path)
    assert state["phase"] == "uploading" and state["bytes_total"] == 2000
    assert state["checkpointed_after_s"] >= 0 and state["export"] == "/x/checkpoint.tar"
    tracker.advance(500, 100)
    tracker.done({"digest": "sha256:ab", "bytes": 1800})  # the files, no tar headers
    state = uploads.read(path)
    assert state["phase"] == "done" and state["result"]["digest"] == "sha256:ab"
    assert state["bytes_done"] == state["bytes_total"] == 2000  # as announced at checkpointed
    assert state["pushed_after_s"] >= state["checkpointed_after_s"]
    from gpusnap import journal
    assert [e["phase"] for e in journal.read() if e["event"] == "background-upload"] == \
        ["uploading", "done"]


def test_listing_prunes_old_finished_uploads_but_keeps_a_failed_one_with_its_export(
        state_dir, tmp_path):
    export = tmp_path / "checkpoint.tar"
    export.write_bytes(b"x")
    old = time.time() - uploads.PRUNE_AFTER_S - 60
    ids = {}
    for name, phase, kept in (("done", "done", None), ("kept", "failed", str(export)),
                              ("lost", "failed", str(tmp_path / "gone.tar"))):
        path = uploads.create("migrate", name, "reg/app:v1", leave_running=False)
        uploads.write(path, {**uploads.read(path), "phase": phase, "export": kept,
                             "started": old})
        ids[name] = path.stem
    listed = {s["container"] for s in uploads.all_states()}
    assert listed == {"kept"}
    assert not (state_dir / "uploads" / f"{ids['done']}.json").exists()


@pytest.mark.parametrize("argv, expected", [
    (["migrate", "-d", "web", "reg/a:v1"], ["migrate", "web", "reg/a:v1"]),
    (["migrate", "--detach", "-R", "web", "r"], ["migrate", "-R", "web", "r"]),
    (["migrate", "-dR", "web", "r"], ["migrate", "-R", "web", "r"]),
    (["push", "-Rdu", "me", "web", "r"], ["push", "-Ru", "me", "web", "r"]),
    (["push", "-udan", "web", "r", "-d"], ["push", "-udan", "web", "r"]),
])
def test_child_args_drop_only_detach(argv, expected):
    assert child_args(argv) == expected


def test_a_killed_detached_upload_prints_its_own_push_and_restore(state_dir, tmp_path):
    path = uploads.create("migrate", "web", "reg/app:v1", leave_running=False)
    export = tmp_path / "checkpoint.tar"
    export.write_bytes(b"tar")
    state = {**uploads.read(path), "phase": "uploading", "pid": _dead_pid(), "export": str(export),
             "push_again": f"gpusnap push {export} reg/app:v1 --encrypt-to /k/them.pub --plain-http",
             "restore_back": "`gpusnap restore web` (its local checkpoint, whose memory pages lie "
                             "in /run/gpusnap/ram/.gpusnap-push-y)"}
    uploads.write(path, state)
    seen = uploads.find(state["id"])
    assert f"`gpusnap push {export} reg/app:v1 --encrypt-to /k/them.pub --plain-http` tries " \
           "again" in seen["hint"]
    assert "`gpusnap restore web` (its local checkpoint" in seen["hint"] and "podman rm" not in \
        seen["hint"]
