"""Where a checkpoint's GPUs go on this host: read the host, ask the planner.

The discover half of gpusnap.gpu.plan (which is pure): the inventory, the DRM
nodes and NUMA nodes from sysfs, the CPU/kernel/CRIU facts, the user's
--gpu-map (or GPUSNAP_GPU_MAP) and GPUSNAP_SKIP_CHECKS. A refusal is one line
per problem, raised before anything is touched.
"""

from __future__ import annotations

import os
from typing import Collection

from gpusnap.errors import GpusnapError
from gpusnap.gpu.checks import read_host_facts, skip_from_env
from gpusnap.gpu.drm import read_drm_nodes, sysfs_bdf
from gpusnap.gpu.gpumap import GpuMap, parse_gpu_map
from gpusnap.gpu.inventory import Inventory, read_inventory
from gpusnap.gpu.manifest import Manifest
from gpusnap.gpu.plan import Plan, plan_restore
from gpusnap.gpu.topology import Topology, read_numa

GPU_MAP_ENV = "GPUSNAP_GPU_MAP"


def _drm(inventory: Inventory) -> dict:
    nodes = {}
    for g in inventory.gpus:
        if g.pci_bus_id:
            try:
                nodes[sysfs_bdf(g.pci_bus_id)] = read_drm_nodes(g.pci_bus_id)
            except ValueError:
                continue
    return nodes


def plan_here(manifest: Manifest | None, gpu_map: str | GpuMap | None = None, *,
              remap: bool = True, only_minors: Collection[int] | None = None,
              skip: frozenset[str] | None = None, refusal_hint: str | None = None) -> Plan:
    """The plan for restoring ``manifest`` on this host, or GpusnapError with every
    problem; a ``gpu_map`` for a checkpoint without GPUs among them."""
    if manifest is None and gpu_map:
        raise GpusnapError("--gpu-map names GPUs, but the checkpoint holds no GPU state "
                           "(its container used no GPU)", "drop --gpu-map; nothing was changed")
    inventory = read_inventory()
    parsed = parse_gpu_map(gpu_map) if isinstance(gpu_map, str) else gpu_map
    topology = Topology(numa=read_numa([(g.uuid, g.pci_bus_id) for g in inventory.gpus
                                        if g.pci_bus_id]))
    result = plan_restore(manifest, inventory, gpu_map=parsed, host=read_host_facts(),
                          topology=topology, drm=_drm(inventory),
                          skip=skip_from_env(os.environ) if skip is None else skip,
                          remap=remap, only_minors=only_minors)
    if isinstance(result, list):
        raise GpusnapError("cannot restore here: " + "; ".join(p.line for p in result),
                           refusal_hint or "restore on a host with GPUs like the checkpoint's "
                           "(`gpusnap inspect` lists them, `gpusnap gpus` this host's); "
                           "nothing was changed")
    return result

