"""gpusnap.oci.spec.cgroup: device cgroup rules follow the nodes they named."""

from __future__ import annotations

from gpusnap.oci.spec.cgroup import remap_cgroup_rules
from tests.unit.spec_samples import allow, move_0_to_2, nvidia_spec, swap_0_1


def rules(spec: dict) -> list[tuple]:
    return [(r.get("type"), r.get("major"), r.get("minor"), r["allow"])
            for r in spec["linux"]["resources"]["devices"]]


def test_exact_rules_follow_the_moved_nodes():
    spec = nvidia_spec()
    out = remap_cgroup_rules(spec, move_0_to_2())
    assert rules(out) == [(None, None, None, False), ("c", 195, 255, True), ("c", 508, None, True),
                          ("c", 195, 2, True), ("c", 195, 1, True), ("c", 226, 3, True),
                          ("c", 226, 130, True)]
    assert ("c", 195, 0, True) in rules(spec)  # input untouched


def test_a_swap_keeps_both_rules():
    out = remap_cgroup_rules(nvidia_spec(), swap_0_1())
    assert rules(out)[3:5] == [("c", 195, 1, True), ("c", 195, 0, True)]


def test_wildcards_and_block_rules_are_left_alone():
    spec = nvidia_spec()
    spec["linux"]["resources"]["devices"] = [allow(195, None), allow(195, -1), allow(195, 0, kind="b")]
    assert rules(remap_cgroup_rules(spec, move_0_to_2())) == rules(spec)


def test_a_spec_without_rules_is_fine():
    assert remap_cgroup_rules({"linux": {}}, move_0_to_2()) == {"linux": {}}
