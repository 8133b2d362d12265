"""DRM nodes (/dev/dri/cardN, renderDN) of a PCI GPU, read from sysfs.

NVIDIA (nvidia-drm) and AMD (amdgpu) GPUs both have them; which numbers a GPU
gets depends on probe order, so they differ between hosts like GPU indices.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from gpusnap.gpu.nodes import DRM_MAJOR, NodeChange, PathChange

_CARD = re.compile(r"^card(\d+)$")
_RENDER = re.compile(r"^renderD(\d+)$")


@dataclass(frozen=True)
class DrmNodes:
    card: int | None = None
    render: int | None = None

    def to_dict(self) -> dict:
        return {"card": self.card, "render": self.render}


def sysfs_bdf(pci_bus_id: str) -> str:
    """NVML's '00000000:18:00.0' -> sysfs' '0000:18:00.0' (4-digit domain, lower case)."""
    parts = pci_bus_id.strip().lower().split(":")
    if len(parts) != 3 or "." not in parts[2]:
        raise ValueError(f"not a PCI address: {pci_bus_id!r}")
    domain = parts[0][-4:].rjust(4, "0")
    return f"{domain}:{parts[1]}:{parts[2]}"


def read_drm_nodes(pci_bus_id: str, sysfs: str | Path = "/sys") -> DrmNodes:
    """The DRM nodes of one PCI device; none when it has no DRM driver bound."""
    folder = Path(sysfs) / "bus" / "pci" / "devices" / sysfs_bdf(pci_bus_id) / "drm"
    card = render = None
    if folder.is_dir():
        for entry in sorted(folder.iterdir()):
            if m := _CARD.match(entry.name):
                card = int(m.group(1))
            elif m := _RENDER.match(entry.name):
                render = int(m.group(1))
    return DrmNodes(card, render)


def drm_changes(old_bdf: str, old: DrmNodes, new_bdf: str, new: DrmNodes
                ) -> tuple[list[NodeChange], list[PathChange]]:
    """The node and by-path changes for one GPU moving from (old_bdf, old) to (new_bdf, new)."""
    nodes, paths = [], []
    for kind, prefix, a, b in (("card", "card", old.card, new.card),
                               ("render", "renderD", old.render, new.render)):
        if a is None or b is None:
            continue
        if a != b:
            nodes.append(NodeChange(f"/dev/dri/{prefix}{a}", f"/dev/dri/{prefix}{b}",
                                    (DRM_MAJOR, a), (DRM_MAJOR, b)))
        if old_bdf != new_bdf:
            paths.append(PathChange(f"/dev/dri/by-path/pci-{old_bdf}-{kind}",
                                    f"/dev/dri/by-path/pci-{new_bdf}-{kind}"))
    return nodes, paths
