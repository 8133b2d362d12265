"""`gpusnap restore`'s GPU plan: the user's --gpu-map (or GPUSNAP_GPU_MAP) on
the host as gpusnap.gpu.host_plan reads it. A refusal is one line per
problem, raised before anything is touched.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import replace
from pathlib import Path
from typing import Collection

from gpusnap.errors import GpusnapError
from gpusnap.gpu.checks import HostFacts
from gpusnap.gpu.gpumap import GpuMap, parse_gpu_map
from gpusnap.gpu.host_plan import plan_on_host
from gpusnap.gpu.inventory import Inventory
from gpusnap.gpu.manifest import Manifest
from gpusnap.gpu.plan import Plan
from gpusnap.oci.spec.devices import read_host_numbers, shared_node_changes

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


# The nodes every GPU process of a host opens besides its GPU's own: their major
# is the driver's to pick at module load (nvidia-uvm's and nvidia-caps' are
# dynamic; amdgpu's /dev/kfd too), so it can differ between hosts and across a reboot.
_SHARED_NODE = re.compile(r"^/dev/(nvidiactl|nvidia-uvm(-tools)?|nvidia-modeset|nvidia-caps/.+"
                          r"|nvidia-caps-imex-channels/.+|nvidia-nvswitch(ctl|\d+)|nvidia-nvlink"
                          r"|gdrdrv|kfd)$")


def with_host_numbers(plan: Plan, spec: dict | None, root: str | Path = "/") -> Plan:
    """``plan`` with the checkpoint's shared GPU nodes (``spec``'s /dev/nvidia-uvm and
    the like) renumbered where this host numbers them otherwise. Kept as they
    were, the container's device rules allowed the old number and CRIU opened the
    old node in the restored /dev: another device's, or none (CRIU's restore fails)."""
    if not carried(plan) or not spec:
        return plan
    devices = (spec.get("linux") or {}).get("devices") or []
    paths = [d["path"] for d in devices if _SHARED_NODE.match(str(d.get("path") or ""))]
    host = read_host_numbers(paths, root)
    if any("nvidia-uvm" in p and p not in host for p in paths):
        _load_uvm()
        host = read_host_numbers(paths, root)  # a host booted since no CUDA ran: now it may have it
    changes = shared_node_changes(spec, host)
    if not changes:
        return plan
    return replace(plan, remap=replace(plan.remap, nodes=plan.remap.nodes + changes))


def _load_uvm() -> None:
    """nvidia-uvm loaded and its nodes made, as libcuda has it done at its first
    use (nvidia-modprobe, setuid, as nvidia-container-toolkit runs it).

    Its exit status is not read: in the containerd shim the reaper's
    waitpid(-1) can take it first (subprocess then says 0); the nodes read
    again after it are the answer."""
    tool = shutil.which("nvidia-modprobe")
    if tool is None:
        return
    try:
        subprocess.run([tool, "-u", "-c=0"], capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        pass
