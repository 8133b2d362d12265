"""Background uploads (`gpusnap migrate|push CTR REF --detach`) through a
loopback registry: the command returns once the checkpoint is on local
storage, `gpusnap status ID` follows the upload, and an upload killed
halfway leaves a local checkpoint that `gpusnap restore` brings back.
"""

from __future__ import annotations

import os
import shutil
import signal
import time
from pathlib import Path

from gpusnap.ops.uploads import alive
from tests.conftest import assert_continued, assert_one_line_error, born, gpusnap, gpusnap_json, \
    journal_mark, journal_since, podman, read_counter, wait_counter
from tests.faults.conftest import doctor_fix, settled, status, unique_repo


def _until(cond, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def test_detached_migrate_returns_stopped_and_the_upload_restores(registry, loaded):
    ref = registry.ref(f"{unique_repo()}:v1")
    before, token = read_counter(loaded), born(loaded)
    started = gpusnap_json("migrate", loaded, ref, "--detach", *registry.flags())
    # Returned once checkpointed: the container is down, the upload goes on (or just ended).
    assert status(loaded) == "exited"
    assert started["phase"] in ("uploading", "done"), started
    assert started["container_state"]["status"] == "exited"
    assert started["checkpointed_after_s"] > 0 and started["bytes_total"] > 0
    assert Path(started["state_file"]).is_file()
    assert f"gpusnap restore {ref}" in started["restore_command"]
    done = gpusnap_json("status", started["id"], "--wait")
    assert done["phase"] == "done", done
    assert done["result"]["digest"].startswith("sha256:")
    assert done["pushed_after_s"] >= done["checkpointed_after_s"]
    assert done["bytes_done"] == done["bytes_total"] == started["bytes_total"]  # as announced
    assert started["id"] in {u["id"] for u in gpusnap_json("status")["uploads"]}
    at = stopped_counter(loaded)
    assert at >= before
    podman("rm", loaded)
    gpusnap_json("restore", ref, *registry.flags())
    goes_on(loaded, at, token)


def goes_on(name: str, at: int, token: str) -> None:
    """The restored counter starts from the checkpoint's value (a fresh
    start would count from 1) and counts on, in the process that wrote ``token``."""
    first = wait_counter(name, -1)
    assert first >= at, (first, at)
    assert_continued(name, first, token)


def stopped_counter(name: str) -> int:
    """The counter a stopped container's file system holds: its value at the checkpoint."""
    root = Path(podman("mount", name).stdout.strip())
    try:
        return int((root / "tmp/c").read_text())
    finally:
        podman("umount", name)


def test_detached_upload_killed_halfway_leaves_a_checkpoint_that_restores(registry, loaded):
    before, token = read_counter(loaded), born(loaded)
    repo = unique_repo()
    ref = registry.ref(f"{repo}:v1")
    mark = journal_mark()
    started = gpusnap_json("migrate", loaded, ref, "-d", *registry.flags())
    state_file = Path(started["state_file"])

    def uploading() -> dict:
        return gpusnap_json("status", started["id"])

    _until(lambda: len(registry.linked_blobs(repo)) >= 10 or uploading()["phase"] != "uploading",
           "10 chunks were uploaded")
    # The registry paused: the upload cannot finish while the kill is aimed.
    os.kill(registry.proc.pid, signal.SIGSTOP)
    try:
        live = uploading()
        assert live["phase"] == "uploading", ("the upload ended before the kill", live)
        export = Path(live["export"])
        # A live upload's export is in use: doctor --fix leaves it alone.
        removed = doctor_fix()["removed"]
        assert not any(str(export.parent) in r for r in removed), removed
        assert export.is_file()
        os.kill(live["pid"], signal.SIGKILL)
        _until(lambda: not alive(live["pid"], state_file), "the background upload died")
    finally:
        os.kill(registry.proc.pid, signal.SIGCONT)
    try:
        failed = uploading()
        assert failed["phase"] == "failed", failed
        assert failed["export"] == str(export)
        assert "the upload was killed" in failed["error"] and str(export) in failed["error"]
        # the pages lie aside with Podman's local checkpoint: that is what the line
        # restores (no `podman rm` first); the retry is the push's own command
        back = f"`gpusnap restore {loaded}` (its local checkpoint"
        assert back in failed["hint"] and f"`gpusnap push {export} {ref}" in failed["hint"]
        assert "chunks already sent are skipped" in failed["hint"]
        waited = gpusnap("status", started["id"], "--wait")
        assert_one_line_error(waited, "the upload was killed", hint=back)
        assert status(loaded) == "exited"
        assert any(e.get("event") == "checkpointed" and e.get("export") == str(export)
                   for e in journal_since(mark))
        at = stopped_counter(loaded)
        assert at >= before
        # The export links its pages into a folder of their own (in RAM where
        # the host could spare it); the kill left it. doctor --fix keeps it
        # while the export needs it: the restore below reads the pages there.
        aside = [Path(e["aside"]) for e in journal_since(mark) if e.get("event") == "pages-aside"]
        assert len(aside) == 1, aside
        settled(aside)
        assert str(aside[0]) not in doctor_fix()["removed"]
        gpusnap_json("restore", loaded)  # as the line says
        goes_on(loaded, at, token)
    finally:
        shutil.rmtree(export.parent, ignore_errors=True)
    # The export gone, its pages folder is litter that doctor --fix removes.
    settled(aside)
    doctor_fix()
    assert not aside[0].exists(), "doctor --fix left the pages of an export that is gone"


def test_detach_refuses_a_file_source(registry, tmp_path):
    archive = tmp_path / "ctr.tar.zst"
    archive.write_bytes(b"not a checkpoint")
    mark = journal_mark()
    res = gpusnap("push", str(archive), registry.ref(f"{unique_repo()}:v1"), "--detach",
                  *registry.flags())
    assert_one_line_error(res, "--detach", str(archive), hint="without --detach")
    assert not [e for e in journal_since(mark) if e.get("event") in ("export-started",
                                                                        "checkpointed")]


def test_detach_leave_running_returns_with_the_container_running(registry, loaded):
    ref = registry.ref(f"{unique_repo()}:v1")
    started = gpusnap_json("migrate", "-R", "--detach", loaded, ref, *registry.flags())
    assert status(loaded) == "running"
    assert started["container_state"]["status"] == "running"
    still = read_counter(loaded)
    assert wait_counter(loaded, still) > still
    done = gpusnap_json("status", started["id"], "--wait")
    assert done["phase"] == "done", done
    assert status(loaded) == "running"
