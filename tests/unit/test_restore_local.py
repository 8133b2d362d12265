"""A local restore of a GPU checkpoint keeps the checkpoint until its GPU state
is back (Podman's own restore drops it as soon as CRIU is done), and then drops
it as Podman would. Podman and the restore's check are stood in for: the
restore itself runs against real Podman in tests/gpu/test_gpu_faults.py."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from gpusnap.errors import GpusnapError
from gpusnap.gpu.plan import Plan
from gpusnap.ops import restore as ops_restore
from gpusnap.ops.restore_check import OffTheGpu
from gpusnap.runtime import podman


def _container(userdata: Path) -> podman.Container:
    return podman.Container(id="c0ffee", name="job", status="running", pid=4242, image="img",
                            checkpointed=False, userdata=userdata, devices=[])


@pytest.fixture
def stood_in(monkeypatch, tmp_path):
    """Podman's restore and inspect, and the check, stood in; what they were asked."""
    asked: dict = {"dropped": []}
    ctr = _container(tmp_path)
    monkeypatch.setattr(podman, "restore", lambda source, **kw: asked.setdefault("restore", kw))
    monkeypatch.setattr(podman, "inspect", lambda name: ctr)
    monkeypatch.setattr(podman, "drop_checkpoint", lambda c: asked["dropped"].append(c.name))
    monkeypatch.setattr(ops_restore, "restored", lambda *a, **kw: {"container": {"name": "job"}})
    return asked


def _contents(gpu: bool):
    return SimpleNamespace(manifest=object() if gpu else None, sizes={"pages-1.img": 1 << 20})


def test_a_gpu_checkpoint_is_kept_through_podman_and_dropped_once_checked(stood_in):
    ops_restore.restore_local("job", _contents(gpu=True), Plan((), (), False), keep=False,
                              tcp_established=False)
    assert stood_in["restore"]["keep"] is True
    assert stood_in["dropped"] == ["job"]


def test_keep_asked_by_the_user_is_left_to_podman(stood_in):
    ops_restore.restore_local("job", _contents(gpu=True), Plan((), (), False), keep=True,
                              tcp_established=False)
    assert stood_in["restore"]["keep"] is True
    assert stood_in["dropped"] == []


def test_a_checkpoint_without_gpu_processes_is_podmans_to_drop(stood_in):
    ops_restore.restore_local("job", _contents(gpu=False), Plan((), (), False), keep=False,
                              tcp_established=False)
    assert stood_in["restore"]["keep"] is False
    assert stood_in["dropped"] == []


def test_refused_for_good_keeps_the_checkpoint_and_says_how_to_restore_it(stood_in, monkeypatch):
    def refused(*a, **kw):
        raise OffTheGpu([77], "cuCheckpointProcessRestore(pid 77) failed: "
                        "CUDA_ERROR_OUT_OF_MEMORY (2)", "CUDA_ERROR_OPERATING_SYSTEM (304)")
    monkeypatch.setattr(ops_restore, "restored", refused)
    with pytest.raises(GpusnapError) as err:
        ops_restore.restore_local("job", _contents(gpu=True), Plan((), (), False), keep=False,
                                  tcp_established=False)
    assert stood_in["dropped"] == []
    assert "did not bring back the GPU state" in err.value.message
    assert err.value.hint == ("`podman stop -t 0 job`, then `gpusnap restore job` once the GPU "
                              "has the memory free: its checkpoint is kept")


def test_a_check_failed_otherwise_says_the_checkpoint_is_kept(stood_in, monkeypatch):
    def unanswered(*a, **kw):
        raise GpusnapError("restored, but the driver did not resume process(es) 77 (timeout)",
                           "`gpusnap doctor --fix`")
    monkeypatch.setattr(ops_restore, "restored", unanswered)
    with pytest.raises(GpusnapError) as err:
        ops_restore.restore_local("job", _contents(gpu=True), Plan((), (), False), keep=False,
                                  tcp_established=False)
    assert stood_in["dropped"] == []
    assert err.value.hint == ("`gpusnap doctor --fix`; its checkpoint is kept: should they not "
                              "come back, `podman stop -t 0 job`, then `gpusnap restore job`")
    with pytest.raises(GpusnapError) as err:  # the user's --keep: Podman keeps it, nothing said
        ops_restore.restore_local("job", _contents(gpu=True), Plan((), (), False), keep=True,
                                  tcp_established=False)
    assert err.value.hint == "`gpusnap doctor --fix`"


