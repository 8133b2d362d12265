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
import time
from pathlib import Path

from typing import TYPE_CHECKING

from gpusnap import MANIFEST_NAME, journal
from gpusnap.action import agent_files
from gpusnap.private import write_private
from gpusnap.runtime import kept_checkpoint

if TYPE_CHECKING:
    from gpusnap.gpu.inventory import Inventory
    from gpusnap.gpu.plan import Plan

STAGES = ("prestart", "poststop")
_GPU_NODE = re.compile(r"^/dev/nvidia(\d+)$")


def gpu_devices(spec: dict) -> list[dict]:
    """The spec's NVIDIA GPU device nodes (path in the container, major, minor)."""
    devices = spec.get("linux", {}).get("devices") or []
    return [d for d in devices if _GPU_NODE.match(d.get("path", ""))]


def record_assignment(container_id: str, devices: list[dict], inv: "Inventory | None" = None) -> Path:
    from gpusnap.gpu.inventory import read_inventory  # start-up: the hook runs at every create

    read_by = "agent" if inv else "hook"  # whose NVML read (action/agent.py): benchmarks tell
    inv = inv or read_inventory()
    gpus = []
    for dev in devices:
        gpu = inv.by_minor(int(dev.get("minor", -1)))
        gpus.append({"path": dev["path"], "minor": dev.get("minor"),
                     "uuid": gpu.uuid if gpu else None, "name": gpu.name if gpu else None})
    path = journal.state_subdir("containers") / f"{container_id}.json"
    return write_private(path, json.dumps({"id": container_id, "gpus": gpus,
                                           "inventory_read_by": read_by}, indent=2))


def host_gpu_nodes(dev: Path = Path("/dev")) -> int:
    """How many NVIDIA GPU nodes (/dev/nvidiaN) this host has."""
    try:
        return sum(1 for n in os.listdir(dev) if _GPU_NODE.match(f"/dev/{n}"))
    except OSError:
        return 0


def agent_inventory(wait_s: float = 0.5) -> "Inventory | None":
    """NVML's GPUs as the agent of the CRIU this runc runs read them a moment ago
    (action/agent.py): runc starts CRIU and this hook alike, so the agent's CRIU
    is this hook's sibling. None where there is no such agent, or it has not
    read them within ``wait_s``: the hook then reads NVML itself."""
    # start-up: the hook runs at every create; these only for a restore
    from gpusnap.gpu.inventory import Inventory
    from gpusnap.procs import parent_of

    runc = os.getppid()
    for here in journal.state_subdir("actions").glob("*-agent"):
        criu = here.name.split("-", 1)[0]
        if not criu.isdigit() or parent_of(int(criu)) != runc:
            continue
        deadline = time.monotonic() + wait_s
        while True:
            try:
                return Inventory.from_dict(json.loads((here / agent_files.INVENTORY).read_text()))
            except (OSError, ValueError, TypeError, KeyError):
                if time.monotonic() > deadline or (here / agent_files.NO_INVENTORY).exists():
                    return None
                time.sleep(0.01)
    return None


def plan_for_restore(manifest_path: Path, spec: dict, wait_s: float = 0.5,
                     dev: Path = Path("/dev")) -> tuple[list[str], "Plan | None", "Inventory | None"]:
    """(problems, plan, the inventory they came from: None where the hook read NVML).

    The agent's read comes first: it saves the hook loading NVML. But runc puts
    CRIU, and so the agent, in the container's device cgroup, where NVML sees
    only the container's GPUs: where that read cannot place the checkpoint and
    the host has more GPU nodes than it saw (a plain `podman container restore`
    whose GPU is full, or an annotation naming another), NVML is read again here."""
    # Here, not at the top: the hook runs at every container's create, and the
    # GPU modules are loaded only for a restore (start-up time).
    from gpusnap.gpu.bundle_plan import plan_restore_here

    seen = agent_inventory(wait_s)
    problems, plan = plan_restore_here(manifest_path, spec, seen)
    if problems and seen is not None and len(seen.gpus) < host_gpu_nodes(dev):
        seen = None
        problems, plan = plan_restore_here(manifest_path, spec)
    return problems, plan, seen


def stash_live_remap(pid: int, plan: "Plan", spec: dict) -> Path:
    """What post-resume needs to move the restored processes (keyed by the restored init pid)."""
    from gpusnap.procs import start_time  # start-up: the hook runs at every create

    # The spec holds the container's environment (API keys): root only, like the bundle's.
    return write_private(journal.state_subdir("restores") / f"{pid}.json",
                         json.dumps({"plan": plan.to_dict(), "spec": spec,
                                     "start_time": start_time(pid)}))


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
    inventory = None
    if not (bundle / "checkpoint" / "inventory.img").exists():  # a create, not a restore:
        kept_checkpoint.at_create(bundle)  # the state a failed restore kept is given up
    if manifest_path.exists():
        problems, plan, inventory = plan_for_restore(manifest_path, spec)
        if problems:
            journal.record("hook-refused-restore", container=container_id, problems=problems)
            print("gpusnap: cannot restore here: " + "; ".join(problems), file=sys.stderr)
            return 1
        if plan is not None and plan.needs_remap:
            stash_live_remap(int(state["pid"]), plan, spec)
            journal.record("restore-remap-planned", container=container_id, moves=plan.describe())
    devices = gpu_devices(spec)
    if devices:
        record_assignment(container_id, devices, inventory)
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
