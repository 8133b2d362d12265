"""gpusnap.oci.spec.devices: linux.devices entries get the new GPU's host numbers."""

from __future__ import annotations

import os

import pytest

from gpusnap.gpu.nodes import DeviceRemap, NodeChange
from gpusnap.oci.spec.devices import read_host_numbers, remap_devices, shared_node_changes
from gpusnap.oci.spec.errors import SpecError
from tests.unit.spec_samples import devices_of, move_0_to_2, nvidia_spec, swap_0_1


def test_keep_paths_changes_only_the_numbers():
    spec = nvidia_spec()
    out = remap_devices(spec, move_0_to_2())
    assert devices_of(out) == {**devices_of(spec), "/dev/nvidia0": (195, 2),
                               "/dev/dri/card1": (226, 3), "/dev/dri/renderD128": (226, 130)}
    assert devices_of(spec)["/dev/nvidia0"] == (195, 0)  # the input is untouched


def test_host_paths_renames_the_moved_nodes():
    out = remap_devices(nvidia_spec(), move_0_to_2("host"))
    devices = devices_of(out)
    assert devices["/dev/nvidia2"] == (195, 2) and "/dev/nvidia0" not in devices
    assert devices["/dev/dri/renderD130"] == (226, 130) and devices["/dev/nvidia1"] == (195, 1)
    entry = next(d for d in out["linux"]["devices"] if d["path"] == "/dev/nvidia2")
    assert entry["fileMode"] == 8630 and entry["type"] == "c"


def test_a_swap_is_applied_at_once():
    devices = devices_of(remap_devices(nvidia_spec(), swap_0_1("keep")))
    assert devices["/dev/nvidia0"] == (195, 1) and devices["/dev/nvidia1"] == (195, 0)
    # with host paths the two entries trade places: each path again names its own host node
    out = remap_devices(nvidia_spec(), swap_0_1("host"))["linux"]["devices"]
    assert [(d["path"], d["major"], d["minor"]) for d in out[3:5]] == [
        ("/dev/nvidia1", 195, 1), ("/dev/nvidia0", 195, 0)]


def test_moving_onto_a_path_the_container_already_has_is_refused():
    remap = DeviceRemap(nodes=(NodeChange("/dev/nvidia0", "/dev/nvidia1", (195, 0), (195, 7)),),
                        container_paths="host")
    with pytest.raises(SpecError) as err:
        remap_devices(nvidia_spec(), remap)
    assert err.value.message == (
        "spec: after remapping, linux.devices has /dev/nvidia1 twice: host node 195:7 moves there "
        "from /dev/nvidia0, where the container already has 195:1 (a GPU it was given but the "
        "checkpoint did not use): map that GPU too, or keep container paths")


def test_drm_nodes_of_a_gpu_whose_drm_nodes_are_unknown_are_refused():
    remap = DeviceRemap(nodes=(NodeChange("/dev/nvidia0", "/dev/nvidia2", (195, 0), (195, 2)),),
                        unknown_drm=("GPU-aaaa",))
    with pytest.raises(SpecError, match=r"DRM nodes \(/dev/dri/card1, /dev/dri/renderD128\) but "
                                        r"the checkpoint does not record which belong to the GPU\(s\) "
                                        r"being moved \(GPU-aaaa\)"):
        remap_devices(nvidia_spec(), remap)
    spec = nvidia_spec()
    spec["linux"]["devices"] = [d for d in spec["linux"]["devices"] if d["major"] != 226]
    assert devices_of(remap_devices(spec, remap))["/dev/nvidia2"] == (195, 2)


def test_shared_nodes_take_this_hosts_numbers():
    changes = shared_node_changes(nvidia_spec(), {"/dev/nvidia-uvm": (511, 0),
                                                  "/dev/nvidia-uvm-tools": (508, 1),
                                                  "/dev/nvidiactl": (195, 255)})
    assert changes == (NodeChange("/dev/nvidia-uvm", "/dev/nvidia-uvm", (508, 0), (511, 0)),)
    out = remap_devices(nvidia_spec(), move_0_to_2().with_nodes(changes))
    assert devices_of(out)["/dev/nvidia-uvm"] == (511, 0)


def test_host_numbers_are_read_from_device_files():
    numbers = read_host_numbers(["/dev/null", "/dev/zero", "/dev/nope", "/etc/hostname"])
    assert numbers == {"/dev/null": (1, 3), "/dev/zero": (1, 5)}
    assert os.path.exists("/dev/null")
