"""gpusnap.oci.spec.rewrite_spec: the modifiers composed, checked before and after."""

from __future__ import annotations

import copy

import pytest

from gpusnap.criu.images import external_mount_keys
from gpusnap.gpu.nodes import DeviceRemap, NodeChange
from gpusnap.oci.spec import DEFAULT_MODIFIERS, rewrite_config_dump, rewrite_spec
from gpusnap.oci.spec.cgroup import remap_cgroup_rules
from gpusnap.oci.spec.devices import remap_devices
from gpusnap.oci.spec.errors import SpecError
from gpusnap.oci.spec.validate import device_allowed
from tests.unit.spec_samples import (BDF2, EXPORT, allow, devices_of, move_0_to_2, nvidia_spec,
                                     podman_spec)

# the real export's stand-in GPU node (/dev/zero, 1:5) moves to 1:9 at /dev/nvidia1
STAND_IN = DeviceRemap(nodes=(NodeChange("/dev/nvidia0", "/dev/nvidia1", (1, 5), (1, 9)),))


def test_a_real_podman_spec_is_rewritten_keeping_its_mounts_and_annotations():
    spec = podman_spec()
    before = copy.deepcopy(spec)
    out = rewrite_spec(spec, STAND_IN, ext_keys=external_mount_keys(EXPORT / "checkpoint"))
    assert spec == before
    assert devices_of(out) == {"/dev/nvidia1": (1, 9), "/dev/dri/renderD128": (1, 7)}
    rules = out["linux"]["resources"]["devices"]
    assert device_allowed(rules, "c", 1, 9) and not device_allowed(rules, "c", 1, 5)
    assert out["mounts"] == spec["mounts"] and out["annotations"] == spec["annotations"]


def test_every_edit_lands_in_one_pass():
    out = rewrite_spec(nvidia_spec(), move_0_to_2())
    assert devices_of(out)["/dev/nvidia0"] == (195, 2)
    assert {"allow": True, "type": "c", "access": "rwm", "major": 195, "minor": 2} in \
        out["linux"]["resources"]["devices"]
    assert out["mounts"][2]["source"] == f"/proc/driver/nvidia/gpus/{BDF2}"
    assert out["annotations"]["cdi.k8s.io/nvidia-device-plugin_GPU-0"] == "nvidia.com/gpu=2"
    assert out["process"]["env"][1].startswith("NVIDIA_VISIBLE_DEVICES=2,")


def test_modifiers_are_a_list_the_caller_chooses():
    assert len(DEFAULT_MODIFIERS) == 5
    out = rewrite_spec(nvidia_spec(), move_0_to_2(), [remap_devices, remap_cgroup_rules])
    assert devices_of(out)["/dev/nvidia0"] == (195, 2)
    assert out["mounts"] == nvidia_spec()["mounts"]
    # devices without their cgroup rules would lock the container out of its GPU
    with pytest.raises(SpecError, match="allows /dev/nvidia0 \\(195:0\\) but not its new node"):
        rewrite_spec(nvidia_spec(), move_0_to_2(), [remap_devices])


def test_a_node_allowed_before_but_denied_after_is_refused():
    spec = nvidia_spec()
    spec["linux"]["resources"]["devices"].append(allow(195, 2, False))
    with pytest.raises(SpecError) as err:
        rewrite_spec(spec, move_0_to_2())
    assert err.value.message == ("spec: after remapping, linux.resources.devices allows /dev/nvidia0 "
                                 "(195:0) but not its new node /dev/nvidia2 (195:2)")


def test_a_malformed_spec_is_refused_before_any_edit():
    spec = nvidia_spec()
    spec["linux"]["devices"][0]["major"] = "195"
    with pytest.raises(SpecError, match=r"linux.devices\[0\].major is a string"):
        rewrite_spec(spec, move_0_to_2())


def test_an_edit_that_breaks_the_spec_is_caught_after():
    def breaks(spec: dict, remap: DeviceRemap) -> dict:
        return {**spec, "mounts": [{"source": "/x"}]}

    with pytest.raises(SpecError, match=r"mounts\[0\] lacks destination"):
        rewrite_spec(nvidia_spec(), move_0_to_2(), [breaks])


def test_podman_config_dump_gets_the_same_edit():
    config = {"id": "abc", "name": "train", "spec": nvidia_spec()}
    out = rewrite_config_dump(config, move_0_to_2())
    assert out["spec"] == rewrite_spec(nvidia_spec(), move_0_to_2())
    assert out["name"] == "train" and config["spec"] == nvidia_spec()
    with pytest.raises(SpecError, match="config.dump: no 'spec' object"):
        rewrite_config_dump({"id": "abc"}, move_0_to_2())
