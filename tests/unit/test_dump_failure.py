"""ops/checkpoint.py: what a failed dump says. A refusal of the action script
is said as it is, with its own hint; CRIU's log is named only where CRIU (or
the quiesce it ran) failed, never for a full disk that CRIU had nothing to do
with (a GPU run quoted the log of a dump that had succeeded)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpusnap import journal
from gpusnap.criu.log import seize_blocked
from gpusnap.errors import GpusnapError
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
    p = _plan(tmp_path, "gpusnap: pre-dump: process 11 holds ...\n")
    journal.record("failed", action="pre-dump", init_pid=str(INIT), refused=True,
                   error="process 11 (python3) holds the GPU driver's files", hint="end it")
    log = p.container.userdata / "dump.log"
    message, hint, criu, kept = checkpoint._why_dump_failed(p, "podman: criu failed",
                                                            "see dump.log", log)
    assert (message, hint, criu, kept) == ("process 11 (python3) holds the GPU driver's files",
                                           "end it", None, None)


def test_a_quiesce_failure_names_the_kept_log(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUSNAP_STATE_DIR", str(tmp_path / "state"))
    p = _plan(tmp_path, "gpusnap: pre-dump: lock failed\n")
    journal.record("failed", action="pre-dump", init_pid=str(INIT), refused=False,
                   error="lock failed for 1 process(es): pid 7: CUDA_ERROR_TIMEOUT", hint=None)
    log = p.container.userdata / "dump.log"
    message, hint, _, kept = checkpoint._why_dump_failed(p, "podman: criu failed",
                                                         "see dump.log", log)
    assert message.startswith("GPU quiesce failed: lock failed for 1 process(es)"), message
    assert f"CRIU's log is kept in {kept}" in message and hint == "see dump.log"


def test_a_full_disk_is_said_as_podman_said_it_without_crius_log(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUSNAP_STATE_DIR", str(tmp_path / "state"))
    p = _plan(tmp_path, "(00.1) Dumping finished successfully\n")
    said = "writing x.tar.zst failed: the disk is full"
    message, hint, criu, kept = checkpoint._why_dump_failed(p, said, "free space",
                                                            p.container.userdata / "dump.log")
    assert (message, hint, criu, kept) == (said, "free space", None, None)
    assert not (tmp_path / "state" / "logs").exists() or not any(
        (tmp_path / "state" / "logs").iterdir()), "no log kept for a failure not CRIU's"


# CRIU's end when a task stayed in D through the freeze (the sid matrix leg, busybox 1.38's
# sh in vfork() for its child's exec: docs/reliability.md)
UNSEIZABLE = """(00.138168) freezing cgroup /sys/fs/cgroup/libpod_parent/libpod-9c6e: 100 x 100ms attempts, timeout: 10s
(00.238596) freezing processes: 1 attempts done
(00.238662) SEIZE 22748 (comm sh): success
(00.238702) SEIZE 23267 (comm sh): success
(10.138333) Error (criu/cr-dump.c:1655): Timeout reached. Try to interrupt: 0
(10.138566) Error (compel/src/lib/infect.c:262): Unseizable non-zombie 22748 found, state D, err -1/4
(10.138681) Error (criu/cr-dump.c:1975): Dumping FAILED.
"""


def test_seize_blocked_names_the_task_left_in_d(tmp_path):
    log = tmp_path / "dump.log"
    log.write_text(UNSEIZABLE)
    assert seize_blocked(log) == 22748
    log.write_text(UNSEIZABLE.replace("state D", "state R"))
    assert seize_blocked(log) is None
    assert seize_blocked(tmp_path / "absent.log") is None


def _tries(monkeypatch, tmp_path, outcomes: list) -> tuple[checkpoint.CheckpointPlan, list]:
    """checkpoint.run over _run_once answering from ``outcomes`` (an exception raises)."""
    monkeypatch.setenv("GPUSNAP_STATE_DIR", str(tmp_path / "state"))
    p = _plan(tmp_path, None)
    calls = []

    def once(plan):
        calls.append(plan)
        out = outcomes[len(calls) - 1]
        if isinstance(out, Exception):
            raise out
        return out

    monkeypatch.setattr(checkpoint, "_run_once", once)
    return p, calls


def test_a_task_criu_could_not_seize_is_taken_again(monkeypatch, tmp_path):
    p, calls = _tries(monkeypatch, tmp_path,
                      [checkpoint.SeizeBlocked("job", 22748, None), {"ok": True}])
    assert checkpoint.run(p) == {"ok": True, "retaken": {"tries": 2, "files": []}}
    assert len(calls) == 2
    assert [e["pid"] for e in journal.read(10) if e["event"] == "checkpoint-unseizable"] == [22748]


def test_three_unseizable_tries_say_so_in_one_line(monkeypatch, tmp_path):
    p, _ = _tries(monkeypatch, tmp_path, [checkpoint.SeizeBlocked("job", 7, None)] * 3)
    with pytest.raises(GpusnapError) as err:
        checkpoint.run(p)
    assert err.value.message.startswith("CRIU could not seize process 7 of job: it stayed "
                                        "uninterruptible through the freeze"), err.value.message
    assert err.value.message.endswith("the container is still running (3 tries)")
    assert "again" in err.value.hint


def test_renamed_open_files_are_the_line_though_the_last_try_met_an_unseizable_task(
        monkeypatch, tmp_path):
    """CI71 (sid + runc): two tries met renamed open files and the third a shell
    caught in vfork; the line named the vfork and hinted "checkpoint it again",
    which would meet the renames again. The renames are what the user must act on."""
    p, _ = _tries(monkeypatch, tmp_path, [checkpoint._Stale(["/tmp/h1"]), checkpoint._Stale(["/tmp/h2"]),
                                          checkpoint.SeizeBlocked("job", 7, None)])
    with pytest.raises(GpusnapError) as err:
        checkpoint.run(p)
    assert err.value.message.startswith("the checkpoint of ") and "would not restore" in err.value.message
    assert "/tmp/h2" in err.value.message and "(3 tries)" in err.value.message
    assert "without --leave-running" in err.value.hint


def test_a_streamed_push_gets_the_race_back_to_take_again_itself(monkeypatch, tmp_path):
    p, calls = _tries(monkeypatch, tmp_path, [checkpoint.SeizeBlocked("job", 7, None)])
    p.retake_stale = False
    with pytest.raises(checkpoint.SeizeBlocked):
        checkpoint.run(p)
    assert len(calls) == 1


def test_stale_words_say_open_files_and_a_damaged_diff_each_as_they_are():
    words = checkpoint._stale_words(["/tmp/h3 (gone)", "the root filesystem in the export (damaged: x)"])
    assert words == ("/tmp/h3 (gone), open at the dump, changed before Podman wrote the root "
                     "filesystem; the root filesystem in the export (damaged: x)")
    assert checkpoint._stale_words(["the root filesystem in the export (damaged: x)"]) == \
        "the root filesystem in the export (damaged: x)"


def test_ctrl_c_in_the_dump_gets_the_failures_clean_up_and_says_where_the_container_is(
        tmp_path, monkeypatch):
    # a CPU container has no guardian: the cgroup CRIU froze must be thawed here
    from gpusnap import requests

    monkeypatch.setenv("GPUSNAP_STATE_DIR", str(tmp_path / "state"))
    p = _plan(tmp_path, None)
    requests.put_for_dump(INIT, lock_timeout_ms=1)  # as the CLI puts it: its own
    thawed = []

    def interrupted(plan):
        raise KeyboardInterrupt
    monkeypatch.setattr(checkpoint, "_dump", interrupted)
    monkeypatch.setattr(podman, "exists", lambda name: True)
    monkeypatch.setattr(podman, "inspect", lambda name: p.container)
    monkeypatch.setattr(checkpoint, "thaw", lambda pid: thawed.append(pid) or True)
    monkeypatch.setattr(checkpoint, "ensure_running", lambda init, pids: [])
    with pytest.raises(GpusnapError) as info:
        checkpoint._run_once(p)
    assert info.value.exit_code == 130 and thawed == [INIT]
    assert info.value.message == "interrupted (Ctrl-C); the container is still running"
    assert requests.peek(INIT) == {}  # the action script's request dropped


def test_an_earlier_dumps_refusal_is_not_this_dumps_words(tmp_path, monkeypatch):
    import time

    monkeypatch.setenv("GPUSNAP_STATE_DIR", str(tmp_path / "state"))
    p = _plan(tmp_path, "(00.1) Dumping finished successfully\n")
    journal.record("failed", action="pre-dump", init_pid=str(INIT), refused=True,
                   error="lock timed out an hour ago", hint="an old hint")
    said = "writing x.tar.zst failed: the disk is full"
    message, hint, _, _ = checkpoint._why_dump_failed(p, said, "free space", None,
                                                      time.time() + 5)
    assert (message, hint) == (said, "free space")


def test_the_requests_a_checkpoint_leaves_name_it_and_the_init_they_are_for(tmp_path,
                                                                           monkeypatch):
    """The action script obeys them only while this process waits for its dump
    (requests.for_dump): killed before it, its requests are no later dump's."""
    import os

    from gpusnap import requests
    from gpusnap.procs import ProcessGpuUse, start_time

    monkeypatch.setenv("GPUSNAP_STATE_DIR", str(tmp_path / "state"))
    p = _plan(tmp_path, None)
    p.cuda, p.pages_aside = [ProcessGpuUse(pid=INIT, comm="train")], tmp_path / "aside"
    seen = {}

    def dump(plan):
        seen.update(options=requests.peek(INIT), pages=requests.peek(INIT, "pages"))
        raise KeyboardInterrupt
    monkeypatch.setattr(checkpoint, "_dump", dump)
    monkeypatch.setattr(podman, "exists", lambda name: False)
    monkeypatch.setattr(checkpoint, "ensure_running", lambda init, pids: [])
    with pytest.raises(GpusnapError):
        checkpoint._run_once(p)
    for request in seen.values():
        assert (request["writer"], request["writer_started"], request["init_started"]) == (
            os.getpid(), start_time(os.getpid()), start_time(INIT))
    assert seen["options"]["lock_timeout_ms"] == 10_000
    assert seen["pages"]["aside"] == str(tmp_path / "aside")
