"""gpusnap.oci.spec.env: NVIDIA_VISIBLE_DEVICES names the new GPUs for hooks run at restore."""

from __future__ import annotations

import pytest

from gpusnap.oci.spec.env import remap_visible_devices
from tests.unit.spec_samples import UUID_A, UUID_B, UUID_C, move_0_to_2, nvidia_spec, swap_0_1


def env(spec: dict) -> list[str]:
    return spec["process"]["env"]


def test_indices_and_uuids_are_renamed():
    out = remap_visible_devices(nvidia_spec(), move_0_to_2())
    assert env(out) == ["PATH=/usr/bin", f"NVIDIA_VISIBLE_DEVICES=2,{UUID_B}"]
    assert env(nvidia_spec())[1] == f"NVIDIA_VISIBLE_DEVICES=0,{UUID_B}"


def test_a_swap_with_uuids_and_cdi_names():
    spec = {"process": {"env": [f"NVIDIA_VISIBLE_DEVICES={UUID_A},nvidia.com/gpu=1"]}}
    assert env(remap_visible_devices(spec, swap_0_1())) == [
        f"NVIDIA_VISIBLE_DEVICES={UUID_B},nvidia.com/gpu=0"]


@pytest.mark.parametrize("value", ["all", "none", "void", ""])
def test_special_values_stay(value):
    spec = {"process": {"env": [f"NVIDIA_VISIBLE_DEVICES={value}"]}}
    assert remap_visible_devices(spec, move_0_to_2()) == spec


def test_other_variables_stay():
    spec = {"process": {"env": ["CUDA_VISIBLE_DEVICES=0", f"X={UUID_A}"]}}
    assert remap_visible_devices(spec, move_0_to_2()) == spec
    assert UUID_C not in str(remap_visible_devices(spec, move_0_to_2()))
