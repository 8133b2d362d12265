"""runtime/step_agent.py with action/agent.py and packaging/bin/criu-action: the
agent `gpusnap restore` starts before Podman, named in the images, takes CRIU's
pre-restore (the real script asks it; a child of this test plays CRIU) and is
that CRIU's agent from then on; where it is gone, the step is Python's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpusnap.action import action, agent_files
from gpusnap.gpu import turn
from gpusnap.runtime import step_agent
from tests.unit.test_agent import SCRIPT, _gone, _ready, state  # noqa: F401 -- a fixture

# CRIU, as the script sees it: runs the script once, prints its exit code and
# what it wrote, then lives until its stdin closes
CRIU = """
import os, subprocess, sys
r = subprocess.run(["bash", sys.argv[1]], capture_output=True, text=True, timeout=120)
print(r.returncode, flush=True)
print(json.dumps(r.stderr), flush=True)
sys.stdin.read()
""".replace("import os,", "import json, os,")


def _criu(images: Path, state: Path) -> tuple[subprocess.Popen, int, str]:
    env = {**os.environ, "CRTOOLS_SCRIPT_ACTION": "pre-restore", "CRTOOLS_INIT_PID": "",
           "CRTOOLS_IMAGE_DIR": str(images), "GPUSNAP_STATE_DIR": str(state)}
    criu = subprocess.Popen([sys.executable, "-c", CRIU, str(SCRIPT)], env=env, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    code = int(criu.stdout.readline())
    return criu, code, json.loads(criu.stdout.readline())


def _events(state: Path) -> list[dict]:
    journal = state / "journal.jsonl"
    return [json.loads(line) for line in journal.read_text().splitlines()] \
        if journal.exists() else []


def _images(tmp_path: Path, early: step_agent.EarlyAgent) -> Path:
    images = tmp_path / "images"
    images.mkdir()
    (images / action.MANIFEST_NAME).write_text("{}")  # a GPU checkpoint's
    (images / step_agent.AGENT_FILE).write_text(early.name)
    return images


def test_pre_restore_goes_to_the_agent_the_cli_started_which_is_then_crius(tmp_path, state):
    early = step_agent.start(driver=False)
    images = _images(tmp_path, early)
    criu, code, said = _criu(images, state)
    try:
        assert code == 0, said
        # CRIU's agent now: its folder, the restore's turn (keyed by CRIU's parent)
        assert _ready(criu.pid) == early.proc.pid
        assert turn.holder(os.getpid()) == (early.proc.pid, "restore")
        assert not step_agent.early_folder(early.name).exists()
        assert not (images / step_agent.AGENT_FILE).exists()  # no later checkpoint carries it
        assert [e["criu_pid"] for e in _events(state) if e["event"] == "agent-taken"] == [criu.pid]
        kept = json.loads((state / "actions" / f"{criu.pid}-restore.json").read_text())
        assert kept[action.MANIFEST_NAME] == "{}"  # pre-restore's work, for post-resume
        early.done()  # the CLI's restore is over: CRIU's agent stays with CRIU
        time.sleep(0.3)
        assert early.proc.poll() is None
    finally:
        criu.stdin.close()
        criu.wait(timeout=30)
    # CRIU gone: it leaves, and lets go of the turn
    assert _gone(agent_files.folder(criu.pid))
    early.proc.wait(timeout=15)
    free = turn.try_take(os.getpid(), "test")
    assert free is not None
    free.release()


def test_an_agent_crius_never_asked_leaves_when_the_restore_ends(state):
    early = step_agent.start(driver=False)
    here = step_agent.early_folder(early.name)
    deadline = time.monotonic() + 30
    while not (here / "pid").exists() and time.monotonic() < deadline:
        time.sleep(0.02)  # reading requests: the CLI's "leave" is read, not lost
    early.done()
    early.proc.wait(timeout=15)
    assert not here.exists()


@pytest.mark.skipif(not Path("/opt/gpusnap/venv/bin/gpusnap-criu-action").exists(),
                    reason="the script's Python is gpusnap's install (make install)")
def test_a_gone_agent_leaves_pre_restore_to_python(tmp_path, state):
    early = step_agent.start(driver=False)
    early.proc.kill()
    early.proc.wait()
    images = _images(tmp_path, early)
    started = time.monotonic()
    criu, code, said = _criu(images, state)
    criu.stdin.close()
    criu.wait(timeout=30)
    assert code == 0, said
    assert time.monotonic() - started < 10
    assert not [e for e in _events(state) if e["event"] == "agent-taken"]
    assert (state / "actions" / f"{criu.pid}-pre-restore").read_text() == "0"  # Python's marker


def test_a_restore_ref_starts_it_where_pre_restore_would_start_one(monkeypatch, tmp_path):
    from types import SimpleNamespace

    from gpusnap.ops import restore_ref
    from gpusnap.pages import fill_plan

    started = []
    monkeypatch.setattr(step_agent, "start", lambda driver: started.append(driver) or "agent")
    monkeypatch.setattr(fill_plan, "SETTINGS", tmp_path / "page-fill.json")

    def remote(manifest, size):
        return SimpleNamespace(bundle=SimpleNamespace(gpu_manifest=manifest, total_bytes=size))

    assert restore_ref._early_agent(remote({"schema": 1}, 1 << 20)) == "agent"
    assert restore_ref._early_agent(remote(None, 1 << 30)) == "agent"
    assert restore_ref._early_agent(remote(None, 1 << 20)) is None  # no fill: no agent
    fill_plan.SETTINGS.write_text('{"agent": false}')
    assert restore_ref._early_agent(remote({"schema": 1}, 1 << 20)) is None
    assert started == [True, False]


def test_an_agent_the_restore_ended_before_it_read_requests_is_stopped(state):
    early = step_agent.start(driver=False)
    early.done()  # at once: still importing (stopped), or reading (told to leave)
    early.proc.wait(timeout=15)
    deadline = time.monotonic() + 5
    while step_agent.early_folder(early.name).exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not step_agent.early_folder(early.name).exists()


def test_a_pre_restore_with_no_later_step_for_it_leaves_no_folder_behind(tmp_path, state):
    """A CPU checkpoint without a fill: pre-restore would start no agent, so the
    one the CLI started answers and leaves; runc's hook never finds its folder."""
    early = step_agent.start(driver=False)
    images = tmp_path / "images"
    images.mkdir()
    (images / step_agent.AGENT_FILE).write_text(early.name)
    criu, code, said = _criu(images, state)
    try:
        assert code == 0, said
        assert not agent_files.folder(criu.pid).exists()
        assert [e["criu_pid"] for e in _events(state) if e["event"] == "agent-taken"] == [criu.pid]
        early.proc.wait(timeout=15)
    finally:
        criu.stdin.close()
        criu.wait(timeout=30)


