"""gpusnap.gpu.amd: KFD topology read from sysfs trees, mapped as CRIU's amdgpu plugin will."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from gpusnap.gpu.amd import (AmdPlan, KfdError, KfdTopology, plan_amd, read_kfd_topology)
from gpusnap.gpu.checks import Problem
from gpusnap.gpu.drm import DrmNodes
from gpusnap.gpu.gpumap import parse_gpu_map
from gpusnap.gpu.nodes import NodeChange, PathChange

KFD = Path(__file__).parent / "fixtures" / "kfd"
MI210_VRAM = 68702699520


def tree(tmp_path: Path, name: str) -> Path:
    dst = tmp_path / name
    shutil.copytree(KFD / name, dst)
    return dst


def set_prop(path: Path, key: str, value: int) -> None:
    lines = path.read_text().splitlines()
    assert any(line.split()[0] == key for line in lines), key
    path.write_text("".join(f"{key} {value}\n" if line.split()[0] == key else line + "\n"
                            for line in lines))


def only_gpu(topology: KfdTopology, node_id: int) -> KfdTopology:
    """What a process sees when its cgroup allows one GPU: the CPUs and that GPU."""
    return KfdTopology.from_dict({"nodes": [n.to_dict() for n in topology.nodes
                                            if not n.is_gpu or n.node_id == node_id]})


def plan(*args, **kw) -> AmdPlan:
    result = plan_amd(*args, **kw)
    assert isinstance(result, AmdPlan), [p.line for p in result]
    return result


def problems(*args, **kw) -> list[Problem]:
    result = plan_amd(*args, **kw)
    assert isinstance(result, list), [m.describe() for m in result.moves]
    return result


# --- reading --------------------------------------------------------------------------------

def test_two_mi210_on_two_sockets():
    topo = read_kfd_topology(KFD / "2x-mi210")
    assert [n.node_id for n in topo.nodes] == [0, 1, 2, 3]
    gpu0, gpu1 = topo.gpus
    assert (gpu0.index, gpu0.gpu_id, gpu0.name) == (0, 41022, "aldebaran")
    assert (gpu1.index, gpu1.gpu_id) == (1, 16790)
    assert (gpu0.render_minor, gpu1.render_minor) == (128, 129)
    assert (gpu0.pci_bdf, gpu1.pci_bdf) == ("0000:04:00.0", "0000:84:00.0")
    assert gpu0.vram_size == MI210_VRAM and gpu0.vram_public
    assert gpu0.properties["device_id"] == 0x740F and gpu0.properties["simd_count"] == 416
    assert (topo.cpu_of(gpu0), topo.cpu_of(gpu1)) == (0, 1)
    assert topo.xgmi(gpu0, gpu1) and topo.xgmi(gpu1, gpu0)


def test_one_mi300x():
    topo = read_kfd_topology(KFD / "1x-mi300x")
    [gpu] = topo.gpus
    assert (gpu.name, gpu.properties["device_id"], gpu.properties["num_xcc"]) == ("ip discovery", 0x74A1, 8)
    assert gpu.vram_size == 206141652992 and gpu.pci_bdf == "0000:11:00.0"
    assert topo.cpu_of(gpu) == 0 and not topo.nodes[0].is_gpu


def test_a_malformed_properties_line_names_file_and_line(tmp_path):
    root = tree(tmp_path, "2x-mi210")
    props = root / "nodes" / "2" / "properties"
    props.write_text(props.read_text().replace("simd_count 416", "simd_count many"))
    with pytest.raises(KfdError) as err:
        read_kfd_topology(root)
    assert str(err.value) == f"{props} line 2: 'simd_count many' is not 'name value'"


def test_other_broken_trees(tmp_path):
    with pytest.raises(KfdError, match="no amdgpu driver with KFD on this host"):
        read_kfd_topology(tmp_path / "none")
    root = tree(tmp_path, "1x-mi300x")
    (root / "nodes" / "1" / "gpu_id").write_text("x\n")
    with pytest.raises(KfdError, match=r"gpu_id holds 'x', expected a number"):
        read_kfd_topology(root)
    (root / "nodes" / "1" / "gpu_id").write_text("57203\n")
    set_prop(root / "nodes" / "1" / "mem_banks" / "0" / "properties", "heap_type", 0)
    with pytest.raises(KfdError, match="no VRAM bank"):
        read_kfd_topology(root)


def test_the_topology_record_round_trips():
    topo = read_kfd_topology(KFD / "2x-mi210")
    again = KfdTopology.from_dict(json.loads(json.dumps(topo.to_dict())))
    assert again == topo
    with pytest.raises(KfdError, match="malformed"):
        KfdTopology.from_dict({"nodes": [{"node_id": 1}]})


# --- planning -------------------------------------------------------------------------------

def test_the_same_host_maps_each_gpu_to_itself():
    topo = read_kfd_topology(KFD / "2x-mi210")
    p = plan(topo, topo)
    assert [(m.source.gpu_id, m.target.gpu_id) for m in p.moves] == [(41022, 41022), (16790, 16790)]
    assert p.kfd_env == {} and p.remap.empty and p.overridden == ()


def test_a_swap_keeps_numa_and_xgmi_and_moves_render_nodes():
    topo = read_kfd_topology(KFD / "2x-mi210")
    p = plan(topo, topo, gpu_map=parse_gpu_map("0=1,1=0"))
    assert p.gpu_id_pairs == [(41022, 16790), (16790, 41022)]
    assert set(p.remap.nodes) == {
        NodeChange("/dev/dri/renderD128", "/dev/dri/renderD129", (226, 128), (226, 129)),
        NodeChange("/dev/dri/renderD129", "/dev/dri/renderD128", (226, 129), (226, 128))}
    assert PathChange("/dev/dri/by-path/pci-0000:04:00.0-render",
                      "/dev/dri/by-path/pci-0000:84:00.0-render") in p.remap.paths
    assert set(p.remap.ids) == {("0", "1"), ("1", "0")} and p.remap.cdi_kinds == ("amd.com/gpu",)
    assert p.remap.unknown_drm  # card nodes: not known without sysfs drm
    known = {"0000:04:00.0": DrmNodes(1, 128), "0000:84:00.0": DrmNodes(2, 129)}
    p = plan(topo, topo, gpu_map=parse_gpu_map("0=1,1=0"), drm=known, source_drm=known)
    assert NodeChange("/dev/dri/card1", "/dev/dri/card2", (226, 1), (226, 2)) in p.remap.nodes
    assert p.remap.unknown_drm == ()


def test_mi210s_do_not_fit_one_mi300x():
    found = problems(read_kfd_topology(KFD / "2x-mi210"), read_kfd_topology(KFD / "1x-mi300x"))
    assert found[0] == Problem("count", "the checkpoint used 2 AMD GPU(s), this host has 1")
    assert [p.check for p in found[1:]] == ["amd-gpu", "amd-gpu"]
    assert found[1].line.startswith("GPU 0 of the checkpoint (aldebaran) -> GPU 0 here (ip discovery): "
                                    "not the same GPU model: device_id 0x740f vs 0x74a1, "
                                    "simd_count 416 vs 1216")
    assert "override" not in found[1].line  # no KFD knob makes an MI210 an MI300X


def test_one_mi210_onto_a_mi300x_is_refused_even_with_every_knob():
    src = only_gpu(read_kfd_topology(KFD / "2x-mi210"), 2)
    every = frozenset({"amd-fw", "amd-sdma-fw", "amd-caches", "amd-gws", "amd-vram", "amd-numa",
                       "amd-capability"})
    [p] = problems(src, read_kfd_topology(KFD / "1x-mi300x"), skip=every)
    assert p.check == "amd-gpu"


@pytest.mark.parametrize("prop, value, check, knob", [
    ("fw_version", 70, "amd-fw", "KFD_FW_VER_CHECK"),
    ("sdma_fw_version", 5, "amd-sdma-fw", "KFD_SDMA_FW_VER_CHECK"),
    ("caches_count", 200, "amd-caches", "KFD_CACHES_COUNT_CHECK"),
    ("num_gws", 0, "amd-gws", "KFD_NUM_GWS_CHECK"),
    ("capability", 746586753, "amd-capability", "KFD_CAPABILITY_CHECK"),
])
def test_relaxable_differences_name_their_knob_and_set_it_when_skipped(tmp_path, prop, value, check, knob):
    src = only_gpu(read_kfd_topology(KFD / "2x-mi210"), 3)
    root = tree(tmp_path, "2x-mi210")
    for node in ("2", "3"):
        set_prop(root / "nodes" / node / "properties", prop, value)
    dst = read_kfd_topology(root)
    found = problems(src, dst)
    assert {p.check for p in found} == {check}
    assert found[0].line.endswith(f"(override: GPUSNAP_SKIP_CHECKS={check})")
    p = plan(src, dst, skip=frozenset({check}))
    assert p.kfd_env == {knob: "0"}
    assert p.moves[0].target.gpu_id == 16790 and p.moves[0].relaxed == (check,)


def test_less_vram_is_refused(tmp_path):
    src = only_gpu(read_kfd_topology(KFD / "2x-mi210"), 2)
    root = tree(tmp_path, "2x-mi210")
    for node in ("2", "3"):
        set_prop(root / "nodes" / node / "mem_banks" / "0" / "properties", "size_in_bytes", 32 << 30)
    [p] = problems(src, read_kfd_topology(root))
    assert p.message == ("GPU 0 of the checkpoint (aldebaran) -> GPU 0 here (aldebaran): 32.0 GiB VRAM "
                         "here, the checkpoint's GPU had 64.0 GiB")
    assert plan(src, read_kfd_topology(root), skip=frozenset({"amd-vram"})).kfd_env == \
        {"KFD_VRAM_SIZE_CHECK": "0"}


def test_newer_firmware_here_is_fine(tmp_path):
    src = only_gpu(read_kfd_topology(KFD / "2x-mi210"), 2)
    root = tree(tmp_path, "2x-mi210")
    set_prop(root / "nodes" / "2" / "properties", "fw_version", 90)
    assert plan(src, read_kfd_topology(root)).kfd_env == {}


def test_gpus_of_two_sockets_squeezed_onto_one_is_a_numa_refusal(tmp_path):
    src = read_kfd_topology(KFD / "2x-mi210")
    root = tree(tmp_path, "2x-mi210")
    set_prop(root / "nodes" / "3" / "io_links" / "0" / "properties", "node_to", 0)  # GPU 1 -> CPU 0
    dst = read_kfd_topology(root)
    [p] = problems(src, dst)
    assert p.check == "amd-numa"
    assert p.line == ("no choice of GPUs here keeps the checkpoint's GPUs on separate CPU (NUMA) "
                      "nodes as they were: GPU 0 on CPU node 0, GPU 1 on CPU node 1 "
                      "(override: GPUSNAP_SKIP_CHECKS=amd-numa)")
    p = plan(src, dst, skip=frozenset({"amd-numa"}))
    assert p.kfd_env == {"KFD_NUMA_CHECK": "0"}


def test_xgmi_partners_must_stay_partners(tmp_path):
    src = read_kfd_topology(KFD / "2x-mi210")
    root = tree(tmp_path, "2x-mi210")
    for node in ("2", "3"):  # the bridge is gone: PCIe peer links instead
        set_prop(root / "nodes" / node / "io_links" / "1" / "properties", "type", 2)
    [p] = problems(src, read_kfd_topology(root), skip=frozenset({"amd-numa"}))
    assert p.check == "amd-gpu" and "XGMI-linked GPUs linked" in p.message


def test_an_amd_gpu_map_naming_a_missing_gpu():
    topo = read_kfd_topology(KFD / "2x-mi210")
    [p] = problems(topo, topo, gpu_map=parse_gpu_map("0=4"))
    assert p.line == "--gpu-map 0=4: this host has no GPU 4 (it has GPU 0, GPU 1)"
