"""The CRIU action script's post-resume step hands the plan's GPU UUID pairs to the driver."""

from __future__ import annotations

import json

import pytest

from gpusnap import PLAN_NAME
from gpusnap.action import action, step_state
from gpusnap.errors import GpusnapError
from gpusnap.gpu import quiesce
from gpusnap.gpu.gpumap import parse_gpu_map
from gpusnap.gpu.plan import plan_restore
from tests.unit.fakes import UUID0, UUID1, gpu, inventory
from tests.unit.test_plan import manifest


def _write_plan(image_dir, gpu_map: str) -> None:
    g0, g1 = gpu(0, UUID0), gpu(1, UUID1)
    plan = plan_restore(manifest(g0), inventory(g0, g1), gpu_map=parse_gpu_map(gpu_map))
    (image_dir / PLAN_NAME).write_text(json.dumps(plan.to_dict()))


def _pairs(image_dir, monkeypatch, tmp_path):
    """What post-resume gets: pre-restore keeps the plan while CRIU's image dir is open."""
    monkeypatch.setenv("GPUSNAP_STATE_DIR", str(tmp_path / "state"))
    action.pre_restore(str(image_dir), 4242, action.fill_settings())
    state = step_state.restore(4242)
    kept = json.loads(state.read_text()) if state.exists() else {}
    return action._pair_choices(kept.get(PLAN_NAME))


def test_no_plan_means_no_pairs(tmp_path, monkeypatch):
    images = tmp_path / "images"
    images.mkdir()
    assert _pairs(images, monkeypatch, tmp_path) == [("none", None)]


def test_a_moved_gpu_gives_every_gpu_a_pair(tmp_path, monkeypatch):
    images = tmp_path / "images"
    images.mkdir()
    _write_plan(images, "0=1")
    every, moved, none = _pairs(images, monkeypatch, tmp_path)
    # first every GPU the driver sees: 0->1 and the freed 1->0; then the moved one; then none
    assert sorted(every[1]) == sorted([(UUID0, UUID1), (UUID1, UUID0)])
    assert moved[1] == [(UUID0, UUID1)]
    assert none == ("none", None)


def test_a_plan_that_keeps_the_gpus_needs_no_pairs(tmp_path, monkeypatch):
    images = tmp_path / "images"
    images.mkdir()
    _write_plan(images, "0=0")
    assert _pairs(images, monkeypatch, tmp_path) == [("none", None)]


@pytest.mark.parametrize("text", ['{"moves": 3}', "[]", '"plan"', '{"moves": [', "{}"])
def test_a_damaged_plan_is_one_clear_error(text):
    with pytest.raises(GpusnapError, match="is not a GPU plan gpusnap can read") as info:
        action._pair_choices(text)
    assert "gpusnap restore" in info.value.hint


def test_post_resume_falls_back_to_fewer_pairs_when_the_driver_refuses(tmp_path, monkeypatch):
    """Seen on H200 x2: in a container that reaches only its new GPU, the driver
    answers CUDA_ERROR_INVALID_VALUE to pairs naming GPUs it cannot open."""
    from gpusnap.gpu.cuda import ProcessState
    from gpusnap.procs import ProcessGpuUse
    from tests.unit.fakes import FakeDriver

    images = tmp_path / "images"
    images.mkdir()
    _write_plan(images, "0=1")
    monkeypatch.setenv("GPUSNAP_STATE_DIR", str(tmp_path / "state"))
    action.pre_restore(str(images), 4242, action.fill_settings())
    driver = FakeDriver({77: ProcessState.CHECKPOINTED})
    offered = []

    def restore(pid, pairs=None):
        offered.append(pairs)
        if pairs and len(pairs) > 1:
            raise RuntimeError("cuCheckpointProcessRestore: CUDA_ERROR_INVALID_VALUE (1)")
        driver.states[pid] = ProcessState.LOCKED

    monkeypatch.setattr(driver, "restore", restore)
    monkeypatch.setattr(quiesce, "require_driver", lambda: driver)
    monkeypatch.setattr(action, "cuda_processes",
                        lambda pid: [ProcessGpuUse(pid=77, comm="train", gpu_minors=[1])])
    action.post_resume(init_pid=70, criu_pid=4242)
    assert offered == [offered[0], [(UUID0, UUID1)]] and len(offered[0]) == 2
    assert driver.states[77] == ProcessState.RUNNING


def _wrapper_with_probe(tmp_path):
    """packaging/bin/criu-action with a stand-in for its Python that prints "reached"."""
    from pathlib import Path

    wrapper = (Path(__file__).parents[2] / "packaging/bin/criu-action").read_text()
    probe = tmp_path / "probe"
    probe.write_text("#!/bin/sh\necho reached\n")
    probe.chmod(0o755)
    script = tmp_path / "criu-action"
    script.write_text(wrapper.replace("/opt/gpusnap/venv/bin/gpusnap-criu-action", str(probe)))
    return script


