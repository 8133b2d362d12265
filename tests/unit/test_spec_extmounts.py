"""gpusnap.oci.spec.extmounts: the rewritten spec still answers every external mount CRIU recorded."""

from __future__ import annotations

import pytest

from gpusnap.criu.images import external_mount_keys
from gpusnap.oci.spec.errors import SpecError
from gpusnap.oci.spec.extmounts import ExternalMounts, check_external_mounts, provided_keys
from gpusnap.oci.spec.devices import remap_devices
from gpusnap.oci.spec.mounts import remap_mounts
from tests.unit.spec_samples import BDF0, EXPORT, move_0_to_2, nvidia_spec, podman_spec

REAL_KEYS = external_mount_keys(EXPORT / "checkpoint")


def test_a_real_podman_spec_provides_every_key_of_its_checkpoint():
    keys, prefixes = provided_keys(podman_spec())
    assert "/dev/nvidia0" in keys and "/etc/hosts" in keys and "/dev/null" in keys
    assert prefixes == ["/sys/fs/cgroup"]  # cgroup v1: runc names each controller's bind
    assert check_external_mounts(podman_spec(), REAL_KEYS, move_0_to_2()) == []


def test_a_key_the_spec_no_longer_provides_is_reported():
    spec = podman_spec()
    spec["mounts"] = [m for m in spec["mounts"] if m["destination"] != "/etc/hosts"]
    assert check_external_mounts(spec, REAL_KEYS, move_0_to_2()) == [
        "the checkpoint has an external mount at /etc/hosts but the rewritten spec has no bind "
        "mount or device there (CRIU would stop: no external mount for it)"]


def test_a_renamed_bind_destination_loses_its_key():
    keys = {f"/proc/driver/nvidia/gpus/{BDF0}"}
    renamed = remap_mounts(nvidia_spec(), move_0_to_2("host"))
    [error] = check_external_mounts(renamed, keys, move_0_to_2("host"))
    assert error.startswith(f"the checkpoint has an external mount at /proc/driver/nvidia/gpus/{BDF0}")
    kept = remap_mounts(nvidia_spec(), move_0_to_2("keep"))
    assert check_external_mounts(kept, keys, move_0_to_2("keep")) == []


def test_a_bind_mounted_device_cannot_keep_its_path_when_it_moves():
    # user namespace: runc bind-mounts devices, and restores them from the host path == container path
    keys = {"/dev/nvidia0"}
    spec = remap_devices(nvidia_spec(), move_0_to_2("keep"))
    [error] = check_external_mounts(spec, keys, move_0_to_2("keep"))
    assert error == ("/dev/nvidia0 was bind-mounted into the container (user namespace), and runc "
                     "restores it from the host's /dev/nvidia0, not from /dev/nvidia2 where the new "
                     "GPU is")
    assert check_external_mounts(nvidia_spec(), keys, move_0_to_2()) == []  # not moved: fine


def test_the_modifier_refuses_in_one_error_and_passes_otherwise():
    spec = nvidia_spec()
    assert ExternalMounts(set())(spec, move_0_to_2()) is spec
    with pytest.raises(SpecError, match="^spec: the checkpoint has an external mount at /x"):
        ExternalMounts({"/x"})(spec, move_0_to_2())
