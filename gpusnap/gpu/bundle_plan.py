"""The GPU plan of a restore bundle's checkpoint: the one `gpusnap restore`
pinned beside the manifest, re-checked, or else one made here from the spec.
The OCI hook (under runc) and the CRIU action script (under crun, which runs
no hook) both ask it.
"""

from __future__ import annotations

from pathlib import Path

from gpusnap import PLAN_NAME
from gpusnap.errors import GpusnapError
from gpusnap.gpu import inventory as gpu_inventory
from gpusnap.gpu.gpumap import GPU_MAP_ANNOTATION, parse_gpu_map
from gpusnap.gpu.inventory import Inventory
from gpusnap.gpu import manifest as gpu_manifest
from gpusnap.gpu.host_plan import plan_on_host
from gpusnap.gpu.plan import Plan, recheck


def plan_restore_here(manifest_path: Path, spec: dict, inventory: Inventory | None = None,
                      sysfs: Path = Path("/sys")) -> tuple[list[str], Plan | None]:
    """(problems, plan) for restoring here.

    With a plan beside the manifest (`gpusnap restore` rewrote the spec for it),
    its targets are re-checked. Without one (a plain `podman container restore`),
    the spec still names the checkpoint's GPUs; where they cannot take it, other
    GPUs are planned (or the `io.gpusnap.gpu-map` annotation's), and the CRIU
    action script moves the restored processes onto them before they resume.
    """
    try:
        manifest = gpu_manifest.parse(manifest_path.read_text(), "the checkpoint's GPU manifest")
    except OSError as exc:
        raise GpusnapError(f"the checkpoint's GPU manifest cannot be read ({exc})",
                           "take the checkpoint again") from None
    inventory = inventory or gpu_inventory.read_inventory()
    plan_path = manifest_path.with_name(PLAN_NAME)
    if plan_path.exists():  # the plan `gpusnap restore` made: checked, not made again
        pinned = Plan.from_json(plan_path.read_text())
        return [p.line for p in recheck(pinned, manifest, inventory)], None
    annotation = (spec.get("annotations") or {}).get(GPU_MAP_ANNOTATION)
    # as `gpusnap restore` plans (DRM and NUMA nodes), less the CPU, kernel and CRIU
    # checks (CRIU is restoring by now) and skipped checks: runc gives a hook no
    # user's environment, and a malformed one must not end the hook, which lets it by
    result = plan_on_host(manifest, inventory, host_checks=False, sysfs=sysfs, skip=frozenset(),
                          gpu_map=parse_gpu_map(annotation) if annotation else None)
    if isinstance(result, list):
        return [p.line for p in result], None
    return [], result
