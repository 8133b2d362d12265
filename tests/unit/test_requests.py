"""gpusnap.requests: options the CLI leaves for the CRIU action script of one checkpoint."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpusnap import journal, procs, requests


@pytest.fixture
def state_dir(tmp_path: Path, monkeypatch) -> Path:
    path = tmp_path / "state"
    monkeypatch.setenv("GPUSNAP_STATE_DIR", str(path))
    return path


def test_take_returns_what_put_left(state_dir):
    requests.put(4242, lock_timeout_ms=2500, leave_running=True)
    assert requests.take(4242) == {"lock_timeout_ms": 2500, "leave_running": True}


def test_take_removes_the_request(state_dir):
    requests.put(4242, lock_timeout_ms=1)
    requests.take(4242)
    assert requests.take(4242) == {}
    assert list((state_dir / "requests").iterdir()) == []


def test_requests_are_kept_per_init_pid(state_dir):
    requests.put(1, lock_timeout_ms=100)
    requests.put(2, lock_timeout_ms=200)
    assert requests.take(2) == {"lock_timeout_ms": 200}
    assert requests.take(1) == {"lock_timeout_ms": 100}


def test_a_second_put_replaces_the_first(state_dir):
    requests.put(7, lock_timeout_ms=100, extra="x")
    requests.put(7, lock_timeout_ms=200)
    assert requests.take(7) == {"lock_timeout_ms": 200}


def test_put_writes_a_private_file_and_no_leftover_temporary(state_dir):
    requests.put(9, lock_timeout_ms=5)
    files = list((state_dir / "requests").iterdir())
    assert [f.name for f in files] == ["9.json"]
    assert stat.S_IMODE(files[0].stat().st_mode) == 0o600
    assert stat.S_IMODE((state_dir / "requests").stat().st_mode) == 0o700


def test_take_without_a_request_is_empty(state_dir):
    assert requests.take(31337) == {}


@pytest.mark.parametrize("text", ["{broken", "[1, 2]", "42", ""], ids=["garbage", "array",
                                                                     "number", "empty"])
def test_take_of_a_damaged_request_is_empty(state_dir, text):
    requests.put(5, lock_timeout_ms=1)
    (state_dir / "requests" / "5.json").write_text(text)
    assert requests.take(5) == {}


def test_drop_forgets_a_request(state_dir):
    requests.put(6, lock_timeout_ms=1)
    requests.drop(6)
    assert requests.take(6) == {}
    requests.drop(6)  # dropping twice is fine


# --- a CLI's requests name their writer: one killed before its dump is obeyed by no dump ------

def _writer(state_dir: Path, init_pid: int, kind: str = "", wait: bool = True,
            **options) -> subprocess.Popen:
    """Another process that puts a request for ``init_pid``'s next dump and
    exits, as a `gpusnap push` killed before its dump; reaped unless ``wait``
    is False (a zombie then, its parent not yet told)."""
    code = ("import json, sys; from gpusnap import requests; "
            "requests.put_for_dump(int(sys.argv[1]), sys.argv[2], **json.loads(sys.argv[3]))")
    child = subprocess.Popen([sys.executable, "-c", code, str(init_pid), kind,
                              json.dumps(options)],
                             env={**os.environ, "GPUSNAP_STATE_DIR": str(state_dir),
                                  "PYTHONPATH": str(Path(__file__).parents[2])})
    if wait:
        assert child.wait(timeout=60) == 0
    else:  # exited, not reaped: its request is there once it is a zombie
        deadline = time.monotonic() + 60
        while not requests.peek(init_pid, kind) or procs.runs_as(child.pid,
                                                                 procs.start_time(child.pid)):
            assert time.monotonic() < deadline
            time.sleep(0.01)
    return child


def test_a_request_whose_writer_waits_for_the_dump_is_obeyed(state_dir):
    requests.put_for_dump(os.getpid(), lock_timeout_ms=2500)  # this process: alive
    found = requests.for_dump(os.getpid())
    assert found["lock_timeout_ms"] == 2500 and found["writer"] == os.getpid()
    assert requests.take(os.getpid())["lock_timeout_ms"] == 2500  # left for its step


def test_a_request_whose_writer_was_killed_before_the_dump_is_dropped_not_obeyed(state_dir):
    _writer(state_dir, os.getpid(), "pages", images="/x", aside="/y")
    assert requests.peek(os.getpid(), "pages")["aside"] == "/y"
    assert requests.for_dump(os.getpid(), "pages") == {}
    assert requests.peek(os.getpid(), "pages") == {}  # no later dump finds it either
    said = journal.read()[-1]
    assert said["event"] == "request-dropped" and said["kind"] == "pages"
    assert "is gone: killed before this dump" in said["why"]


def test_a_writer_killed_but_not_yet_reaped_is_gone_too(state_dir):
    child = _writer(state_dir, os.getpid(), wait=False, lock_timeout_ms=1)
    try:
        assert requests.for_dump(os.getpid()) == {}
    finally:
        child.wait(timeout=60)


@pytest.mark.parametrize("left", ["no writer", "an earlier init", "another folder"])
def test_a_request_of_no_writer_or_of_another_dump_is_dropped(state_dir, tmp_path, left):
    images = tmp_path / "images"
    images.mkdir()
    if left == "no writer":  # a plain put: no one says it waits for this dump
        requests.put(os.getpid(), "pages", images=str(images))
    else:
        requests.put_for_dump(os.getpid(), "pages", images=str(
            images if left != "another folder" else tmp_path))
    if left == "an earlier init":  # the container restarted: its init took the pid anew
        data = requests.peek(os.getpid(), "pages")
        requests.put(os.getpid(), "pages", **{**data, "init_started": -1})
    assert requests.for_dump(os.getpid(), "pages", str(images)) == {}
    assert requests.peek(os.getpid(), "pages") == {}


def test_a_live_writer_that_did_not_start_this_dump_is_not_obeyed(state_dir):
    # gpusnap's CLI still waits for its own dump when someone runs a plain
    # `podman container checkpoint` of the container: that dump's pre-dump
    # (no descendant of the CLI) leaves the CLI's request alone.
    code = ("import json, sys, time; from gpusnap import requests; "
            "requests.put_for_dump(int(sys.argv[1]), 'pages', images='/x', aside='/y'); "
            "print('put', flush=True); sys.stdin.read()")
    other = subprocess.Popen([sys.executable, "-c", code, str(os.getpid())], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "GPUSNAP_STATE_DIR": str(state_dir),
                                  "PYTHONPATH": str(Path(__file__).parents[2])})
    try:
        assert other.stdout.readline().strip() == "put"
        found = requests.peek(os.getpid(), "pages")
        assert requests.stale(os.getpid(), found, "") is None  # a live writer's, for this init
        assert requests.for_dump(os.getpid(), "pages") == {}  # not obeyed here...
        assert requests.peek(os.getpid(), "pages") == found  # ...and left for the CLI's own dump
        # nor dropped by a dump into another folder (someone's `checkpoint -P`)
        assert requests.for_dump(os.getpid(), "pages", str(state_dir)) == {}
        assert requests.peek(os.getpid(), "pages") == found
        left = [e for e in journal.read() if e["event"] == "request-left"]
        assert [e["why"] for e in left] == 2 * [
            f"its writer (pid {other.pid}) waits for a dump of its own, not this one"]
    finally:
        other.communicate("", timeout=30)
    requests.put_for_dump(os.getpid(), "pages", images="/x")  # this process's own: obeyed
    assert requests.for_dump(os.getpid(), "pages")["images"] == "/x"


def test_a_request_is_obeyed_by_a_pre_dump_its_writer_started_generations_down(state_dir):
    # the CLI (writer) -> Podman -> runc/crun -> CRIU -> the action script: here
    # this test, a child and its child, which takes the request as pre-dump does
    requests.put_for_dump(os.getpid(), "pages", images="/x", aside="/y")
    take = ("import json, sys; from gpusnap import requests; "
            "print(json.dumps(requests.for_dump(int(sys.argv[1]), 'pages')))")
    middle = "import subprocess, sys; subprocess.run(sys.argv[1:], check=True)"
    res = subprocess.run([sys.executable, "-c", middle, sys.executable, "-c", take, str(os.getpid())],
                         capture_output=True, text=True, timeout=60,
                         env={**os.environ, "GPUSNAP_STATE_DIR": str(state_dir),
                              "PYTHONPATH": str(Path(__file__).parents[2])})
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["aside"] == "/y"


def test_a_cli_drops_its_own_request_not_one_another_cli_put_in_its_place(state_dir):
    # two commands on one container wait on Podman's lock: the second's request
    # replaced the first's, and the first's clean-up must not take it away
    requests.put(77, "pages", writer=os.getpid() + 1, images="/theirs")
    requests.drop_own(77, "pages")
    assert requests.peek(77, "pages")["images"] == "/theirs"
    requests.put_for_dump(77, "pages", images="/mine")
    requests.drop_own(77, "pages")
    assert requests.peek(77, "pages") == {}
