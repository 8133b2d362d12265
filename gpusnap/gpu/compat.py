"""Can this host take a checkpoint's GPU state? Checked before anything is touched.

A thin front to the planner (gpusnap.gpu.plan) for callers that want lines:
by default only the checkpoint's own GPUs count, which is what a plain
`podman container restore` can use (its spec still names them); ``remap=True``
lets the planner choose other GPUs, for callers that also rewrite the spec.
"""

from __future__ import annotations

from typing import Collection

from gpusnap.gpu.checks import MIN_CHECKPOINT_DRIVER, HostFacts, driver_major
from gpusnap.gpu.gpumap import GpuMap
from gpusnap.gpu.inventory import Inventory
from gpusnap.gpu.manifest import Manifest
from gpusnap.gpu.plan import plan_restore
from gpusnap.gpu.topology import Topology

__all__ = ["MIN_CHECKPOINT_DRIVER", "driver_major", "restore_problems"]


def restore_problems(manifest: Manifest | None, inventory: Inventory, *, remap: bool = False,
                     gpu_map: GpuMap | None = None, host: HostFacts | None = None,
                     topology: Topology | None = None, skip: frozenset[str] = frozenset(),
                     only_minors: Collection[int] | None = None) -> list[str]:
    """One clear line per reason this host cannot restore the checkpoint's GPUs."""
    result = plan_restore(manifest, inventory, remap=remap, gpu_map=gpu_map, host=host,
                          topology=topology, skip=skip, only_minors=only_minors)
    return [p.line for p in result] if isinstance(result, list) else []
