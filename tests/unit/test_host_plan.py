"""gpusnap.gpu.host_plan: every restore reads the host the same way, so a plain
`podman container restore` (the hook's plan, gpu/bundle_plan) moves a GPU's DRM
nodes and follows its NUMA node as `gpusnap restore` does."""

from __future__ import annotations

from gpusnap.gpu import inventory as inventory_module
from gpusnap.gpu.bundle_plan import plan_restore_here
from gpusnap.gpu.gpumap import GPU_MAP_ANNOTATION
from gpusnap.gpu.host_plan import plan_on_host
from gpusnap.gpu.nodes import NodeChange
from gpusnap.gpu.plan import Plan
from tests.unit.fakes import UUID0, UUID1, UUID2, gpu, inventory
from tests.unit.test_drm_topology import fake_pci
from tests.unit.test_plan import SRC0, manifest

DRM = {"card": 1, "render": 128}


def _source():
    m = manifest(gpu(0, SRC0))
    m.gpus[0]["drm"] = dict(DRM)
    return m


def _sysfs(tmp_path):
    # gpu(i, ...) sits at PCI bus 0x18 + i
    fake_pci(tmp_path, "0000:18:00.0", "card1", "renderD128", numa="0")
    fake_pci(tmp_path, "0000:19:00.0", "card2", "renderD129", numa="1")
    fake_pci(tmp_path, "0000:1a:00.0", "card3", "renderD130", numa="0")
    return tmp_path


def test_a_plan_made_here_moves_the_drm_nodes_with_the_gpu(tmp_path):
    here = inventory(gpu(1, UUID1))
    plan = plan_on_host(_source(), here, host_checks=False, skip=frozenset(), sysfs=_sysfs(tmp_path))
    assert isinstance(plan, Plan), [p.line for p in plan]
    assert NodeChange("/dev/dri/renderD128", "/dev/dri/renderD129", (226, 128), (226, 129)) \
        in plan.remap.nodes
    assert plan.remap.unknown_drm == ()


def test_the_numa_node_read_here_breaks_the_tie(tmp_path):
    # two checkpoint GPUs go to the two GPUs here that share a NUMA node
    m = manifest(gpu(0, SRC0), gpu(1, UUID2))
    here = inventory(gpu(0, UUID0), gpu(1, UUID1), gpu(2, "GPU-33333333-0000-0000-0000-000000000000"))
    plan = plan_on_host(m, here, host_checks=False, skip=frozenset(), sysfs=_sysfs(tmp_path))
    assert isinstance(plan, Plan), [p.line for p in plan]
    # without the NUMA nodes the same indexes would win: GPUs 0 and 1, on two nodes
    assert sorted(mv.target.index for mv in plan.moves) == [0, 2]


def test_the_hooks_plan_for_a_plain_podman_restore_moves_the_drm_nodes(tmp_path, monkeypatch):
    """The annotation's map, planned by the hook: before, without the DRM nodes,
    the moved GPU's /dev/dri nodes were refused only after CRIU had restored it."""
    folder = tmp_path / "checkpoint"
    folder.mkdir()
    path = folder / "gpusnap-manifest.json"
    path.write_text(_source().to_json())
    monkeypatch.setattr(inventory_module, "read_inventory", lambda *a: inventory(gpu(0, UUID0), gpu(1, UUID1)))
    spec = {"annotations": {GPU_MAP_ANNOTATION: "0=1"}}
    problems, plan = plan_restore_here(path, spec, sysfs=_sysfs(tmp_path / "sys"))
    assert problems == [] and plan is not None
    assert [mv.target.index for mv in plan.moves] == [1]
    assert NodeChange("/dev/dri/card1", "/dev/dri/card2", (226, 1), (226, 2)) in plan.remap.nodes
    assert plan.remap.unknown_drm == ()


def test_host_facts_read_already_are_not_read_again(tmp_path, monkeypatch):
    """`gpusnap restore REF` reads them (`criu --version`) beside the registry's
    round trip: the plan and the CRIU check take that answer."""
    from gpusnap.criu import version
    from gpusnap.gpu import checks, host_plan

    def again():
        raise AssertionError("read again")
    monkeypatch.setattr(host_plan, "read_host_facts", again)
    monkeypatch.setattr(version, "criu_version", again)
    facts = checks.HostFacts(arch="x86_64", kernel="6.18.44", criu_version="4.2.1")
    plan = plan_on_host(_source(), inventory(gpu(1, UUID1)), skip=frozenset(), host=facts,
                        sysfs=_sysfs(tmp_path))
    assert isinstance(plan, Plan), [p.line for p in plan]
    assert version.require_supported("restore", facts.criu_version) == "4.2.1"
