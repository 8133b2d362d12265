"""Which GPUs of a host are neighbours: NVLink links and NUMA nodes (optional planner input).

Data only: the planner works without it, and prefers neighbouring targets for a
multi-GPU container when it has it. ``from_dict`` reads what a caller gathered
(e.g. from `nvidia-smi topo -m` or NVML); ``read_numa`` reads sysfs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from gpusnap.gpu.drm import sysfs_bdf


@dataclass(frozen=True)
class Topology:
    # frozenset({uuid_a, uuid_b}) -> number of NVLink links between them
    links: dict[frozenset[str], int] = field(default_factory=dict)
    numa: dict[str, int] = field(default_factory=dict)  # uuid -> NUMA node

    def link(self, a: str, b: str) -> int:
        return self.links.get(frozenset((a, b)), 0)

    def same_numa(self, a: str, b: str) -> bool:
        return a in self.numa and self.numa.get(a) == self.numa.get(b)

    @classmethod
    def from_dict(cls, data: dict) -> "Topology":
        """{"links": [[uuid_a, uuid_b, count], ...], "numa": {uuid: node}}; ValueError if malformed."""
        links: dict[frozenset[str], int] = {}
        for i, item in enumerate(data.get("links", [])):
            if (not isinstance(item, (list, tuple)) or len(item) != 3
                    or not all(isinstance(x, str) for x in item[:2])
                    or not isinstance(item[2], int) or isinstance(item[2], bool) or item[2] < 0):
                raise ValueError(f"topology: links[{i}] is not [uuid, uuid, count]")
            if item[0] == item[1]:
                raise ValueError(f"topology: links[{i}] links {item[0]} to itself")
            links[frozenset(item[:2])] = item[2]
        numa = data.get("numa", {})
        if not isinstance(numa, dict) or not all(
                isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool)
                for k, v in numa.items()):
            raise ValueError("topology: numa is not {uuid: node number}")
        return cls(links, dict(numa))


def read_numa(gpus: Iterable[tuple[str, str]], sysfs: str | Path = "/sys") -> dict[str, int]:
    """(uuid, PCI bus id) pairs -> uuid: NUMA node, for GPUs whose node is known (not -1)."""
    numa = {}
    for uuid, bus_id in gpus:
        try:  # a bus id NVML gave in another form is a GPU without a known node
            path = Path(sysfs) / "bus" / "pci" / "devices" / sysfs_bdf(bus_id) / "numa_node"
            node = int(path.read_text().strip())
        except (OSError, ValueError):
            continue
        if node >= 0:
            numa[uuid] = node
    return numa
