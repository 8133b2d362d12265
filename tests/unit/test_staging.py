"""The driver's staging mapped from the pages file instead of written: the plan
splits each task's runs into written and mapped (never both, none left out),
post-restore writes the one and holds the other, post-resume maps it into the
real child process (pages/remote_map.py), and the driver's restore is refused
for a process whose staging is not in place yet."""

from __future__ import annotations

import json
import os
import random

import pytest

from gpusnap.action import action, step_state
from gpusnap.gpu import staging
from gpusnap.gpu.cuda import ProcessState
from gpusnap.errors import GpusnapError
from gpusnap.gpu.quiesce import QuiesceError, resume, resume_onto
from gpusnap.pages import fill_plan, remote_map, remote_syscall
from gpusnap.criu import pagemap as pm
from tests.unit.fakes import FakeDriver
from tests.unit.test_fill_plan import (PAGE, PLAIN, _criu_reads, _fills, _memory_of, _task,
                                       child, small, state)  # noqa: F401 (fixtures)

A = 0x10000000


def _record(folder, vpid: int, ranges: list[tuple[int, int]]) -> None:
    staging.record(folder, {(os.getpid(), vpid): ranges})


def test_runs_in_the_staging_are_mapped_and_the_rest_written_each_page_once(tmp_path):
    folder = tmp_path / "images"
    memory = _task(folder, 1, 1, [(A, A + 64 * PAGE, PLAIN)], [(A, 64, pm.PE_PRESENT)],
                   random.Random(3))
    _record(folder, 1, [(A + 10 * PAGE, A + 50 * PAGE)])
    p = fill_plan.prepare(folder, lambda p: None, map_staging=True)
    assert [(r.address, r.length) for r in p.mapped[1]] == [(A + 10 * PAGE, 40 * PAGE)]
    assert [(r.address, r.length) for r in p.tasks[1]] == [(A, 10 * PAGE), (A + 50 * PAGE, 14 * PAGE)]
    assert p.mapped_bytes == 40 * PAGE and p.bytes == 24 * PAGE
    by_criu, written, mapped = _criu_reads(folder, 1), _fills(p.tasks[1]), _fills(p.mapped[1])
    assert not (by_criu.keys() & written.keys() or by_criu.keys() & mapped.keys()
                or written.keys() & mapped.keys())
    assert {**by_criu, **written, **mapped} == memory
    assert fill_plan.Plan.from_json(p.to_json()) == p
    fill_plan.undo(folder)


def test_without_a_record_or_unless_told_to_nothing_is_mapped(tmp_path):
    folder = tmp_path / "images"
    _task(folder, 1, 1, [(A, A + 64 * PAGE, PLAIN)], [(A, 64, pm.PE_PRESENT)], random.Random(3))
    assert fill_plan.plan(folder, map_staging=True).mapped == {}
    _record(folder, 1, [(A, A + 64 * PAGE)])
    assert fill_plan.plan(folder).mapped == {}  # off unless the settings ask (docs/benchmarks.md)
    assert fill_plan.settings(tmp_path / "page-fill.json").map_staging is False
    assert fill_plan.plan(folder, map_staging=True).mapped != {}
    (folder / staging.NAME).write_text("{not json")
    assert fill_plan.plan(folder, map_staging=True).mapped == {}  # unreadable: every page written


def test_the_driver_is_not_asked_to_restore_a_staging_still_empty(state):
    pid = os.getpid()
    staging.hold(pid, [(A, PAGE, "/nowhere", 0)])
    driver = FakeDriver({pid: ProcessState.CHECKPOINTED})
    with pytest.raises(QuiesceError, match="not back in host memory"):
        resume(driver, [pid])
    assert ("restore", pid) not in driver.calls
    staging.release(pid)
    assert resume(driver, [pid]) == [pid]


def test_a_marker_of_a_process_long_gone_holds_no_other(state):
    pid = os.getpid()
    staging.hold(pid, [(A, PAGE, "/nowhere", 0)])
    marker = json.loads(staging._marker(pid).read_text())
    staging._marker(pid).write_text(json.dumps({**marker, "start": marker["start"] - 1}))
    assert staging.held(pid) is None


