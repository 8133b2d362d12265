"""`gpusnap restore`'s GPU plan: the user's --gpu-map (or GPUSNAP_GPU_MAP) on
the host as gpusnap.gpu.host_plan reads it. A refusal is one line per
problem, raised before anything is touched.
"""

from __future__ import annotations

from typing import Collection

from gpusnap.errors import GpusnapError
from gpusnap.gpu.checks import HostFacts
from gpusnap.gpu.gpumap import GpuMap, parse_gpu_map
from gpusnap.gpu.host_plan import plan_on_host
from gpusnap.gpu.inventory import Inventory
from gpusnap.gpu.manifest import Manifest
from gpusnap.gpu.plan import Plan

GPU_MAP_ENV = "GPUSNAP_GPU_MAP"


def plan_here(manifest: Manifest | None, gpu_map: str | GpuMap | None = None, *,
              remap: bool = True, only_minors: Collection[int] | None = None,
              skip: frozenset[str] | None = None, refusal_hint: str | None = None,
              inventory: Inventory | None = None, host: HostFacts | None = None) -> Plan:
    """The plan for restoring ``manifest`` on this host, or GpusnapError with every
    problem; a ``gpu_map`` for a checkpoint without GPUs among them. ``inventory``
    (NVML's GPUs), ``host`` (checks.read_host_facts): where the caller read them
    already (else read here)."""
    if manifest is None and gpu_map:
        raise GpusnapError("--gpu-map names GPUs, but the checkpoint holds no GPU state "
                           "(its container used no GPU)", "drop --gpu-map; nothing was changed")
    parsed = parse_gpu_map(gpu_map) if isinstance(gpu_map, str) else gpu_map
    result = plan_on_host(manifest, inventory, gpu_map=parsed, remap=remap,
                          only_minors=only_minors, skip=skip, host=host)
    if isinstance(result, list):
        raise GpusnapError("cannot restore here: " + "; ".join(p.line for p in result),
                           refusal_hint or "restore on a host with GPUs like the checkpoint's "
                           "(`gpusnap inspect` lists them, `gpusnap gpus` this host's); "
                           "nothing was changed")
    return result



def carried(plan: Plan) -> bool:
    """Whether ``plan`` goes with the checkpoint (checkpoint/gpusnap-plan.json) to
    the OCI hook and CRIU's action script: every GPU checkpoint's, moved or not.
    Where none is carried they plan again, as for a plain `podman container
    restore`: with other checks (not the ones this restore was told to skip)
    and free to move the GPUs this plan kept."""
    return bool(plan.moves)
