"""gpusnap.oci.spec.cdi: CDI annotations name the new GPUs; names checked by CDI's rules."""

from __future__ import annotations

import pytest

from gpusnap.oci.spec.cdi import parse_qualified_name, remap_cdi_annotations
from gpusnap.oci.spec.errors import SpecError
from tests.unit.spec_samples import UUID_A, UUID_B, UUID_C, move_0_to_2, nvidia_spec, swap_0_1


def test_index_and_uuid_names_are_renamed_in_their_own_form():
    spec = nvidia_spec()
    spec["annotations"]["cdi.k8s.io/vendor_x"] = f"nvidia.com/gpu={UUID_A},nvidia.com/gpu=all"
    out = remap_cdi_annotations(spec, move_0_to_2())["annotations"]
    assert out["cdi.k8s.io/nvidia-device-plugin_GPU-0"] == "nvidia.com/gpu=2"
    assert out["cdi.k8s.io/nvidia-device-plugin_GPU-1"] == f"nvidia.com/gpu={UUID_B}"
    assert out["cdi.k8s.io/vendor_x"] == f"nvidia.com/gpu={UUID_C},nvidia.com/gpu=all"
    assert out["io.podman.annotations.init"] == "FALSE"
    assert spec["annotations"]["cdi.k8s.io/nvidia-device-plugin_GPU-0"] == "nvidia.com/gpu=0"


def test_a_swap_renames_both_at_once():
    out = remap_cdi_annotations(nvidia_spec(), swap_0_1())["annotations"]
    assert out["cdi.k8s.io/nvidia-device-plugin_GPU-0"] == "nvidia.com/gpu=1"
    assert out["cdi.k8s.io/nvidia-device-plugin_GPU-1"] == f"nvidia.com/gpu={UUID_A}"


def test_other_vendors_devices_are_not_renamed():
    spec = {"annotations": {"cdi.k8s.io/x": "vendor.com/nic=0"}}
    assert remap_cdi_annotations(spec, move_0_to_2()) == spec


@pytest.mark.parametrize("name, parts", [
    ("nvidia.com/gpu=0", ("nvidia.com", "gpu", "0")),
    ("nvidia.com/gpu=GPU-aaaa", ("nvidia.com", "gpu", "GPU-aaaa")),
    ("nvidia.com/gpu=0:1", ("nvidia.com", "gpu", "0:1")),
    ("a/b=c", ("a", "b", "c")),
])
def test_qualified_names(name, parts):
    assert parse_qualified_name(name) == parts


@pytest.mark.parametrize("name, message", [
    ("gpu0", "CDI device 'gpu0' is not qualified: missing vendor"),
    ("/dev/nvidia0", "CDI device '/dev/nvidia0' is not qualified (vendor/class=name)"),
    ("nvidia.com/=0", "CDI device 'nvidia.com/=0' is not qualified: missing class"),
    ("nvidia.com/gpu=", "CDI device 'nvidia.com/gpu=' is not qualified: missing device name"),
    ("1vidia.com/gpu=0", "CDI device '1vidia.com/gpu=0': vendor '1vidia.com' should start with a letter"),
    ("nvidia.com/g pu=0", "CDI device 'nvidia.com/g pu=0': invalid character ' ' in class 'g pu'"),
    ("nvidia.com/gpu-=0", "CDI device 'nvidia.com/gpu-=0': class 'gpu-' should end with a letter or digit"),
    ("nvidia.com/gpu=0/1", "CDI device 'nvidia.com/gpu=0/1': invalid character '/' in device name '0/1'"),
    ("nvidia.com/gpu=-0", "CDI device 'nvidia.com/gpu=-0': device name '-0' should start with a letter or digit"),
])
def test_bad_names_are_refused_precisely(name, message):
    with pytest.raises(SpecError) as err:
        parse_qualified_name(name)
    assert err.value.message == message


@pytest.mark.parametrize("key, message", [
    ("cdi.k8s.io/", "CDI annotation 'cdi.k8s.io/' has an empty name"),
    ("cdi.k8s.io/_x", "CDI annotation 'cdi.k8s.io/_x': name should start and end with a letter or digit"),
    ("cdi.k8s.io/a/b", "CDI annotation 'cdi.k8s.io/a/b': invalid character '/' in name"),
    ("cdi.k8s.io/" + "a" * 64, "CDI annotation 'cdi.k8s.io/" + "a" * 64 + "': name is 64 characters, at most 63"),
])
def test_bad_annotation_keys_are_refused(key, message):
    with pytest.raises(SpecError) as err:
        remap_cdi_annotations({"annotations": {key: "nvidia.com/gpu=0"}}, move_0_to_2())
    assert err.value.message == message


def test_a_bad_device_in_a_list_is_named():
    with pytest.raises(SpecError, match="CDI device 'gpu1' is not qualified: missing vendor"):
        remap_cdi_annotations({"annotations": {"cdi.k8s.io/x": "nvidia.com/gpu=0,gpu1"}}, move_0_to_2())
