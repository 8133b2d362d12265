"""Memory read out ahead of CRIU's dump on many threads (gpusnap/pages/dump_ahead.py).

On a GPU host pre-dump takes the driver's copy of the GPU memory; here, with no
GPU, GPUSNAP_DUMP_AHEAD_TEST_MIN has it take a CPU container's big anonymous
memory instead (the test container never writes it), through the same steps:
read into the push's RAM folder, dropped from the process inside it (ptrace),
CRIU's pages composed around it at post-dump, written back by the guardian
into a process that lives on (a dump that failed). Real Podman, runc, CRIU
and registry."""

from __future__ import annotations

import json
import subprocess
import uuid

import pytest

from gpusnap.criu.runtimes import runs_action_script
from tests.conftest import (GPUSNAP, assert_one_line_error, journal_mark, journal_since, run,
                            wait_counter)
from tests.integration.oci_registry import PASSWORD
from tests.integration.test_page_fill import _runtime
from tests.integration.test_segments import _events_since, _md5_of_memory, _start_big_memory

pytestmark = pytest.mark.usefixtures("cache_dir")


@pytest.fixture(autouse=True)
def ahead(monkeypatch):
    monkeypatch.setenv("GPUSNAP_PROCESSES", "2")
    monkeypatch.setenv("GPUSNAP_PAGES_RAM", "1")  # the read-ahead goes where pages go to RAM
    monkeypatch.setenv("GPUSNAP_DUMP_AHEAD_TEST_MIN", str(128 << 20))


def _gs(registry, *args: str) -> dict:
    """gpusnap VERB ... --json against the test registry; its JSON."""
    res = run([GPUSNAP, *args, *registry.flags(), "--json"], input=PASSWORD + "\n")
    assert res.returncode == 0, (res.stdout, res.stderr)
    return json.loads(res.stdout)


def _ref(registry) -> str:
    return registry.ref(f"ckpt/ahead-{uuid.uuid4().hex[:8]}:v1")


def _event(events: list[dict], kind: str) -> dict:
    found = [e for e in events if e["event"] == kind]
    assert found, [e["event"] for e in events]
    return found[-1]


def test_memory_read_ahead_is_in_the_pushed_images_and_restores_whole(registry, name):
    """migrate: pre-dump reads the ~280 MB and drops it from the shell, CRIU
    dumps the rest, post-dump composes the pages file in place; the restored
    shell's memory is what it was."""
    before = _start_big_memory(name)
    mark = journal_mark()
    pushed = _gs(registry, "migrate", name, _ref(registry))
    events = journal_since(mark)
    if runs_action_script(_runtime()):
        taken = _event(events, "pages-read-ahead")
        assert taken["bytes"] >= 256 << 20, taken
        composed = _event(events, "pages-composed")
        assert composed["how"] == ["in place"], composed  # CRIU dumped what was predicted around it
    else:  # no action script (trixie's crun 1.21): CRIU dumps it all, as before
        assert "pages-read-ahead" not in [e["event"] for e in events], events
    subprocess.run(["podman", "rm", name], check=True, capture_output=True)
    _gs(registry, "restore", pushed["pinned"])
    assert _md5_of_memory(name) == before
    wait_counter(name, 3, timeout=30)


def test_a_container_that_runs_on_is_dumped_by_criu(registry, name):
    """push (the container keeps running): nothing is read ahead, since the
    memory would have to go back before the process runs on; the restored
    copy and the source have the memory."""
    before = _start_big_memory(name)
    mark = journal_mark()
    pushed = _gs(registry, "push", name, _ref(registry))
    events = _events_since(mark)
    assert "pages-read-ahead" not in events, events
    # the pages did go to the push's folder, where the runtime runs the action script
    assert ("pages-aside" in events) == runs_action_script(_runtime()), events
    assert _md5_of_memory(name) == before  # the source, running on
    copy = f"{name}-copy"
    try:
        _gs(registry, "restore", pushed["pinned"], "--name", copy)
        assert _md5_of_memory(copy) == before
    finally:
        subprocess.run(["podman", "rm", "-f", "-t", "0", copy], capture_output=True)


def test_a_failure_after_the_memory_was_taken_leaves_the_container_as_it_was(
        registry, name, monkeypatch):
    """post-dump fails to compose the images (injected): CRIU fails the dump and
    resumes the shell, the guardian puts its memory back; one line says so."""
    before = _start_big_memory(name)
    monkeypatch.setenv("GPUSNAP_DUMP_AHEAD_TEST_FAULT", "compose")
    mark = journal_mark()
    res = run([GPUSNAP, "migrate", name, _ref(registry), *registry.flags()], input=PASSWORD + "\n")
    if not runs_action_script(_runtime()):  # nothing read ahead (trixie's crun 1.21): nothing fails
        assert res.returncode == 0, (res.stdout, res.stderr)
        assert "pages-read-ahead" not in _events_since(mark)
        return
    assert_one_line_error(res, "still running")
    assert "pages-read-ahead" in _events_since(mark)
    assert _event(journal_since(mark), "guardian-wrote-back")
    assert _md5_of_memory(name) == before
    wait_counter(name, 3, timeout=30)


