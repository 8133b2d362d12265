"""gpusnap.journal: an append-only JSON-lines record that never fails its caller."""

from __future__ import annotations

import json
import os
import re
import stat
import threading
import time
from pathlib import Path

import pytest

from gpusnap import journal


@pytest.fixture
def state_dir(tmp_path: Path, monkeypatch) -> Path:
    path = tmp_path / "run" / "gpusnap"
    monkeypatch.setenv("GPUSNAP_STATE_DIR", str(path))
    return path


def test_state_dir_follows_the_environment_and_is_created_private(state_dir):
    assert journal.state_dir() == state_dir
    assert stat.S_IMODE(state_dir.stat().st_mode) == 0o700


def test_state_dir_defaults_to_run_gpusnap(monkeypatch, tmp_path):
    monkeypatch.delenv("GPUSNAP_STATE_DIR", raising=False)
    made = []
    monkeypatch.setattr(journal, "private_dir", lambda p: made.append(Path(p)) or Path(p))
    assert journal.state_dir() == Path("/run/gpusnap")
    assert made == [Path("/run/gpusnap")]


def test_a_state_dir_an_older_version_left_open_is_narrowed(state_dir):
    state_dir.mkdir(parents=True, mode=0o755)
    state_dir.chmod(0o755)
    (state_dir / "journal.jsonl").write_text("")
    (state_dir / "journal.jsonl").chmod(0o644)
    journal.record("x")
    assert stat.S_IMODE(state_dir.stat().st_mode) == 0o700
    assert stat.S_IMODE((state_dir / "journal.jsonl").stat().st_mode) == 0o600
    assert stat.S_IMODE(journal.state_subdir("restores").stat().st_mode) == 0o700


def test_record_then_read_returns_the_events_in_order(state_dir):
    journal.record("quiesced", init_pid=10, pids=[11, 12])
    journal.record("resumed", init_pid=10, pids=[11])
    events = journal.read()
    assert [(e["event"], e["pids"]) for e in events] == [("quiesced", [11, 12]), ("resumed", [11])]
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d[+-]\d{4}", events[0]["time"])
    # the same moment in seconds to the millisecond, for timelines
    assert abs(events[0]["at"] - time.time()) < 60 and events[0]["at"] <= events[1]["at"]
    assert time.strftime("%Y-%m-%dT%H:%M", time.localtime(events[0]["at"])) in events[0]["time"]


def test_each_event_is_one_json_line(state_dir):
    journal.record("a", note="line\nbreak")
    journal.record("b")
    lines = (state_dir / "journal.jsonl").read_text().splitlines()
    assert [json.loads(line)["event"] for line in lines] == ["a", "b"]
    assert json.loads(lines[0])["note"] == "line\nbreak"


def test_record_appends_and_keeps_earlier_events(state_dir):
    for i in range(5):
        journal.record("tick", i=i)
    assert [e["i"] for e in journal.read()] == [0, 1, 2, 3, 4]


def test_read_returns_only_the_last_events(state_dir):
    for i in range(10):
        journal.record("tick", i=i)
    assert [e["i"] for e in journal.read(limit=3)] == [7, 8, 9]


def test_values_json_cannot_hold_are_written_as_text(state_dir):
    journal.record("odd", path=Path("/x/y"), error=ValueError("bad"))
    [event] = journal.read()
    assert event["path"] == "/x/y" and event["error"] == "bad"


def test_journal_file_is_private(state_dir):
    journal.record("x")
    assert stat.S_IMODE((state_dir / "journal.jsonl").stat().st_mode) == 0o600


def test_read_skips_damaged_lines(state_dir):
    journal.record("first")
    with open(state_dir / "journal.jsonl", "a") as f:
        f.write('{"event": "cut in the mid\n')
    journal.record("second")
    assert [e["event"] for e in journal.read()] == ["first", "second"]


def test_read_of_an_empty_journal_is_empty(state_dir):
    assert journal.read() == []


def test_record_never_fails_the_caller(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("GPUSNAP_STATE_DIR", str(blocker / "state"))  # cannot be created
    journal.record("lost", detail="x")  # no exception


def test_concurrent_records_do_not_interleave(state_dir):
    def writer(n):
        for i in range(50):
            journal.record("w", writer=n, i=i, pad="x" * 500)

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    lines = (state_dir / "journal.jsonl").read_text().splitlines()
    assert len(lines) == 200
    assert all(json.loads(line)["event"] == "w" for line in lines)


def test_keep_log_copies_crius_log_and_keeps_only_the_newest(state_dir, tmp_path, monkeypatch):
    log = tmp_path / "dump.log"
    assert journal.keep_log(log, "dump", "c") is None  # no log: nothing to keep
    log.write_text("(00.000000) CRIU run id = x\n")
    monkeypatch.setattr(journal, "KEPT_LOGS", 3)
    old = state_dir / "logs"
    old.mkdir(parents=True)
    for i in range(4):  # older than anything kept now
        (old / f"dump-old{i}-1.log").write_text("old")
        os.utime(old / f"dump-old{i}-1.log", (i, i))
    kept = journal.keep_log(log, "dump", "c")
    assert kept is not None and kept.read_text() == log.read_text()
    assert kept.name.startswith("dump-c-") and kept.parent == old
    assert sorted(p.name for p in old.iterdir()) == sorted(["dump-old2-1.log", "dump-old3-1.log", kept.name])


def test_a_log_copy_the_disk_cut_short_is_not_left(state_dir, tmp_path, monkeypatch):
    """A cut copy would read as a CRIU killed mid-way (criu.log.ended_early)."""
    import errno
    log = tmp_path / "restore.log"
    log.write_text("(00.000000) CRIU run id = x\n(00.1) Error (x.c:1): y\n")

    def half(src, dst):
        Path(dst).write_text("(00.000000) CRIU")
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(journal.shutil, "copyfile", half)
    assert journal.keep_log(log, "restore", "c") is None
    assert list((state_dir / "logs").iterdir()) == []
