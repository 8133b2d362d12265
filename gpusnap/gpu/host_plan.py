"""Where a checkpoint's GPUs go on this host: the discover half of the pure
planner (gpusnap.gpu.plan).

Every restore reads the host the same way here: `gpusnap restore` (through
gpusnap.ops.gpu_plan, which adds the user's --gpu-map and the refusal line),
and a plain `podman container restore`, planned by the OCI hook or by the CRIU
action script under crun (gpusnap.gpu.bundle_plan). A plan made without the
DRM nodes would move a GPU's /dev/nvidiaN but refuse its /dev/dri nodes only
after CRIU had restored the processes; one made without NUMA nodes could pick
other GPUs than `gpusnap restore` would.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Collection

from gpusnap.gpu.checks import HostFacts, read_host_facts, skip_from_env
from gpusnap.gpu.drm import DrmNodes, read_drm_nodes, sysfs_bdf
from gpusnap.gpu.gpumap import GpuMap
from gpusnap.gpu import inventory as gpu_inventory
from gpusnap.gpu.inventory import Inventory
from gpusnap.gpu.manifest import Manifest
from gpusnap.gpu.plan import Plan, Problem, plan_restore
from gpusnap.gpu.topology import Topology, read_numa


def drm_nodes(inventory: Inventory, sysfs: Path = Path("/sys")) -> dict[str, DrmNodes]:
    """Each GPU's DRM nodes, by PCI address in sysfs' form."""
    nodes = {}
    for g in inventory.gpus:
        if g.pci_bus_id:
            try:
                nodes[sysfs_bdf(g.pci_bus_id)] = read_drm_nodes(g.pci_bus_id, sysfs)
            except ValueError:
                continue
    return nodes


def plan_on_host(manifest: Manifest | None, inventory: Inventory | None = None, *,
                 gpu_map: GpuMap | None = None, remap: bool = True,
                 only_minors: Collection[int] | None = None,
                 skip: frozenset[str] | None = None, host_checks: bool = True,
                 host: HostFacts | None = None,
                 sysfs: Path = Path("/sys")) -> Plan | list[Problem]:
    """The plan for restoring ``manifest`` here, or every problem that stops it.

    ``inventory``: the GPUs as already read (NVML, read here when None);
    ``skip``: GPUSNAP_SKIP_CHECKS when None; ``host_checks``: the CPU, kernel
    and CRIU checks, which the hook leaves out since CRIU is restoring by then;
    ``host``: those facts as already read (read here when None).
    """
    inventory = inventory or gpu_inventory.read_inventory()
    topology = Topology(numa=read_numa([(g.uuid, g.pci_bus_id) for g in inventory.gpus
                                        if g.pci_bus_id], sysfs))
    return plan_restore(manifest, inventory, gpu_map=gpu_map,
                        host=(host or read_host_facts()) if host_checks else None,
                        topology=topology, drm=drm_nodes(inventory, sysfs),
                        skip=skip_from_env(os.environ) if skip is None else skip,
                        remap=remap, only_minors=only_minors)
