"""gpusnap.oci.spec.mounts: bind mounts of GPU paths take the new GPU's host paths."""

from __future__ import annotations

import pytest

from gpusnap.oci.spec.errors import SpecError
from gpusnap.oci.spec.mounts import remap_mounts
from tests.unit.spec_samples import BDF0, BDF1, BDF2, bind, move_0_to_2, nvidia_spec, swap_0_1


def binds(spec: dict) -> list[tuple[str, str]]:
    return [(m["source"], m["destination"]) for m in spec["mounts"] if m.get("type") == "bind"]


def test_keep_changes_sources_only():
    out = remap_mounts(nvidia_spec(), move_0_to_2())
    assert binds(out)[:2] == [(f"/proc/driver/nvidia/gpus/{BDF2}", f"/proc/driver/nvidia/gpus/{BDF0}"),
                              (f"/proc/driver/nvidia/gpus/{BDF1}", f"/proc/driver/nvidia/gpus/{BDF1}")]
    assert binds(out)[2][0].endswith("libcuda.so.580.159.04")


def test_host_changes_destinations_too():
    out = remap_mounts(nvidia_spec(), move_0_to_2("host"))
    assert binds(out)[0] == (f"/proc/driver/nvidia/gpus/{BDF2}", f"/proc/driver/nvidia/gpus/{BDF2}")


def test_device_nodes_and_by_path_links_mounted_one_by_one():
    spec = {"mounts": [bind("/dev/nvidia0"), bind("/dev/dri/renderD128"),
                       bind(f"/dev/dri/by-path/pci-{BDF0}-card"),
                       {"destination": "/dev/nvidia0x", "type": "tmpfs", "source": "/dev/nvidia0"}]}
    out = remap_mounts(spec, move_0_to_2())
    assert [m["source"] for m in out["mounts"]] == [
        "/dev/nvidia2", "/dev/dri/renderD130", f"/dev/dri/by-path/pci-{BDF2}-card", "/dev/nvidia0"]
    assert [m["destination"] for m in out["mounts"]][:3] == [
        "/dev/nvidia0", "/dev/dri/renderD128", f"/dev/dri/by-path/pci-{BDF0}-card"]


def test_bind_is_recognised_by_option_as_well_as_type():
    spec = {"mounts": [{"destination": "/dev/nvidia0", "source": "/dev/nvidia0", "options": ["bind"]}]}
    assert remap_mounts(spec, move_0_to_2())["mounts"][0]["source"] == "/dev/nvidia2"


@pytest.mark.parametrize("paths", ["keep", "host"])
def test_a_swap_exchanges_sources(paths):
    out = remap_mounts(nvidia_spec(), swap_0_1(paths))
    sources = [s for s, _ in binds(out)[:2]]
    assert sources == [f"/proc/driver/nvidia/gpus/{BDF1}", f"/proc/driver/nvidia/gpus/{BDF0}"]


def test_two_binds_onto_one_destination_are_refused():
    spec = {"mounts": [bind(f"/proc/driver/nvidia/gpus/{BDF0}"), bind(f"/proc/driver/nvidia/gpus/{BDF2}")]}
    with pytest.raises(SpecError, match=f"mounts\\[1\\] binds /proc/driver/nvidia/gpus/{BDF2} onto "
                                        f"/proc/driver/nvidia/gpus/{BDF2}, which another bind"):
        remap_mounts(spec, move_0_to_2("host"))
