"""gpusnap.gpu.drm and gpusnap.gpu.topology: sysfs facts about GPU neighbours and DRM nodes."""

from __future__ import annotations

import pytest

from gpusnap.gpu.drm import DrmNodes, drm_changes, read_drm_nodes, sysfs_bdf
from gpusnap.gpu.nodes import NodeChange, PathChange
from gpusnap.gpu.topology import Topology, read_numa


def fake_pci(root, bdf: str, *drm: str, numa: str | None = None) -> None:
    dev = root / "bus" / "pci" / "devices" / bdf
    (dev / "drm").mkdir(parents=True)
    for name in drm:
        (dev / "drm" / name).mkdir()
    if numa is not None:
        (dev / "numa_node").write_text(numa + "\n")


def test_nvml_bus_ids_become_sysfs_names():
    assert sysfs_bdf("00000000:1B:00.0") == "0000:1b:00.0"
    assert sysfs_bdf("0000:1b:00.0") == "0000:1b:00.0"
    with pytest.raises(ValueError):
        sysfs_bdf("1b:00")


def test_drm_nodes_are_read_per_pci_device(tmp_path):
    fake_pci(tmp_path, "0000:1b:00.0", "card2", "renderD129", "controlD66")
    fake_pci(tmp_path, "0000:2b:00.0")
    assert read_drm_nodes("00000000:1B:00.0", tmp_path) == DrmNodes(2, 129)
    assert read_drm_nodes("00000000:2B:00.0", tmp_path) == DrmNodes(None, None)
    assert read_drm_nodes("00000000:3B:00.0", tmp_path) == DrmNodes(None, None)


def test_drm_changes_cover_nodes_and_by_path_links():
    nodes, paths = drm_changes("0000:18:00.0", DrmNodes(1, 128), "0000:1b:00.0", DrmNodes(1, 130))
    assert nodes == [NodeChange("/dev/dri/renderD128", "/dev/dri/renderD130", (226, 128), (226, 130))]
    assert paths == [PathChange("/dev/dri/by-path/pci-0000:18:00.0-card", "/dev/dri/by-path/pci-0000:1b:00.0-card"),
                     PathChange("/dev/dri/by-path/pci-0000:18:00.0-render",
                                "/dev/dri/by-path/pci-0000:1b:00.0-render")]


def test_numa_nodes_skip_unknown_ones(tmp_path):
    fake_pci(tmp_path, "0000:18:00.0", numa="1")
    fake_pci(tmp_path, "0000:2a:00.0", numa="-1")
    assert read_numa([("a", "00000000:18:00.0"), ("b", "00000000:2A:00.0"),
                      ("c", "00000000:3A:00.0")], tmp_path) == {"a": 1}


def test_topology_from_data():
    topo = Topology.from_dict({"links": [["a", "b", 18]], "numa": {"a": 0, "b": 0, "c": 1}})
    assert topo.link("b", "a") == 18 and topo.link("a", "c") == 0
    assert topo.same_numa("a", "b") and not topo.same_numa("a", "c") and not topo.same_numa("x", "y")


@pytest.mark.parametrize("data, message", [
    ({"links": [["a", "b"]]}, r"links\[0\] is not \[uuid, uuid, count\]"),
    ({"links": [["a", "a", 1]]}, r"links\[0\] links a to itself"),
    ({"links": [["a", "b", True]]}, r"links\[0\] is not"),
    ({"numa": {"a": "0"}}, "numa is not"),
])
def test_malformed_topology(data, message):
    with pytest.raises(ValueError, match=message):
        Topology.from_dict(data)
