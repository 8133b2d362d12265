"""linux.devices: each moved GPU node gets the host numbers of its new GPU.

With container paths "host" (the default) the entry is renamed after the host
node (/dev/nvidia1), as nvidia-container-toolkit lays devices out and as libcuda
and CRIU's amdgpu plugin expect (they open the path of the minor); with "keep"
it keeps the path the processes saw (/dev/nvidia0 now reaches host node 195:1).
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Iterable, Mapping

from gpusnap.gpu.nodes import DRM_MAJOR, DeviceRemap, NodeChange
from gpusnap.oci.spec.errors import SpecError

CHAR = ("c", "u")  # 'u' is an unbuffered character device


def remap_devices(spec: dict, remap: DeviceRemap) -> dict:
    out = copy.deepcopy(spec)
    devices = (out.get("linux") or {}).get("devices") or []
    _refuse_unknown_drm(devices, remap)
    original: dict[int, str] = {}  # id(entry) -> its path before a rename
    for d in devices:
        if d.get("type") not in CHAR:
            continue
        change = remap.node(d["major"], d["minor"])
        if change is None:
            continue
        d["major"], d["minor"] = change.new
        if remap.container_paths == "host" and d["path"] == change.old_path:
            original[id(d)] = d["path"]
            d["path"] = change.new_path
    seen: dict[str, dict] = {}
    for d in devices:
        other = seen.setdefault(d["path"], d)
        if other is d:
            continue
        moved, stayed = (d, other) if id(d) in original else (other, d)
        raise SpecError(f"spec: after remapping, linux.devices has {d['path']} twice: host node "
                        f"{moved['major']}:{moved['minor']} moves there from {original[id(moved)]}, "
                        f"where the container already has {stayed['major']}:{stayed['minor']} (a GPU "
                        "it was given but the checkpoint did not use): map that GPU too, or keep "
                        "container paths")
    return out


def _refuse_unknown_drm(devices: list[dict], remap: DeviceRemap) -> None:
    """A GPU that moves takes its DRM nodes along; when the checkpoint does not say
    which DRM nodes were its own, rewriting would leave the old GPU's nodes in place.
    Nodes a change covers (AMD render nodes, known from KFD) are fine."""
    if not remap.unknown_drm:
        return
    drm = [d["path"] for d in devices if d.get("type") in CHAR and d.get("major") == DRM_MAJOR
           and remap.node(d["major"], d["minor"]) is None]
    if drm:
        raise SpecError(f"spec: the container has DRM nodes ({', '.join(drm)}) but the checkpoint "
                        "does not record which belong to the GPU(s) being moved "
                        f"({', '.join(remap.unknown_drm)})")


def shared_node_changes(spec: dict, host: Mapping[str, tuple[int, int]]) -> tuple[NodeChange, ...]:
    """Node changes for devices that are not one GPU's (/dev/nvidiactl, /dev/nvidia-uvm,
    /dev/kfd): their major can differ between hosts (nvidia-uvm's is dynamic)."""
    changes = []
    for d in (spec.get("linux") or {}).get("devices") or []:
        numbers = host.get(d.get("path"))
        if numbers and d.get("type") in CHAR and (d["major"], d["minor"]) != tuple(numbers):
            changes.append(NodeChange(d["path"], d["path"], (d["major"], d["minor"]), tuple(numbers)))
    return tuple(changes)


def read_host_numbers(paths: Iterable[str], root: str | Path = "/") -> dict[str, tuple[int, int]]:
    """(major, minor) of the character devices at these paths on this host; absent ones left out."""
    numbers = {}
    for path in paths:
        try:
            st = os.stat(Path(root) / path.lstrip("/"))
        except OSError:
            continue
        if st.st_rdev:
            numbers[path] = (os.major(st.st_rdev), os.minor(st.st_rdev))
    return numbers
