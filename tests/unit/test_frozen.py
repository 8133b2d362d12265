"""`gpusnap freeze`'s record (ops/frozen.py): its processes are off the GPU on
purpose, and nothing but `gpusnap thaw` brings them back."""

from __future__ import annotations

import contextlib
import os
from types import SimpleNamespace

import pytest

from gpusnap.errors import GpusnapError
from gpusnap.ops import freeze, frozen, gpu_state
from gpusnap.runtime import podman


@pytest.fixture(autouse=True)
def state_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUSNAP_STATE_DIR", str(tmp_path / "state"))


def test_a_freeze_is_recorded_until_its_thaw_and_only_for_its_own_processes():
    me = os.getpid()
    frozen.mark(me, "web", [me])
    assert frozen.frozen() == {me: "web"}
    frozen.unmark(me)
    assert frozen.frozen() == {}
    frozen.mark(me, "web", [me])
    record = frozen._folder() / f"{me}.json"
    record.write_text(record.read_text().replace(f'"{me}": ', f'"{me}": 1 + '))  # damaged
    assert frozen.frozen() == {}
    record.write_text('{"container": "web", "pids": {"%d": 1}}' % me)  # another process's
    assert frozen.frozen() == {}


def test_a_failed_checkpoints_clean_up_never_thaws_a_frozen_container(monkeypatch):
    me = os.getpid()
    frozen.mark(me, "web", [me])
    monkeypatch.setattr(gpu_state, "load_driver",
                        lambda: pytest.fail("asked the driver to resume a frozen process"))
    assert gpu_state.ensure_running(me, [me]) == []


@pytest.mark.parametrize("command,verb", [("freeze", "be frozen"), ("move", "be moved")])
def test_a_frozen_container_is_refused_a_freeze_again_or_a_move(monkeypatch, command, verb):
    me = os.getpid()
    frozen.mark(me, "web", [me])
    ctr = podman.Container(id="c0ffee", name="web", status="running", pid=me, image="img",
                           checkpointed=False, userdata=podman.Path("/nonexistent"), devices=[])
    monkeypatch.setattr(podman, "inspect", lambda name: ctr)
    monkeypatch.setattr(freeze, "wait_turn", lambda *a: contextlib.nullcontext())
    monkeypatch.setattr(freeze, "cuda_of", lambda *a: ([SimpleNamespace(pid=me)], object()))
    with pytest.raises(GpusnapError, match="web is frozen") as info:
        with freeze.gpu_turn("web", verb, command):
            pass
    assert "`gpusnap thaw web` first" in info.value.hint
    with freeze.gpu_turn("web", "be thawed", "thaw") as (got, procs, _):
        assert got is ctr and [p.pid for p in procs] == [me]
