"""OCI prestart/poststop hook: record a container's GPUs at create, validate them at restore.

runc runs prestart hooks on `create` and again on `restore` (during CRIU's
setup-namespaces step), with the container state on stdin, and the stage as
argument (`gpusnap-hook prestart|poststop`). A restore is
recognised by the GPU manifest CRIU's action script left in the bundle's
checkpoint directory. The hook must never stop a container that gpusnap has
nothing to say about: any unexpected failure exits 0 after a note in the
journal; only a restore onto GPUs that cannot take the checkpoint fails.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

from gpusnap import MANIFEST_NAME, PLAN_NAME, journal

STAGES = ("prestart", "poststop")
_GPU_NODE = re.compile(r"^/dev/nvidia(\d+)$")


def gpu_devices(spec: dict) -> list[dict]:
    """The spec's NVIDIA GPU device nodes (path in the container, major, minor)."""
    devices = spec.get("linux", {}).get("devices") or []
    return [d for d in devices if _GPU_NODE.match(d.get("path", ""))]


def record_assignment(container_id: str, devices: list[dict]) -> Path:
    from gpusnap.gpu.inventory import read_inventory

    inv = read_inventory()
    gpus = []
    for dev in devices:
        gpu = inv.by_minor(int(dev.get("minor", -1)))
        gpus.append({"path": dev["path"], "minor": dev.get("minor"),
                     "uuid": gpu.uuid if gpu else None, "name": gpu.name if gpu else None})
    folder = journal.state_dir() / "containers"
    folder.mkdir(mode=0o700, exist_ok=True)
    path = folder / f"{container_id}.json"
    path.write_text(json.dumps({"id": container_id, "gpus": gpus}, indent=2))
    os.chmod(path, 0o600)
    return path


def validate_restore(manifest_path: Path) -> list[str]:
    """Problems with restoring here; with a plan beside the manifest (a remapping
    `gpusnap restore`), its target GPUs are checked as the plan pinned them."""
    from gpusnap.gpu.compat import restore_problems
    from gpusnap.gpu.inventory import read_inventory
    from gpusnap.gpu.manifest import Manifest

    manifest = Manifest.from_dict(json.loads(manifest_path.read_text()))
    plan_path = manifest_path.with_name(PLAN_NAME)
    if not plan_path.exists():
        return restore_problems(manifest, read_inventory())
    from gpusnap.gpu.plan import Plan
    from gpusnap.ops.gpu_plan import pinned_map

    plan = Plan.from_dict(json.loads(plan_path.read_text()))
    return restore_problems(manifest, read_inventory(), remap=True, gpu_map=pinned_map(plan),
                            skip=frozenset(p.check for p in plan.overridden))


def forget_assignment(container_id: str) -> None:
    (journal.state_dir() / "containers" / f"{container_id}.json").unlink(missing_ok=True)


def run(state: dict, stage: str | None = None) -> int:
    """``stage`` comes from the hook's arguments (one hooks.d file per stage):
    runc reports a container it is restoring as "stopped", like a stopped one."""
    bundle = Path(state.get("bundle", "."))
    container_id = state.get("id", "unknown")
    poststop = stage == "poststop" if stage else state.get("status") == "stopped"
    if poststop:
        forget_assignment(container_id)
        return 0
    spec = json.loads((bundle / "config.json").read_text())
    manifest_path = bundle / "checkpoint" / MANIFEST_NAME
    if manifest_path.exists():
        problems = validate_restore(manifest_path)
        if problems:
            journal.record("hook-refused-restore", container=container_id, problems=problems)
            print("gpusnap: cannot restore here: " + "; ".join(problems), file=sys.stderr)
            return 1
    devices = gpu_devices(spec)
    if devices:
        record_assignment(container_id, devices)
    return 0


def main() -> int:
    try:
        state = json.load(sys.stdin)
        stage = sys.argv[1] if len(sys.argv) > 1 and sys.argv[1] in STAGES else None
        return run(state, stage)
    except Exception as exc:  # never block a container gpusnap cannot judge
        # str() of an OSError names the file; repr() drops it
        journal.record("hook-error", error=f"{type(exc).__name__}: {exc}")
        return 0


if __name__ == "__main__":
    sys.exit(main())
