"""ops/checkpoint.py: what a failed dump says. A refusal of the action script
is said as it is, with its own hint; CRIU's log is named only where CRIU (or
the quiesce it ran) failed, never for a full disk that CRIU had nothing to do
with (a GPU run quoted the log of a dump that had succeeded)."""

from __future__ import annotations

import time
from pathlib import Path

from gpusnap import journal
from gpusnap.ops import checkpoint
from gpusnap.runtime import podman

INIT = 4242


def _plan(tmp_path: Path, log: str | None) -> checkpoint.CheckpointPlan:
    userdata = tmp_path / "userdata"
    userdata.mkdir()
    if log is not None:
        (userdata / "dump.log").write_text(log)
    ctr = podman.Container(id="c0ffee", name="job", status="running", pid=INIT, image="img",
                           checkpointed=False, userdata=userdata, devices=[])
    return checkpoint.CheckpointPlan(ctr, [], None, False, False, 10_000, 0)


def test_a_refusal_of_pre_dump_is_said_with_its_hint_and_no_log(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUSNAP_STATE_DIR", str(tmp_path / "state"))
    p = _plan(tmp_path, "(00.1) Error (gpusnap): pre-dump: process 11 holds ...\n")
    journal.record("failed", action="pre-dump", init_pid=str(INIT), refused=True,
                   error="process 11 (python3) holds the GPU driver's files", hint="end it")
    message, hint, criu = checkpoint._why_dump_failed(p, "podman: criu failed", "see dump.log",
                                                      time.time())
    assert (message, hint, criu) == ("process 11 (python3) holds the GPU driver's files",
                                     "end it", None)


def test_a_quiesce_failure_names_the_kept_log(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUSNAP_STATE_DIR", str(tmp_path / "state"))
    p = _plan(tmp_path, "(00.1) Error (gpusnap): pre-dump: lock failed\n")
    journal.record("failed", action="pre-dump", init_pid=str(INIT), refused=False,
                   error="lock failed for 1 process(es): pid 7: CUDA_ERROR_TIMEOUT", hint=None)
    message, hint, _ = checkpoint._why_dump_failed(p, "podman: criu failed", "see dump.log",
                                                   time.time())
    assert message.startswith("GPU quiesce failed: lock failed for 1 process(es)"), message
    assert "CRIU's log is kept in" in message and hint == "see dump.log"


def test_a_full_disk_is_said_as_podman_said_it_without_crius_log(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUSNAP_STATE_DIR", str(tmp_path / "state"))
    p = _plan(tmp_path, "(00.1) Dumping finished successfully\n")
    said = "writing x.tar.zst failed: the disk is full"
    message, hint, criu = checkpoint._why_dump_failed(p, said, "free space", time.time())
    assert (message, hint, criu) == (said, "free space", None)
    assert not (tmp_path / "state" / "logs").exists() or not any(
        (tmp_path / "state" / "logs").iterdir()), "no log kept for a failure not CRIU's"
