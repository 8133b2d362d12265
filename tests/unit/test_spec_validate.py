"""gpusnap.oci.spec.validate: malformed specs are refused naming the field, before any edit."""

from __future__ import annotations

import copy

import pytest

from gpusnap.oci.spec.errors import SpecError
from gpusnap.oci.spec.validate import device_allowed, validate_spec
from tests.unit.spec_samples import allow, dev, nvidia_spec, podman_spec


def test_real_and_sample_specs_are_valid():
    validate_spec(podman_spec())
    validate_spec(nvidia_spec())
    validate_spec({})


def broken(edit) -> dict:
    spec = copy.deepcopy(nvidia_spec())
    edit(spec)
    return spec


@pytest.mark.parametrize("edit, message", [
    (lambda s: s["linux"]["devices"][3].update(minor="0"),
     "spec: linux.devices[3].minor is a string, expected an integer"),
    (lambda s: s["linux"]["devices"][3].update(minor=-1), "spec: linux.devices[3].minor is -1, expected 0 or more"),
    (lambda s: s["linux"]["devices"][3].update(type="x"),
     "spec: linux.devices[3].type is 'x', expected one of c, b, u, p"),
    (lambda s: s["linux"]["devices"][3].pop("major"),
     "spec: linux.devices[3] (/dev/nvidia0) is type c but lacks major"),
    (lambda s: s["linux"]["devices"][3].update(path="dev/nvidia0"),
     "spec: linux.devices[3].path 'dev/nvidia0' is not an absolute path"),
    (lambda s: s["linux"]["devices"][3].update(path="/dev/../etc/passwd"),
     "spec: linux.devices[3].path '/dev/../etc/passwd' contains '..'"),
    (lambda s: s["linux"]["devices"][3].update(colour="red"),
     "spec: linux.devices[3] has unknown field(s) colour"),
    (lambda s: s["linux"]["devices"].append(dev("/dev/nvidia0", 195, 7)),
     "spec: linux.devices[3] and linux.devices[7] both create /dev/nvidia0"),
    (lambda s: s["linux"].update(devices={}), "spec: linux.devices is an object, expected an array"),
    (lambda s: s["linux"]["resources"]["devices"][1].update(allow="yes"),
     "spec: linux.resources.devices[1].allow is a string, expected a boolean"),
    (lambda s: s["linux"]["resources"]["devices"][1].update(access="rwx"),
     "spec: linux.resources.devices[1].access is 'rwx', expected letters of 'rwm'"),
    (lambda s: s["linux"]["resources"]["devices"][1].update(type="u"),
     "spec: linux.resources.devices[1].type is 'u', expected a, b or c"),
    (lambda s: s["mounts"][2].pop("destination"), "spec: mounts[2] lacks destination"),
    (lambda s: s["mounts"][2].update(options="rbind"), "spec: mounts[2].options is a string, expected an array"),
    (lambda s: s["annotations"].update({"cdi.k8s.io/x": 1}),
     "spec: annotations['cdi.k8s.io/x'] is an integer, expected a string"),
    (lambda s: s["process"]["env"].append("NOVALUE"), "spec: process.env[2] has no '=', expected NAME=VALUE"),
])
def test_malformed_fields_are_named(edit, message):
    with pytest.raises(SpecError) as err:
        validate_spec(broken(edit))
    assert err.value.message == message


def test_a_spec_that_is_not_an_object():
    with pytest.raises(SpecError, match="the top level is an array, expected an object"):
        validate_spec([])


def test_device_access_follows_the_last_matching_rule():
    rules = [allow(None, None, False, kind="a"), allow(195, None), allow(195, 3, False)]
    assert device_allowed(rules, "c", 195, 1)
    assert not device_allowed(rules, "c", 195, 3)
    assert not device_allowed(rules, "c", 226, 1)
    assert not device_allowed([], "c", 195, 1)
    assert device_allowed([allow(None, None, kind="a")], "c", 1, 1)
    mknod_only = [{"allow": True, "type": "c", "major": 195, "minor": 0, "access": "m"}]
    assert not device_allowed(mknod_only, "c", 195, 0)