def test_the_criu_action_wrapper_starts_python_for_the_actions_with_work_only(tmp_path):
    """packaging/bin/criu-action runs for every CRIU step; run with a stand-in
    for the Python entry point, it must reach it for exactly ACTIONS."""
    import os
    import subprocess

    script = _wrapper_with_probe(tmp_path)
    steps = ("pre-dump", "post-dump", "network-lock", "network-unlock", "pre-restore",
             "setup-namespaces", "post-setup-namespaces", "post-restore", "pre-resume",
             "post-resume", "orphan-pts-master", "")
    state = tmp_path / "state"
    env = {"GPUSNAP_STATE_DIR": str(state), "CRTOOLS_INIT_PID": "4242"}

    def reached() -> set[str]:
        return {s for s in steps
                if subprocess.run(["bash", str(script)], env={**env, "CRTOOLS_SCRIPT_ACTION": s},
                                  capture_output=True, text=True).stdout.strip() == "reached"}
    # post-dump starts Python only for a push that asked for it (pages set aside),
    # post-restore only where pre-restore left pages to write (for this CRIU: its pid)
    assert reached() == set(action.ACTIONS) - {"post-dump", "post-restore"}
    (state / "requests").mkdir(parents=True)
    (state / "requests" / "4242.pages.json").write_text("{}")
    assert reached() == set(action.ACTIONS) - {"post-restore"}
    (state / "actions").mkdir(exist_ok=True)  # the script made it (its own <pid>-born)
    (state / "actions" / f"{os.getpid() + 1}-fill.json").write_text("{}")  # another CRIU's
    assert reached() == set(action.ACTIONS) - {"post-restore"}
    (state / "actions" / f"{os.getpid()}-fill.json").write_text("{}")
    assert reached() == set(action.ACTIONS)


def test_the_criu_action_wrapper_runs_post_dump_where_memory_was_read_ahead(tmp_path):
    """pre-dump took memory read ahead out of the processes (actions/<CRIU pid>-ahead.json):
    post-dump must run to put it back into the images, or fail the dump, even
    where the push's request is gone; skipped, the dump would end with holes."""
    import os
    import subprocess

    script = _wrapper_with_probe(tmp_path)
    actions = tmp_path / "state" / "actions"
    actions.mkdir(parents=True)
    env = {"GPUSNAP_STATE_DIR": str(tmp_path / "state"), "CRTOOLS_INIT_PID": "4242",
           "CRTOOLS_SCRIPT_ACTION": "post-dump"}

    def reached() -> bool:
        return subprocess.run(["bash", str(script)], env=env, capture_output=True,
                              text=True).stdout.strip() == "reached"
    (actions / f"{os.getpid() + 1}-ahead.json").write_text("[]")  # another CRIU's
    assert not reached()
    (actions / f"{os.getpid()}-ahead.json").write_text("[]")  # this CRIU's ($PPID)
    assert reached()


def test_post_dump_fails_the_dump_where_memory_read_ahead_has_no_request(tmp_path, monkeypatch):
    """What the wrapper starts Python for: without the push's request the memory
    read ahead cannot be put back, so the dump fails (CRIU resumes the tree and
    the guardian writes that memory back), in one line."""
    import os

    from gpusnap.action import step_state

    monkeypatch.setenv("GPUSNAP_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("CRTOOLS_INIT_PID", "4242")
    monkeypatch.setenv("CRTOOLS_IMAGE_DIR", str(tmp_path))
    step_state.ahead(os.getpid()).write_text("[]")
    assert action._run("post-dump", os.getpid()) == 1
    assert not step_state.ahead(os.getpid()).exists()


def test_the_criu_action_wrapper_never_takes_a_dead_crius_files_for_its_own(tmp_path):
    """Names in actions/ start with CRIU's pid, which the host reuses: a step's
    answer or a fill plan that a CRIU left when it died must not pass for a
    later CRIU's. This test's pid plays both: the dead CRIU's files are those
    of another start time."""
    import os
    import subprocess

    from gpusnap.procs import start_time

    script = _wrapper_with_probe(tmp_path)
    actions = tmp_path / "state" / "actions"
    actions.mkdir(parents=True)
    images = tmp_path / "images"
    images.mkdir()
    env = {"GPUSNAP_STATE_DIR": str(tmp_path / "state"), "CRTOOLS_INIT_PID": "4242",
           "CRTOOLS_IMAGE_DIR": str(images), "PATH": os.environ["PATH"]}
    me = os.getpid()

    def step(name: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", str(script)], env={**env, "CRTOOLS_SCRIPT_ACTION": name},
                              capture_output=True, text=True, timeout=60)

    (actions / f"{me}-born").write_text("1")  # a CRIU of this pid that started at tick 1
    (actions / f"{me}-pre-restore").write_text("7")  # its answer
    (actions / f"{me}-fill.json").write_text("{}")  # its plan
    (actions / f"{me}-agent").mkdir()  # its agent's folder
    (actions / f"{me + 1}-fill.json").write_text("{}")  # another CRIU's: not this one's to clear
    done = step("pre-restore")
    assert (done.returncode, done.stdout.strip()) == (0, "reached"), done.stderr
    assert sorted(p.name for p in actions.iterdir()) == [f"{me}-born", f"{me + 1}-fill.json"]
    assert (actions / f"{me}-born").read_text().strip() == str(start_time(me))
    # within one CRIU its first answer stands (runc.conf has CRIU run a step twice)
    (actions / f"{me}-pre-restore").write_text("7")
    assert step("pre-restore").returncode == 7
    (actions / f"{me}-fill.json").write_text("{}")
    assert step("post-restore").stdout.strip() == "reached"
    assert (actions / f"{me}-fill.json").exists()
    # a later step never clears: the first one's born may not have been written
    (actions / f"{me}-born").unlink()
    assert step("post-restore").stdout.strip() == "reached"
    assert (actions / f"{me}-fill.json").exists() and (actions / f"{me}-pre-restore").exists()
