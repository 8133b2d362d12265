"""action/agent.py with packaging/bin/criu-action: post-restore handed to the agent
that pre-restore starts, run by the real script (this test process plays CRIU:
the script's parent), the fill written into a real child process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpusnap.action import action, agent, agent_files, step_state
from gpusnap.pages import fill_plan
from gpusnap.private import private_dir
from gpusnap.procs import start_time
from tests.unit.test_fill_plan import _memory_of, _planned, child  # noqa: F401 -- a fixture

SCRIPT = Path(__file__).resolve().parents[2] / "packaging" / "bin" / "criu-action"


@pytest.fixture
def state(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUSNAP_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setattr(fill_plan, "SETTINGS", tmp_path / "page-fill.json")
    monkeypatch.setattr(fill_plan, "MIN_TOTAL", 8 * 4096)  # the child's 3 MiB is worth filling
    # this test plays a CRIU whose first step ran the script (which wrote its start
    # time): the names it gives its later steps are its own, not a dead CRIU's
    actions = private_dir(tmp_path / "state" / "actions")
    (actions / f"{os.getpid()}-born").write_text(str(start_time(os.getpid())))
    return tmp_path / "state"


def _script(step: str, init_pid: int, state: Path, **extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "CRTOOLS_SCRIPT_ACTION": step, "CRTOOLS_INIT_PID": str(init_pid),
           "CRTOOLS_IMAGE_DIR": "", "GPUSNAP_STATE_DIR": str(state), **extra}
    return subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True,
                          timeout=60)


def _ready(criu_pid: int, timeout: float = 30) -> int:
    deadline = time.monotonic() + timeout
    pid_file = agent_files.folder(criu_pid) / "pid"
    while time.monotonic() < deadline:
        if pid_file.exists() and pid_file.read_text():
            return int(pid_file.read_text())
        time.sleep(0.02)
    raise AssertionError("the agent did not start")


def _gone(path: Path, timeout: float = 15) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and path.exists():
        time.sleep(0.05)
    return not path.exists()


def test_post_restore_goes_to_the_agent_which_fills_and_answers(tmp_path, state, child):
    proc, base, size = child
    me = os.getpid()  # CRIU, as the script sees it: its parent
    folder, data = _planned(tmp_path, proc.pid, base, size, criu_pid=me)
    agent_files.start(me, driver=False)
    _ready(me)
    res = _script("post-restore", proc.pid, state)
    assert res.returncode == 0, res.stderr
    assert _memory_of(proc.pid, base, size) == data, (state / "journal.jsonl").read_text()
    assert not (folder / fill_plan.FOLDER).exists()  # the folder put back
    events = [json.loads(line) for line in (state / "journal.jsonl").read_text().splitlines()]
    filled = [e for e in events if e["event"] == "pages-filled"]
    assert filled and filled[-1]["by"] == "agent" and filled[-1]["bytes"] == size
    assert (state / "actions" / f"{me}-post-restore").read_text() == "0"  # the marker, as the script's
    # post-resume (nothing on a GPU here) is its last step: it leaves, its folder with it
    assert _script("post-resume", proc.pid, state).returncode == 0
    assert _gone(agent_files.folder(me))


def _filled_by(state: Path) -> str:
    events = [json.loads(line) for line in (state / "journal.jsonl").read_text().splitlines()]
    return [e for e in events if e["event"] == "pages-filled"][-1]["by"]


def test_a_step_that_comes_before_the_agent_is_ready_waits_for_it(tmp_path, state, child):
    """crun runs no hook between pre-restore and post-restore: the step may come
    while the agent still imports."""
    proc, base, size = child
    me = os.getpid()
    _, data = _planned(tmp_path, proc.pid, base, size, criu_pid=me)
    agent_files.start(me, driver=False)  # no wait: the script comes at once
    assert _script("post-restore", proc.pid, state).returncode == 0
    assert _memory_of(proc.pid, base, size) == data and _filled_by(state) == "agent"
    _script("post-resume", proc.pid, state)


@pytest.mark.skipif(not Path("/opt/gpusnap/venv/bin/gpusnap-criu-action").exists(),
                    reason="the script's Python is gpusnap's install (make install)")
def test_an_agent_that_died_starting_leaves_the_step_to_python(tmp_path, state, child):
    proc, base, size = child
    me = os.getpid()
    _, data = _planned(tmp_path, proc.pid, base, size, criu_pid=me)
    dead = subprocess.Popen(["true"])
    dead.wait()
    agent_files.folder(me).mkdir(parents=True)
    (agent_files.folder(me) / "started").write_text(str(dead.pid))
    started = time.monotonic()
    assert _script("post-restore", proc.pid, state).returncode == 0
    assert time.monotonic() - started < 10
    assert _memory_of(proc.pid, base, size) == data and _filled_by(state) == "script"


def test_a_step_the_agent_fails_fails_with_its_words(tmp_path, state, child):
    proc, base, size = child
    me = os.getpid()
    folder, _ = _planned(tmp_path, proc.pid, base, size, criu_pid=me)
    os.truncate(folder / "pages-1.img", 4096)  # the pages went missing under the restore
    agent_files.start(me, driver=False)
    _ready(me)
    res = _script("post-restore", proc.pid, state)
    assert res.returncode == 1
    assert "could not write the restored memory" in res.stderr, res.stderr
    assert not (folder / fill_plan.FOLDER).exists()
    _script("post-resume", proc.pid, state)  # let it leave


def test_an_agent_that_stops_with_the_step_in_its_hands_fails_the_step(state):
    """Never the step again in Python: it may be half done."""
    me = os.getpid()
    here = agent_files.folder(me)
    here.mkdir(parents=True)
    os.mkfifo(here / "requests", 0o600)
    # takes the request, never answers, goes; left unreaped as a zombie, as a
    # subreaper (conmon) may leave an agent that died: the script must see it gone
    fake = subprocess.Popen(["sleep", "1"])
    (here / "pid").write_text(str(fake.pid))
    (state / "actions" / f"{me}-fill.json").write_text("{}")  # post-restore has work
    started = time.monotonic()
    res = _script("post-restore", 1, state)
    fake.wait()
    assert res.returncode == 1 and "agent" in res.stderr and "stopped" in res.stderr, res.stderr
    assert time.monotonic() - started < 10
    assert not list(here.glob("reply.*"))


def test_the_agent_leaves_when_criu_does(state):
    criu = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        agent_files.start(criu.pid, driver=False)
        _ready(criu.pid)
    finally:
        criu.kill()
        criu.wait()
    assert _gone(agent_files.folder(criu.pid))


def test_pre_restore_starts_the_agent_where_there_is_a_fill(tmp_path, state, monkeypatch, child):
    proc, base, size = child
    started = []
    monkeypatch.setattr(action, "_start_agent", lambda pid, driver: started.append((pid, driver)))
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setenv("CRTOOLS_IMAGE_DIR", str(empty))
    assert action._run("pre-restore", 4321) == 0
    assert started == []  # nothing to fill
    (tmp_path / "big").mkdir()
    folder, _ = _planned(tmp_path / "big", proc.pid, base, size, criu_pid=99)
    fill_plan.undo(folder)  # as CRIU left it: pre-restore plans it again
    monkeypatch.setenv("CRTOOLS_IMAGE_DIR", str(folder))
    assert action._run("pre-restore", 4322) == 0
    assert started == [(4322, False)]
    fill_plan.undo(folder)
    (folder / action.MANIFEST_NAME).write_text("{}")  # a GPU checkpoint: the driver loaded ahead
    assert action._run("pre-restore", 4323) == 0
    assert started == [(4322, False), (4323, True)]
    fill_plan.undo(folder)
    monkeypatch.setattr(fill_plan, "SETTINGS", tmp_path / "page-fill.json")
    fill_plan.SETTINGS.write_text('{"agent": false}')  # each step in a Python of its own
    assert action._run("pre-restore", 4324) == 0
    assert started == [(4322, False), (4323, True)]
    assert (step_state.fill(4324)).exists()  # the fill itself still planned
    fill_plan.undo(folder)


def test_a_gpu_restores_agent_holds_its_turn_until_post_resume_so_doctor_leaves_it(
        state, monkeypatch):
    """pre-restore of a GPU checkpoint hands the agent the restore's turn, keyed by
    the runtime that started CRIU (runc restores the tree as CRIU's sibling: here
    this test's parent plays runc, this test CRIU, a child of it a restored task).
    doctor --fix leaves the task alone until post-resume is done, then fixes it."""
    from gpusnap.gpu import turn
    from gpusnap.ops import doctor
    from gpusnap.procs import parent_of
    me, runtime = os.getpid(), parent_of(os.getpid())
    task = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                            stdin=subprocess.PIPE)
    resumed: list[list[int]] = []
    monkeypatch.setattr(doctor, "stuck_processes",
                        lambda: [{"pid": task.pid, "comm": "python3", "state": "CHECKPOINTED"}])
    monkeypatch.setattr(doctor, "load_driver", lambda: object())
    monkeypatch.setattr(doctor, "resume", lambda driver, pids: resumed.append(pids) or pids)
    try:
        action._start_agent(me, driver=True)
        agent_pid = _ready(me)
        assert turn.key_for(task.pid) == runtime
        assert turn.holder(runtime) == (agent_pid, "restore")
        check, _, fixed = doctor._gpu_processes_check(fix=True)
        assert resumed == [] and fixed == [] and check.ok
        assert f"left to gpusnap's restore (pid {agent_pid}), at work on pid {task.pid}" \
            in check.detail
        assert _script("post-resume", task.pid, state).returncode == 0  # no CUDA here: done
        assert _gone(agent_files.folder(me))
        # the agent removes its folder, then lets go of the turn as it exits
        free = None
        deadline = time.monotonic() + 15
        while free is None and time.monotonic() < deadline:
            free = turn.try_take(runtime, "test")
            time.sleep(0 if free else 0.02)
        assert free is not None, turn.holder(runtime)
        free.release()
        free.close()
        _, _, fixed = doctor._gpu_processes_check(fix=True)
        assert fixed == [task.pid]
        assert list((state / "turns").iterdir()) == []
    finally:
        task.stdin.close()
        task.wait(timeout=10)


def test_pre_restore_of_a_gpu_checkpoint_starts_the_agent_without_a_fill(
        tmp_path, state, monkeypatch):
    started = []
    monkeypatch.setattr(action, "_start_agent", lambda pid, driver: started.append((pid, driver)))
    folder = tmp_path / "images"
    folder.mkdir()
    (folder / action.MANIFEST_NAME).write_text("{}")
    monkeypatch.setenv("CRTOOLS_IMAGE_DIR", str(folder))
    assert action._run("pre-restore", 4325) == 0
    assert started == [(4325, True)] and not step_state.fill(4325).exists()
    fill_plan.SETTINGS.write_text('{"agent": false}')
    assert action._run("pre-restore", 4326) == 0
    assert started == [(4325, True)]


def test_a_gpu_restores_agent_starts_before_the_pages_are_put_in_place(
        tmp_path, state, monkeypatch):
    """Its Python, libcuda and NVML load while pre-restore moves and plans the
    pages: runc's hook, next in CRIU's stop, waits for its NVML read."""
    from gpusnap.pages import pages_aside
    order = []
    monkeypatch.setattr(action, "_start_agent", lambda pid, driver: order.append("agent"))
    real_bring_back = pages_aside.bring_back
    monkeypatch.setattr(pages_aside, "bring_back",
                        lambda folder: order.append("pages") or real_bring_back(folder))
    monkeypatch.setattr(action, "_plan_fill", lambda *a: order.append("fill planned"))
    folder = tmp_path / "images"
    folder.mkdir()
    (folder / action.MANIFEST_NAME).write_text("{}")
    monkeypatch.setenv("CRTOOLS_IMAGE_DIR", str(folder))
    assert action._run("pre-restore", 4327) == 0
    assert order == ["agent", "pages", "fill planned"]
    order.clear()
    (folder / action.MANIFEST_NAME).unlink()  # a CPU checkpoint: only where a fill was planned
    assert action._run("pre-restore", 4328) == 0
    assert order == ["pages", "fill planned"]


INVENTORY = {"driver_version": "580.159.04", "cuda_driver_version": "13.0",
             "gpus": [{"index": 0, "uuid": "GPU-aaaa", "name": "NVIDIA H200", "minor": 0,
                       "pci_bus_id": "0000:01:00.0", "memory_total": 150 << 30,
                       "memory_used": 1 << 30, "compute_capability": "9.0",
                       "mig_enabled": False}],
             "process_memory": {"77": {"GPU-aaaa": 1 << 30}}, "error": None, "unanswered": False}

HOOK_READS = ("from gpusnap.action.prestart import agent_inventory as f; "
              "inv = f(wait_s=0.3); print(inv.to_dict() if inv else None)")


def test_the_hook_takes_the_gpus_the_agent_of_its_sibling_criu_read(state):
    """runc starts CRIU and the hook: the agent's CRIU is the hook's sibling."""
    from gpusnap.gpu.inventory import Inventory

    assert Inventory.from_dict(INVENTORY).to_dict() == INVENTORY
    criu = subprocess.Popen(["sleep", "30"])  # a sibling of the hook below: ours both
    stranger = 1  # init's agent: no sibling of anyone here
    try:
        for pid in (criu.pid, stranger):
            agent_files.folder(pid).mkdir(parents=True)
            (agent_files.folder(pid) / agent_files.INVENTORY).write_text(json.dumps(INVENTORY))
        res = subprocess.run([sys.executable, "-c", HOOK_READS], capture_output=True, text=True,
                             env={**os.environ, "GPUSNAP_STATE_DIR": str(state)}, check=True)
        assert "GPU-aaaa" in res.stdout and "77" in res.stdout
        (agent_files.folder(criu.pid) / agent_files.INVENTORY).unlink()  # not read yet: the hook reads NVML
        res = subprocess.run([sys.executable, "-c", HOOK_READS], capture_output=True, text=True,
                             env={**os.environ, "GPUSNAP_STATE_DIR": str(state)}, check=True)
        assert res.stdout.strip() == "None"
        # the agent could not read NVML: the hook does not wait out wait_s for it
        (agent_files.folder(criu.pid) / agent_files.NO_INVENTORY).write_text("NVML: not found")
        started = time.monotonic()
        res = subprocess.run([sys.executable, "-c", HOOK_READS.replace("0.3", "20")],
                             capture_output=True, text=True,
                             env={**os.environ, "GPUSNAP_STATE_DIR": str(state)}, check=True)
        assert res.stdout.strip() == "None" and time.monotonic() - started < 10
    finally:
        criu.kill()
        criu.wait()


HOOK_PLANS = ("import json, pathlib; from gpusnap.action.prestart import plan_for_restore as f; "
              "problems, plan, inv = f(pathlib.Path('{manifest}'), {{}}, 0.3, "
              "pathlib.Path('{dev}')); print(json.dumps([problems, inv is not None]))")


def _manifest_on(uuid: str, path: Path, need: int = 1 << 30) -> Path:
    from gpusnap.gpu.manifest import Manifest, ManifestProcess

    gpu = {**INVENTORY["gpus"][0], "uuid": uuid}
    path.write_text(Manifest(gpus=[gpu], processes=[ManifestProcess(
        pid=7, comm="python3", gpus=[uuid], gpu_memory={uuid: need})],
        driver_version="580.159.04", cuda_driver_version="13.0", criu_version="4.1.1",
        quiesced_by="gpusnap").to_json())
    return path


def test_the_hook_reads_nvml_itself_where_the_agent_saw_too_few_gpus_to_place_it(
        state, tmp_path):
    """The agent runs in the container's device cgroup (runc puts CRIU there):
    NVML shows it the container's one GPU of the host's two. Where that GPU
    takes the checkpoint, its read is used; where it cannot and the host has
    more GPU nodes, the hook reads NVML itself (here: none, so it refuses)."""
    criu = subprocess.Popen(["sleep", "30"])
    dev = tmp_path / "dev"
    dev.mkdir()
    env = {**os.environ, "GPUSNAP_STATE_DIR": str(state)}

    def plans(manifest: Path) -> list:
        res = subprocess.run([sys.executable, "-c", HOOK_PLANS.format(manifest=manifest, dev=dev)],
                             capture_output=True, text=True, env=env, check=True)
        return json.loads(res.stdout)

    try:
        agent_files.folder(criu.pid).mkdir(parents=True)
        (agent_files.folder(criu.pid) / agent_files.INVENTORY).write_text(json.dumps(INVENTORY))
        (dev / "nvidia0").touch()
        (dev / "nvidia1").touch()
        (dev / "nvidiactl").touch()
        seen = _manifest_on("GPU-aaaa", tmp_path / "seen.json")
        assert plans(seen) == [[], True]  # its GPU takes it: the agent's read serves
        # a GPU like it, but the seen one has too little free (149 of 150 GiB)
        elsewhere = _manifest_on("GPU-bbbb", tmp_path / "elsewhere.json", need=(1495 << 30) // 10)
        problems, from_agent = plans(elsewhere)
        assert problems and not from_agent  # too few seen: NVML read again (none here)
        (dev / "nvidia1").unlink()  # the host has no more GPUs than the agent saw
        problems, from_agent = plans(elsewhere)
        assert problems and from_agent
    finally:
        criu.kill()
        criu.wait()


def test_an_answer_longer_than_a_pipe_holds_arrives_whole(tmp_path, state, monkeypatch):
    """A step that prints a lot (a failing fill's report): the answer is written
    blocking, as the script reads it, never cut at the pipe's 64 KiB."""
    import threading

    lines = [f"line {i} " + "x" * 100 for i in range(2000)]  # ~220 KB
    monkeypatch.setattr(action, "run_step", lambda *a, **k: print("\n".join(lines), file=sys.stderr) or 3)
    reply = tmp_path / "reply"
    os.mkfifo(reply, 0o600)
    fd = os.open(reply, os.O_RDWR)  # as the script: held open for reading
    got = bytearray()

    def read() -> None:
        while not got.endswith(b"=3\n"):
            got.extend(os.read(fd, 65536))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    assert agent._answer(f"post-restore 1 {reply} ", os.getpid(), None)
    reader.join(10)
    os.close(fd)
    text = got.decode().splitlines()
    assert text[-1] == "=3" and [t[1:] for t in text[:-1]] == lines


def test_the_script_takes_the_steps_marker_where_the_answer_never_comes(tmp_path, state):
    """An agent that ran the step (its marker says the code) but whose answer was
    lost: the script does not wait for it forever; CRIU gets the step's code."""
    import threading

    me = os.getpid()  # CRIU, as the script sees it; and the "agent", alive
    here = agent_files.folder(me)
    here.mkdir(parents=True)
    os.mkfifo(here / "requests", 0o600)
    fd = os.open(here / "requests", os.O_RDWR)
    (here / "pid").write_text(str(me))
    (state / "actions" / f"{me}-fill.json").write_text("{}")  # post-restore has work

    def run_but_never_answer() -> None:
        os.read(fd, 4096)
        (state / "actions" / f"{me}-post-restore").write_text("0")

    threading.Thread(target=run_but_never_answer, daemon=True).start()
    started = time.monotonic()
    res = _script("post-restore", 1, state)
    os.close(fd)
    assert res.returncode == 0, res.stderr
    assert "answer did not come" in res.stderr
    assert time.monotonic() - started < 5


def test_a_step_whose_agent_never_answers(tmp_path, state):
    """An agent that lives on, takes the request and never answers nor marks the
    step (a driver call that never returns): the step fails within its bound, in
    one line, so CRIU ends the restore instead of waiting with it."""
    import threading

    me = os.getpid()
    here = agent_files.folder(me)
    here.mkdir(parents=True)
    os.mkfifo(here / "requests", 0o600)
    fd = os.open(here / "requests", os.O_RDWR)
    (here / "pid").write_text(str(me))
    (state / "actions" / f"{me}-fill.json").write_text("{}")
    threading.Thread(target=os.read, args=(fd, 4096), daemon=True).start()  # taken, unanswered
    started = time.monotonic()
    res = _script("post-restore", 1, state, GPUSNAP_WAIT_AGENT="2")
    assert res.returncode == 1
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "did not answer within 2 s" in lines[0], res.stderr
    assert "the checkpoint is unchanged" in lines[0]
    assert time.monotonic() - started < 10
    # at post-resume CRIU has let the processes run: nothing stops, doctor brings them back
    threading.Thread(target=os.read, args=(fd, 4096), daemon=True).start()
    res = _script("post-resume", 1, state, GPUSNAP_WAIT_AGENT="2")
    os.close(fd)
    assert res.returncode == 1
    assert "the restored container runs" in res.stderr and "gpusnap doctor --fix" in res.stderr
    assert "unchanged" not in res.stderr, res.stderr


def test_an_agent_gone_after_its_step_was_done_is_no_failure(tmp_path, state):
    """The agent wrote the step's marker and stopped before its answer: CRIU gets
    the marker's code, not "the agent stopped before it finished"."""
    import threading

    me = os.getpid()
    here = agent_files.folder(me)
    here.mkdir(parents=True)
    os.mkfifo(here / "requests", 0o600)
    fd = os.open(here / "requests", os.O_RDWR)
    stand_in = subprocess.Popen(["sleep", "30"])  # the agent's pid while it lives
    (here / "pid").write_text(str(stand_in.pid))
    (state / "actions" / f"{me}-fill.json").write_text("{}")

    def run_then_die() -> None:
        os.read(fd, 4096)
        (state / "actions" / f"{me}-post-restore").write_text("0")
        stand_in.kill()
        stand_in.wait()

    threading.Thread(target=run_then_die, daemon=True).start()
    res = _script("post-restore", 1, state)
    os.close(fd)
    assert res.returncode == 0, res.stderr
    assert "stopped before it finished" not in res.stderr


def _hook_front(tmp_path: Path) -> Path:
    """packaging/bin/gpusnap-hook beside its library, its Python hook a probe
    that says it was reached (exit 9)."""
    for name in ("agent-ask.sh", "gpusnap-hook"):
        (tmp_path / name).write_text((SCRIPT.parent / name).read_text())
    probe = tmp_path / "python-hook"
    probe.write_text("#!/bin/sh\necho python hook reached >&2\nexit 9\n")
    probe.chmod(0o755)
    front = tmp_path / "gpusnap-hook"
    front.write_text(front.read_text().replace("/opt/gpusnap/venv/bin/gpusnap-hook", str(probe)))
    return front


def test_a_gpu_restores_hook_is_its_agents_and_starts_no_python(state, tmp_path):
    """runc's prestart hook at a restore goes to the agent of runc's CRIU (this
    test plays runc: the hook and CRIU are its children), which judges it with
    its NVML read; where it cannot judge, the hook's own Python does."""
    front = _hook_front(tmp_path)
    bundle = tmp_path / "bundle"
    (bundle / "checkpoint").mkdir(parents=True)
    (bundle / "checkpoint" / "inventory.img").write_bytes(b"")
    (bundle / "config.json").write_text(json.dumps(
        {"linux": {"devices": [{"path": "/dev/nvidia0", "major": 195, "minor": 0}]}}))
    manifest = bundle / "checkpoint" / action.MANIFEST_NAME
    state_json = json.dumps({"id": "c1", "pid": os.getpid(), "bundle": str(bundle)})

    def hook(stage: str = "prestart") -> subprocess.CompletedProcess:
        return subprocess.run(["bash", str(front), stage], input=state_json, capture_output=True,
                              text=True, timeout=60, env={**os.environ, "GPUSNAP_STATE_DIR": str(state)})

    assert hook().returncode == 9  # no agent (a create): Python
    criu = subprocess.Popen(["sleep", "60"])
    try:
        agent_files.start(criu.pid, driver=False)
        _ready(criu.pid)
        assert hook().returncode == 9  # a CPU checkpoint's restore (an agent for a fill): Python
        _manifest_on("GPU-aaaa", manifest)
        assert hook().returncode == 9  # no NVML read of its own (NOT_HERE): Python
        (agent_files.folder(criu.pid) / agent_files.INVENTORY).write_text(json.dumps(INVENTORY))
        res = hook()
        assert res.returncode == 0 and "python hook" not in res.stderr, res.stderr
        recorded = json.loads((state / "containers" / "c1.json").read_text())
        assert recorded["gpus"][0]["uuid"] == "GPU-aaaa" and recorded["inventory_read_by"] == "agent"
        _manifest_on("GPU-aaaa", manifest, need=150 << 30)  # more than the GPU has free
        res = hook()
        assert res.returncode == 1 and "cannot restore here" in res.stderr, res.stderr
        assert "python hook" not in res.stderr
        assert hook("poststop").returncode == 9  # never the agent's
        assert not list(agent_files.folder(criu.pid).glob("hook-state.*"))
    finally:
        criu.kill()
        criu.wait()
    assert _gone(agent_files.folder(criu.pid))


def test_the_agent_waits_for_no_nvml_read_where_the_restore_holds_no_gpu_state(tmp_path):
    """An agent started for a fill alone never reads NVML: the hook of a CPU
    checkpoint is left to Python at once, not after the wait for a read."""
    from gpusnap.action import prestart

    bundle = tmp_path / "bundle"
    (bundle / "checkpoint").mkdir(parents=True)
    (bundle / "checkpoint" / "inventory.img").write_bytes(b"")
    (bundle / "config.json").write_text("{}")

    def read():
        raise AssertionError("NVML's read waited for")

    assert prestart.run_for_agent({"bundle": str(bundle)}, read) == prestart.NOT_HERE


def test_an_nvml_read_made_before_a_long_download_is_made_again_at_the_take(
        tmp_path, monkeypatch):
    """runc's hook re-checks the restore's GPU plan against the agent's read: one
    made as the CLI started, minutes of download before CRIU's take, would miss
    the memory another job took meanwhile. A replica's take, within a second,
    keeps its read; a slow earlier read never overwrites the later one."""
    import threading

    from gpusnap.gpu import inventory as gpu_inventory

    reads, first_may_end = [], threading.Event()

    def read_inventory():
        n = len(reads) + 1
        reads.append(n)
        if n == 1:
            first_may_end.wait(10)
        return gpu_inventory.Inventory(error=f"read {n}")

    monkeypatch.setattr(gpu_inventory, "read_inventory", read_inventory)
    nvml = agent._Nvml()
    slow = threading.Thread(target=nvml.read)
    slow.start()
    deadline = time.monotonic() + 10
    while not reads:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    nvml.fresh(3600)  # a replica: the read under way counts
    assert reads == [1]
    nvml._started -= 3600  # as if it began an hour ago
    here = tmp_path / "criu-folder"
    nvml.fresh(5)
    nvml.into(here)
    no_read = here / agent_files.NO_INVENTORY
    while not no_read.exists():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert no_read.read_text() == "read 2"
    first_may_end.set()
    slow.join(10)
    assert no_read.read_text() == "read 2"  # the older read, ending last, is dropped


def test_a_replicas_take_writes_the_read_it_has(tmp_path, monkeypatch):
    from gpusnap.gpu import inventory as gpu_inventory

    monkeypatch.setattr(gpu_inventory, "read_inventory",
                        lambda *a: gpu_inventory.Inventory(error="the only read"))
    nvml = agent._Nvml()
    nvml.read()
    nvml.fresh(agent.NVML_FRESH_S)
    nvml.into(tmp_path)
    assert (tmp_path / agent_files.NO_INVENTORY).read_text() == "the only read"


def test_a_read_ending_after_the_folder_went_makes_no_folder(tmp_path, monkeypatch):
    import threading

    from gpusnap.gpu import inventory as gpu_inventory

    may_end = threading.Event()
    monkeypatch.setattr(gpu_inventory, "read_inventory",
                        lambda *a: (may_end.wait(10), gpu_inventory.Inventory(error="late"))[1])
    nvml = agent._Nvml()
    reading = threading.Thread(target=nvml.read)
    reading.start()
    here = tmp_path / "criu-agent"
    nvml.into(here)
    nvml.forget()  # the agent removes its folder (no later step is its own, or it leaves)
    may_end.set()
    reading.join(10)
    assert not here.exists()


def test_the_take_asks_for_a_fresh_read_where_the_agents_is_old(tmp_path, monkeypatch):
    """The wiring of the two tests above: CRIU's take (pre-restore asked of the
    agent the CLI started) renews a read older than NVML_FRESH_S before it
    writes one into CRIU's folder."""
    from gpusnap.gpu import inventory as gpu_inventory

    monkeypatch.setenv("GPUSNAP_STATE_DIR", str(tmp_path / "state"))
    for name in ("CRTOOLS_SCRIPT_ACTION", "CRTOOLS_IMAGE_DIR"):  # the take sets them
        monkeypatch.delenv(name, raising=False)
    reads = []
    monkeypatch.setattr(gpu_inventory, "read_inventory",
                        lambda *a: (reads.append(1),
                                 gpu_inventory.Inventory(error=f"read {len(reads)}"))[1])
    monkeypatch.setattr(agent.action, "run_step", lambda *a, **k: 0)
    nvml = agent._Nvml()
    nvml.read()
    nvml._started -= 2 * agent.NVML_FRESH_S  # made as the CLI started, a download ago
    early = tmp_path / "early"
    early.mkdir()
    (early / "requests").write_text("")
    holder = agent._Agent(None, None, nvml)
    holder.wanted = True
    here, watched = agent._take(f"pre-restore {os.getpid()} {tmp_path / 'no-reply'} ", early,
                                holder)
    os.close(watched)
    deadline = time.monotonic() + 10
    while not (here / agent_files.NO_INVENTORY).exists():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert (here / agent_files.NO_INVENTORY).read_text() == "read 2"