@pytest.mark.skipif(not Path("/opt/gpusnap/venv/bin/gpusnap-criu-action").exists(),
                    reason="the script's Python is gpusnap's install (make install)")
def test_an_agent_gone_mid_take_leaves_the_step_and_its_folder_to_python(tmp_path, state):
    """Killed after it moved into CRIU's folder, before it answered: the script
    removes that folder (else Python's pre-restore would take it for a live
    agent's and start none) and runs the step itself."""
    import threading

    stand_in = subprocess.Popen(["sleep", "60"])  # the agent, while it lives
    name = step_agent.early_name(stand_in.pid, "ab12")
    here = step_agent.early_folder(name)
    here.mkdir(parents=True)
    os.mkfifo(here / "requests", 0o600)
    fd = os.open(here / "requests", os.O_RDWR)
    (here / "pid").write_text(str(stand_in.pid))
    images = tmp_path / "images"
    images.mkdir()
    (images / step_agent.AGENT_FILE).write_text(name)

    def take_then_die() -> None:
        criu_pid = int(os.read(fd, 4096).split()[1])
        agent_files.folder(criu_pid).mkdir()
        (agent_files.folder(criu_pid) / "started").write_text(str(stand_in.pid))
        stand_in.kill()
        stand_in.wait()

    threading.Thread(target=take_then_die, daemon=True).start()
    criu, code, said = _criu(images, state)
    criu.stdin.close()
    criu.wait(timeout=30)
    os.close(fd)
    assert code == 0, said
    assert not agent_files.folder(criu.pid).exists()
    assert (state / "actions" / f"{criu.pid}-pre-restore").read_text() == "0"  # Python's marker


def test_the_nvml_read_of_an_agent_the_cli_started_lands_in_crius_folder(tmp_path, state):
    """Read as the agent starts, before it has CRIU's folder: written there at the
    take, for runc's hook (here, without a GPU, the read's failure: the hook then
    reads NVML itself)."""
    early = step_agent.start(driver=True)
    images = _images(tmp_path, early)
    criu, code, said = _criu(images, state)
    try:
        assert code == 0, said
        here = agent_files.folder(criu.pid)
        deadline = time.monotonic() + 30
        while not any((here / f).exists() for f in (agent_files.INVENTORY,
                                                     agent_files.NO_INVENTORY)):
            assert time.monotonic() < deadline, sorted(p.name for p in here.iterdir())
            time.sleep(0.02)
        assert not list(step_agent.early_folder(early.name).parent.glob("*-early-*"))
    finally:
        criu.stdin.close()
        criu.wait(timeout=30)
    assert _gone(agent_files.folder(criu.pid))
    early.proc.wait(timeout=15)
