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


def _inventory(free_gib: float):
    from gpusnap.gpu.inventory import GpuInfo, Inventory
    gpu = GpuInfo(index=0, uuid="GPU-a", name="H200", minor=0, pci_bus_id="0:1", compute_capability="9.0",
                  memory_total=100 << 30, memory_used=(100 << 30) - int(free_gib * (1 << 30)))
    return Inventory(driver_version="580", gpus=[gpu])


def test_a_thaw_the_gpu_has_no_room_for_is_refused_before_the_driver_is_asked(monkeypatch):
    me = os.getpid()
    frozen.mark(me, "web", [me], {"GPU-a": 8 << 30})
    ctr = podman.Container(id="c0ffee", name="web", status="running", pid=me, image="img",
                           checkpointed=False, userdata=podman.Path("/nonexistent"), devices=[])
    asked = []
    monkeypatch.setattr(freeze, "resume", lambda *a, **k: asked.append(a) or [me])
    monkeypatch.setattr(freeze, "read_inventory", lambda: _inventory(2))
    with pytest.raises(GpusnapError, match="GPU 0 has 2.0 GiB free and web's frozen processes "
                       "need 8.0 GiB; it stays frozen") as info:
        freeze._thaw(ctr, [SimpleNamespace(pid=me)], object())
    assert info.value.hint == ("free GPU 0's memory (`gpusnap gpus` shows its use), then "
                               "`gpusnap thaw web`")
    assert not asked and frozen.frozen() == {me: "web"}
    monkeypatch.setattr(freeze, "read_inventory", lambda: _inventory(9))
    assert freeze._thaw(ctr, [SimpleNamespace(pid=me)], object())["pids"] == [me]
    assert asked and frozen.frozen() == {}


def test_a_freeze_records_what_its_processes_held_on_each_gpu(monkeypatch):
    me = os.getpid()
    ctr = podman.Container(id="c0ffee", name="web", status="running", pid=me, image="img",
                           checkpointed=False, userdata=podman.Path("/nonexistent"), devices=[])
    inv = _inventory(50)
    inv.process_memory = {me: {"GPU-a": 3 << 30}, me + 1: {"GPU-a": 1 << 30}}
    monkeypatch.setattr(freeze, "read_inventory", lambda: inv)
    monkeypatch.setattr(freeze, "quiesce", lambda driver, pids, *a: pids)
    freeze._freeze(ctr, [SimpleNamespace(pid=me)], object(), 1000)
    assert frozen.needs(me) == {"GPU-a": 3 << 30}


def test_a_thaw_the_driver_refuses_for_good_does_not_say_to_thaw_again(monkeypatch):
    from gpusnap.gpu.quiesce import QuiesceError
    me = os.getpid()
    frozen.mark(me, "web", [me], {"GPU-a": 1 << 30})
    ctr = podman.Container(id="c0ffee", name="web", status="running", pid=me, image="img",
                           checkpointed=False, userdata=podman.Path("/nonexistent"), devices=[])
    monkeypatch.setattr(freeze, "read_inventory", lambda: _inventory(9))

    def refused(*a, **k):
        raise QuiesceError("restore", {me: RuntimeError(
            f"cuCheckpointProcessRestore(pid {me}) failed: CUDA_ERROR_OPERATING_SYSTEM")})
    monkeypatch.setattr(freeze, "resume", refused)
    with pytest.raises(GpusnapError, match="will not take its processes back") as info:
        freeze._thaw(ctr, [SimpleNamespace(pid=me)], object())
    assert info.value.hint == "their GPU state is lost: `podman restart web` starts it afresh"


def test_a_container_restarted_while_the_command_waited_for_its_turn_is_not_touched(monkeypatch):
    me = os.getpid()
    before = podman.Container(id="c0ffee", name="web", status="running", pid=me, image="img",
                              checkpointed=False, userdata=podman.Path("/nonexistent"), devices=[])
    after = podman.Container(id="c0ffee", name="web", status="running", pid=me + 1, image="img",
                             checkpointed=False, userdata=podman.Path("/nonexistent"), devices=[])
    seen = iter([before, after])
    monkeypatch.setattr(podman, "inspect", lambda name: next(seen))
    monkeypatch.setattr(freeze, "wait_turn", lambda *a: contextlib.nullcontext())
    monkeypatch.setattr(freeze, "cuda_of", lambda *a: pytest.fail("read the new processes"))
    with pytest.raises(GpusnapError, match="restarted or restored while the freeze waited") as info:
        with freeze.gpu_turn("web", "be frozen", "freeze"):
            pass
    assert info.value.hint == "run the same `gpusnap freeze` again"
