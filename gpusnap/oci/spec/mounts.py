"""Bind mounts of GPU paths: /dev/nvidiaN, /dev/dri/*, /proc/driver/nvidia/gpus/<PCI address>.

The host side (source) always follows the new GPU. The container side
(destination) changes only with container paths "host": CRIU restores bind
mounts by their destination (runc's external-mount keys), so a renamed
destination needs a checkpoint image that knows the new name.
"""

from __future__ import annotations

import copy

from gpusnap.gpu.nodes import DeviceRemap
from gpusnap.oci.spec.errors import SpecError


def is_bind(mount: dict) -> bool:
    return mount.get("type") == "bind" or bool({"bind", "rbind"} & set(mount.get("options") or []))


def remap_mounts(spec: dict, remap: DeviceRemap) -> dict:
    out = copy.deepcopy(spec)
    mounts = out.get("mounts") or []
    for m in mounts:
        if not is_bind(m) or not m.get("source"):
            continue
        source = remap.path(m["source"])
        if source is None:
            continue
        m["source"] = source
        if remap.container_paths == "host":
            m["destination"] = remap.path(m["destination"]) or m["destination"]
    seen: set[str] = set()
    for i, m in enumerate(mounts):
        if m["destination"] in seen and is_bind(m):
            raise SpecError(f"spec: after remapping, mounts[{i}] binds {m['source']} onto "
                            f"{m['destination']}, which another bind mount already uses")
        if is_bind(m):
            seen.add(m["destination"])
    return out