@pytest.mark.skipif(not remote_syscall.supported(), reason="x86-64 only")
def test_post_restore_holds_the_staging_and_post_resume_maps_it(tmp_path, state, child):
    proc, base, size = child
    folder = tmp_path / "images"
    memory = _task(folder, proc.pid, 1, [(base, base + size, PLAIN)],
                   [(base, size // PAGE, pm.PE_PRESENT)], random.Random(9))
    data = b"".join(memory[a] for a in sorted(memory))
    _record(folder, proc.pid, [(base + (1 << 20), base + size)])
    fill_plan.prepare(folder, lambda p: action.write_private(step_state.fill(4250), p.to_json()),
                      map_staging=True)
    action.post_restore(init_pid=proc.pid, criu_pid=4250)
    assert _memory_of(proc.pid, base, 1 << 20) == data[:1 << 20]  # written
    assert staging.held(proc.pid)  # the rest waits for post-resume
    remote_map.put_back(staging.held_under(proc.pid), proc.pid, "test")
    assert _memory_of(proc.pid, base, size) == data
    assert staging.held(proc.pid) is None
    pages = os.path.realpath(folder / "pages-1.img")
    assert any(line.endswith(pages) and int(line.split("-")[0], 16) == base + (1 << 20)
               for line in open(f"/proc/{proc.pid}/maps").read().splitlines())  # mapped, not written
    event = json.loads((state / "journal.jsonl").read_text().splitlines()[-1])
    assert event["event"] == "pages-mapped" and event["mapped"] == [proc.pid]
    assert event["bytes"] == size - (1 << 20) and event["written"] == []


def test_resume_onto_refuses_an_empty_staging_once_not_per_gpu_choice(state):
    pid = os.getpid()
    staging.hold(pid, [(A, PAGE, "/nowhere", 0)])
    driver = FakeDriver({pid: ProcessState.CHECKPOINTED})
    with pytest.raises(QuiesceError) as err:
        resume_onto(driver, [pid], [("every GPU", None), ("none", None)])
    assert str(err.value).count("not back in host memory") == 1, str(err.value)
    assert not any(call == "restore" for call, _ in driver.calls)
    staging.release(pid)


def test_an_unreadable_marker_holds_the_process_and_post_resume_says_so(state):
    pid = os.getpid()
    staging.hold(pid, [(A, PAGE, "/nowhere", 0)])
    staging._marker(pid).write_text("[1, 2]")
    assert staging.held(pid) == []
    with pytest.raises(GpusnapError, match="could not be put back into restored process"):
        remote_map.put_back(staging.held_in([pid]), pid, "test")
    assert staging.held(pid) == []  # still held: no driver restore of zeros
    staging.release(pid)


def test_a_dump_into_a_kept_folder_leaves_no_earlier_record(tmp_path):
    _record(tmp_path, 1, [(A, A + PAGE)])
    staging.forget(tmp_path)
    assert staging.recorded(tmp_path) == {}
    staging.forget(tmp_path)  # nothing to forget: no error


@pytest.mark.skipif(not remote_syscall.supported(), reason="x86-64 only")
def test_a_pages_file_with_other_links_is_written_not_mapped(tmp_path, state, child):
    """A replica's pages file linked from a prepared folder: the driver restored
    3x slower from such a mapping than from written staging (docs/benchmarks.md)."""
    proc, base, size = child
    data = random.Random(4).randbytes(size)
    path = tmp_path / "pages.img"
    path.write_bytes(data)
    os.link(path, tmp_path / "prepared.img")
    staging.hold(proc.pid, [(base, size, str(path), 0)])
    assert remote_map.put_back(staging.held_in([proc.pid]), proc.pid, "test") == {}
    assert _memory_of(proc.pid, base, size) == data
    assert str(path) not in open(f"/proc/{proc.pid}/maps").read()
    event = json.loads((state / "journal.jsonl").read_text().splitlines()[-1])
    assert event["written"] == [proc.pid] and "other links" in event["why"]


def test_with_nothing_marked_the_process_table_is_not_walked(state, monkeypatch):
    def walked(pid):
        raise AssertionError("process_tree walked with no staging marked")
    monkeypatch.setattr(staging, "process_tree", walked)
    assert staging.held_under(os.getpid()) == {}


@pytest.mark.skipif(not remote_syscall.supported(), reason="x86-64 only")
def test_what_the_driver_left_mapped_becomes_the_process_own(tmp_path, state, child):
    """Memory the application allocated while the driver checkpointed is
    recorded as staging too, and no driver restore unmaps it: a later change
    of the file (a kept folder patched once unlinked) must not show through."""
    proc, base, size = child
    data = random.Random(5).randbytes(size)
    path = tmp_path / "pages.img"
    path.write_bytes(data)
    staging.hold(proc.pid, [(base, size, str(path), 0)])
    mapped = remote_map.put_back(staging.held_in([proc.pid]), proc.pid, "test")
    assert mapped == {proc.pid: {(path.stat().st_dev, path.stat().st_ino)}}
    with open(path, "r+b") as f:  # the private mapping shows the file's change...
        f.write(b"patched")
    assert _memory_of(proc.pid, base, 7) == b"patched"
    with open(path, "r+b") as f:
        f.write(data[:7])
    remote_map.let_go(mapped, proc.pid, "test")
    with open(path, "r+b") as f:  # ...no more once every page is the process's own
        f.write(b"patched")
    assert _memory_of(proc.pid, base, size) == data
    event = json.loads((state / "journal.jsonl").read_text().splitlines()[-1])
    assert event["event"] == "staging-left-mapped" and event["bytes"] == size
    assert event["copied"] is True and event["error"] is None
    remote_map.let_go({proc.pid: {(0, 1)}}, proc.pid, "test")  # nothing maps that file
    assert json.loads((state / "journal.jsonl").read_text().splitlines()[-1]) == event


def test_a_replica_whose_copy_failed_keeps_no_pages_for_the_next(state, tmp_path):
    """A kept pages file may be patched in place later (prepared_pages.use): not
    one a restored process may still map."""
    from gpusnap import journal
    from gpusnap.ops import restore_ref
    pid = os.getpid()
    (tmp_path / "page-fill.json").write_text('{"map_staging": true}')
    assert not restore_ref._maybe_still_mapped(pid)
    journal.record("staging-left-mapped", init_pid=pid, pid=pid, by="test", bytes=PAGE,
                   copied=True, error=None)
    assert not restore_ref._maybe_still_mapped(pid)
    journal.record("staging-left-mapped", init_pid=pid, pid=pid, by="test", bytes=PAGE,
                   copied=False, error="madvise at 0x1000: Invalid argument")
    assert restore_ref._maybe_still_mapped(pid)
    assert not restore_ref._maybe_still_mapped(pid + 1)  # another restore's
    (tmp_path / "page-fill.json").write_text("{}")
    assert not restore_ref._maybe_still_mapped(pid)  # the default path maps nothing
    (tmp_path / "page-fill.json").write_text('{"map_staging": true}')
    journal.record("failed", action="post-resume", init_pid=pid + 1, error="refused")
    assert restore_ref._maybe_still_mapped(pid + 1)  # failed before the copy was made
    (tmp_path / "page-fill.json").write_text("{not json")
    assert restore_ref._maybe_still_mapped(pid + 2)  # unreadable settings: keep nothing