def test_drop_checkpoint_removes_what_podman_would_and_nothing_else(tmp_path):
    for d in ("checkpoint", "pre-checkpoint"):
        (tmp_path / d).mkdir()
        (tmp_path / d / "pages-1.img").write_bytes(b"x")
    for f in ("dump.log", "restore.log", "stats-dump", "rootfs-diff.tar", "config.json"):
        (tmp_path / f).write_text("x")
    podman.drop_checkpoint(_container(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]
    podman.drop_checkpoint(_container(tmp_path))  # nothing left to drop: no error


def test_the_plan_is_beside_the_manifest_while_podman_restores_and_gone_after(
        stood_in, monkeypatch, tmp_path):
    # The OCI hook and CRIU's action re-check the plan this restore made (with the
    # checks it was told to skip) instead of planning anew; no later checkpoint
    # of the folder carries it.
    import json

    from gpusnap import PLAN_NAME
    from gpusnap.gpu.plan import plan_restore
    from tests.unit.test_hook import UUID0, gpu, inventory
    from tests.unit.test_plan import manifest as plan_manifest

    g0 = gpu(0, UUID0, minor=0)
    stay = plan_restore(plan_manifest(g0), inventory(g0))
    assert not isinstance(stay, list) and stay.moves and not stay.needs_remap
    (tmp_path / "checkpoint").mkdir()
    seen = {}

    def restore(source, **kw):
        seen["plan"] = json.loads((tmp_path / "checkpoint" / PLAN_NAME).read_text())
        if kw.get("fail"):
            raise GpusnapError("CRIU failed")
    monkeypatch.setattr(podman, "restore", restore)
    ops_restore.restore_local("job", _contents(gpu=True), stay, keep=False,
                              tcp_established=False, userdata=tmp_path)
    assert seen["plan"] == stay.to_dict()
    assert not (tmp_path / "checkpoint" / PLAN_NAME).exists()
    monkeypatch.setattr(podman, "restore", lambda source, **kw: restore(source, fail=True))
    monkeypatch.setattr(ops_restore, "_local_log", lambda source: None)
    with pytest.raises(GpusnapError):
        ops_restore.restore_local("job", _contents(gpu=True), stay, keep=False,
                                  tcp_established=False, userdata=tmp_path)
    assert not (tmp_path / "checkpoint" / PLAN_NAME).exists()


def test_an_archive_restore_carries_a_plan_that_moves_nothing(tmp_path):
    from gpusnap.gpu.plan import plan_restore
    from tests.unit.test_hook import UUID0, gpu, inventory
    from tests.unit.test_plan import manifest as plan_manifest

    from gpusnap.archive import CheckpointContents

    g0 = gpu(0, UUID0, minor=0)
    stay = plan_restore(plan_manifest(g0), inventory(g0))
    contents = CheckpointContents("job.tar", files={"spec.dump": b"{}", "config.dump": b"{}"})
    retarget, files = ops_restore._retarget(contents, stay)
    assert retarget == {"remap": stay.remap.to_dict(), "plan": stay.to_dict()}
    assert files == contents.files  # nothing edited
    assert ops_restore._retarget(contents, Plan((), (), False)) == (None, contents.files)


def test_shared_gpu_nodes_this_host_numbers_otherwise_are_renumbered(monkeypatch):
    # nvidia-uvm's major is dynamic: the checkpoint's host had 511, this one 238.
    # Kept, the container's device rule allowed 511:0 and CRIU opened 511:0.
    import json

    from gpusnap.archive import CheckpointContents
    from gpusnap.gpu.plan import plan_restore
    from gpusnap.ops import gpu_plan
    from tests.unit.test_hook import UUID0, gpu, inventory
    from tests.unit.test_plan import manifest as plan_manifest

    asked = []

    def host(paths, root="/"):
        asked.extend(paths)
        return {"/dev/nvidia-uvm": (238, 0), "/dev/nvidiactl": (195, 255)}
    monkeypatch.setattr(gpu_plan, "read_host_numbers", host)
    g0 = gpu(0, UUID0, minor=0)
    stay = plan_restore(plan_manifest(g0), inventory(g0))
    devices = [{"path": "/dev/nvidia0", "type": "c", "major": 195, "minor": 0},
               {"path": "/dev/nvidiactl", "type": "c", "major": 195, "minor": 255},
               {"path": "/dev/nvidia-uvm", "type": "c", "major": 511, "minor": 0}]
    spec = {"linux": {"devices": devices, "resources": {"devices": [
        {"allow": True, "type": "c", "major": 511, "minor": 0, "access": "rwm"}]}}}
    contents = CheckpointContents("job.tar", files={
        "spec.dump": json.dumps(spec).encode(),
        "config.dump": json.dumps({"spec": spec}).encode()})  # Podman keeps the spec there too
    retarget, files = ops_restore._retarget(contents, stay)
    assert asked == ["/dev/nvidiactl", "/dev/nvidia-uvm"]  # not the GPU's own node
    changed = [n for n in retarget["remap"]["nodes"]]
    assert changed == [{"old_path": "/dev/nvidia-uvm", "new_path": "/dev/nvidia-uvm",
                        "old": [511, 0], "new": [238, 0]}]
    moved = json.loads(files["spec.dump"])
    assert moved["linux"]["devices"][2]["major"] == 238
    assert moved["linux"]["resources"]["devices"][0]["major"] == 238
    assert retarget["plan"]["remap"]["nodes"] == changed  # the hook sees what was edited


def test_the_shim_renumbers_shared_gpu_nodes_where_every_gpu_stays(monkeypatch, tmp_path):
    # ctr/nerdctl restore after a reboot (or on another host): the task's spec and
    # CRIU's /dev image name the old nvidia-uvm major; the same plan as gpusnap restore's
    from gpusnap.gpu.plan import plan_restore
    from gpusnap.ops import gpu_plan
    from gpusnap.shim import remap as shim_remap
    from tests.unit.test_hook import UUID0, gpu, inventory
    from tests.unit.test_plan import manifest as plan_manifest

    g0 = gpu(0, UUID0, minor=0)
    stay = plan_restore(plan_manifest(g0), inventory(g0))
    monkeypatch.setattr(shim_remap.gpu_manifest, "read", lambda image_dir: object())
    monkeypatch.setattr(shim_remap.gpu_plan, "plan_here", lambda *a, **k: stay)
    numbers = {"/dev/nvidia-uvm": (511, 0)}
    monkeypatch.setattr(gpu_plan, "read_host_numbers", lambda paths, root="/": numbers)
    spec = {"linux": {"devices": [{"path": "/dev/nvidia-uvm", "type": "c", "major": 511,
                                   "minor": 0}]}}
    assert shim_remap._plan(spec, tmp_path) is None  # numbered the same: nothing edited
    numbers["/dev/nvidia-uvm"] = (238, 0)
    remap, plan = shim_remap._plan(spec, tmp_path)
    assert [(n.old_path, n.old, n.new) for n in remap.nodes] == [("/dev/nvidia-uvm", (511, 0),
                                                                  (238, 0))]
    assert plan["remap"] == remap.to_dict() and not stay.needs_remap  # no GPU moved


def test_nvidia_uvm_not_loaded_yet_is_loaded_before_its_number_is_read(monkeypatch):
    # A host booted since no CUDA ran has no /dev/nvidia-uvm until libcuda's
    # first use: read then, the checkpoint's number would stay.
    from gpusnap.gpu.plan import plan_restore
    from gpusnap.ops import gpu_plan
    from tests.unit.test_hook import UUID0, gpu, inventory
    from tests.unit.test_plan import manifest as plan_manifest

    loaded = []
    monkeypatch.setattr(gpu_plan, "_load_uvm", lambda: loaded.append(1) or True)
    monkeypatch.setattr(gpu_plan, "read_host_numbers",
                        lambda paths, root="/": {"/dev/nvidia-uvm": (238, 0)} if loaded else {})
    g0 = gpu(0, UUID0, minor=0)
    stay = plan_restore(plan_manifest(g0), inventory(g0))
    spec = {"linux": {"devices": [{"path": "/dev/nvidia-uvm", "type": "c", "major": 511,
                                   "minor": 0}]}}
    renumbered = gpu_plan.with_host_numbers(stay, spec)
    assert loaded == [1] and [n.new for n in renumbered.remap.nodes] == [(238, 0)]
