"""linux.resources.devices: the cgroup rules follow the GPU nodes they named.

Only rules naming one exact character node change; wildcards (c 195:* rwm)
already cover the new node. All rules change at once, so a swap stays a swap.
"""

from __future__ import annotations

import copy

from gpusnap.gpu.nodes import DeviceRemap


def remap_cgroup_rules(spec: dict, remap: DeviceRemap) -> dict:
    out = copy.deepcopy(spec)
    rules = ((out.get("linux") or {}).get("resources") or {}).get("devices") or []
    for rule in rules:
        if rule.get("type") != "c" or -1 in (rule.get("major", -1), rule.get("minor", -1)) \
                or None in (rule.get("major"), rule.get("minor")):
            continue
        change = remap.node(rule["major"], rule["minor"])
        if change is not None:
            rule["major"], rule["minor"] = change.new
    return out