def test_the_final_round_writes_over_the_pages_round_one_kept(registry, name):
    """migrate -P keeps round 1's pages file in RAM (pages/kept_pages.py); the
    final round's read-ahead takes it over and writes into its memory instead
    of new memory, finds it unchanged, and the push takes round 1's chunks for
    it without hashing them (pages/same_pages.py). The kept folder is gone
    after, and the restored shell's memory is whole. Without an action script (trixie's crun 1.21) nothing is
    kept or read ahead, and the restore is as whole."""
    action = runs_action_script(_runtime())
    _start_big_memory(name)
    ref = _ref(registry)
    mark = journal_mark()
    _gs(registry, "migrate", "-P", name, ref)
    events = journal_since(mark)
    if action:
        kept = _event(events, "pages-kept")
        assert kept["files"] == 1 and kept["bytes"] >= 256 << 20, kept
        assert subprocess.run(["test", "-d", kept["folder"]]).returncode == 0
    else:
        assert "pages-kept" not in [e["event"] for e in events], events
    before = _md5_of_memory(name)
    mark = journal_mark()
    pushed = _gs(registry, "migrate", name, ref)
    events = journal_since(mark)
    if action:
        taken = _event(events, "pages-read-ahead")
        assert taken["reused"] >= 256 << 20, taken
        # the memory did not change: round 1's chunks taken for it, unhashed (same_pages.py)
        assert taken["unchanged"] >= 256 << 20, taken
        assert pushed["unchanged_bytes"] >= 192 << 20, pushed
        assert _event(events, "pages-composed")["how"] == ["in place"]
        assert subprocess.run(["test", "-e", kept["folder"]]).returncode == 1  # claimed, spent
    else:
        assert "pages-read-ahead" not in [e["event"] for e in events], events
    subprocess.run(["podman", "rm", name], check=True, capture_output=True)
    _gs(registry, "restore", pushed["pinned"])
    assert _md5_of_memory(name) == before
    wait_counter(name, 3, timeout=30)


def test_a_final_round_over_memory_built_anew_restores_the_final_rounds_memory(registry, name):
    """Between the rounds the shell builds its 280 MB string anew with its last
    character changed (new memory, round 1's freed): the final round's read
    compares the driver's-copy stand-in with round 1's kept file and finds what
    it finds; whatever the push then takes as round 1's chunks, the restored
    shell holds the final round's string, not round 1's."""
    action = runs_action_script(_runtime())
    _start_big_memory(name)
    ref = _ref(registry)
    _gs(registry, "migrate", "-P", name, ref)
    first = _md5_of_memory(name)
    subprocess.run(["podman", "exec", name, "sh", "-c", "touch /tmp/flip"], check=True)
    before = _md5_of_memory(name)  # the loop flips before it answers: in that order
    assert before != first
    mark = journal_mark()
    pushed = _gs(registry, "migrate", name, ref)
    events = journal_since(mark)
    if action:
        taken = _event(events, "pages-read-ahead")
        assert taken["reused"] >= 256 << 20, taken  # round 1's file was written over
        assert 0 <= taken["unchanged"] <= taken["bytes"], taken
    subprocess.run(["podman", "rm", name], check=True, capture_output=True)
    _gs(registry, "restore", pushed["pinned"])
    assert _md5_of_memory(name) == before
    wait_counter(name, 3, timeout=30)


def test_a_final_round_whose_pages_moved_takes_round_ones_chunks_where_they_moved(registry, name):
    """Between the rounds the shell makes a 4 MB string besides its big one:
    new memory below it, which CRIU dumps first, so in the final round's pages
    file the big string lies 4 MB further on than in round 1's. The read finds
    by how much, compares it there, and the push's workers take round 1's
    chunks moved by that much; the restored shell's memory is whole."""
    action = runs_action_script(_runtime())
    _start_big_memory(name)
    ref = _ref(registry)
    _gs(registry, "migrate", "-P", name, ref)
    subprocess.run(["podman", "exec", name, "sh", "-c", "touch /tmp/grow"], check=True)
    before = _md5_of_memory(name)  # asked after the string is made: the loop does both in order
    mark = journal_mark()
    pushed = _gs(registry, "migrate", name, ref)
    events = journal_since(mark)
    if action:
        taken = _event(events, "pages-read-ahead")
        assert taken["moved_by"], taken  # the layout moved: what this test is about
        assert taken["unchanged"] >= 256 << 20, taken
        # no segment is round 1's whole, but the workers' cuts land on round 1's chunks
        assert pushed["unchanged_bytes"] >= 192 << 20, pushed
    subprocess.run(["podman", "rm", name], check=True, capture_output=True)
    _gs(registry, "restore", pushed["pinned"])
    assert _md5_of_memory(name) == before
    wait_counter(name, 3, timeout=30)

