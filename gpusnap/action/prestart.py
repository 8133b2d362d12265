"""What gpusnap's OCI hook does: record a container's GPUs at create, judge them at restore.

runc runs prestart hooks on `create` and again on `restore` (during CRIU's
setup-namespaces step, in CRIU's stop), with the container state. A restore is
recognised by the GPU manifest CRIU's action script left in the bundle's
checkpoint directory; only a restore onto GPUs that cannot take the checkpoint
is refused. The hook's entry point is gpusnap/hook/main.py (its own Python);
at a GPU restore packaging/bin/gpusnap-hook hands it to the agent of the CRIU
runc started (agent.py, ``run_for_agent``), which has these modules and NVML
loaded already.
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
from gpusnap.criu import dumped
from gpusnap.errors import GpusnapError
from gpusnap.private import write_private
from gpusnap.runtime import kept_checkpoint

if TYPE_CHECKING:
    from collections.abc import Callable

    from gpusnap.gpu.inventory import Inventory
    from gpusnap.gpu.plan import Plan

STAGES = ("prestart", "poststop")
# run_for_agent's answer where the agent cannot judge: the hook runs in its own Python
NOT_HERE = 75
_GPU_NODE = re.compile(r"^/dev/nvidia(\d+)$")


def gpu_devices(spec: dict) -> list[dict]:
    """The spec's NVIDIA GPU device nodes (path in the container, major, minor)."""
    devices = spec.get("linux", {}).get("devices") or []
    return [d for d in devices if _GPU_NODE.match(d.get("path", ""))]


def record_assignment(container_id: str, devices: list[dict], inv: "Inventory | None" = None) -> Path:
    read_by = "agent" if inv else "hook"  # whose NVML read (action/agent.py): benchmarks tell
    inv = inv or hook_inventory()
    gpus = []
    for dev in devices:
        gpu = inv.by_minor(int(dev.get("minor", -1)))
        gpus.append({"path": dev["path"], "minor": dev.get("minor"),
                     "uuid": gpu.uuid if gpu else None, "name": gpu.name if gpu else None})
    path = journal.state_subdir("containers") / f"{container_id}.json"
    return write_private(path, json.dumps({"id": container_id, "gpus": gpus,
                                           "inventory_read_by": read_by}, indent=2))


def hook_inventory() -> "Inventory":
    """NVML read within the hook's own bound: runc kills a hook at hooks.d's
    timeout, in its words, not gpusnap's; past this bound a create goes on and
    a restore is refused, each in gpusnap's words."""
    from gpusnap.gpu.inventory import read_inventory  # start-up: the hook runs at every create
    from gpusnap.waits import Bound

    return read_inventory(Bound.of("HOOK_NVML"))


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
    from gpusnap.procs import parent_of  # start-up: the hook runs at every create

    runc = os.getppid()
    for here in journal.state_subdir("actions").glob("*-agent"):
        criu = here.name.split("-", 1)[0]
        if criu.isdigit() and parent_of(int(criu)) == runc:
            return inventory_in(here, wait_s)
    return None


def inventory_in(here: Path, wait_s: float) -> "Inventory | None":
    """The NVML read an agent (its folder ``here``) writes, once there, within ``wait_s``."""
    from gpusnap.gpu.inventory import Inventory  # start-up: the hook runs at every create

    deadline = time.monotonic() + wait_s
    while True:
        try:
            return Inventory.from_dict(json.loads((here / agent_files.INVENTORY).read_text()))
        except (OSError, ValueError, TypeError, KeyError):
            if time.monotonic() > deadline or (here / agent_files.NO_INVENTORY).exists():
                return None
            time.sleep(0.01)


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
    if seen is not None:
        problems, plan = plan_restore_here(manifest_path, spec, seen)
        if not _too_narrow(problems, seen, dev):
            return problems, plan, seen
    return (*plan_restore_here(manifest_path, spec, hook_inventory()), None)


def _too_narrow(problems: list[str], seen: "Inventory", dev: Path) -> bool:
    """Whether the agent's NVML read, from inside the container's device cgroup,
    may have refused only for the GPUs it could not see: read again from outside."""
    return bool(problems) and len(seen.gpus) < host_gpu_nodes(dev)


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
    if not dumped.whole(bundle / "checkpoint"):  # a create, not a restore:
        kept_checkpoint.at_create(bundle)  # the state a failed restore kept is given up
    # runc runs prestart hooks at a restore (CRIU's setup-namespaces) as "stopped",
    # at a create as "creating" (crun: "created"; it runs none at a restore): a
    # create never judges a checkpoint Podman kept in the folder (--keep, -R)
    if not manifest_path.exists() or state.get("status") != "stopped":
        return _act(state, spec, [], None, None)
    try:
        planned = plan_for_restore(manifest_path, spec)
    except GpusnapError as exc:  # a manifest, plan or io.gpusnap.gpu-map it cannot read:
        planned = ([exc.message], None, None)  # refused, never let by unchecked
    return _act(state, spec, *planned)


def run_for_agent(state: dict, read: "Callable[[], Inventory | None]",
                  dev: Path = Path("/dev")) -> int:
    """The prestart hook of a GPU restore, run by gpusnap's agent of the CRIU that
    runc started (action/agent.py, asked by packaging/bin/gpusnap-hook) with the
    agent's own NVML read (``read`` waits for it): no Python starts in CRIU's stop for it.
    NOT_HERE where the agent cannot judge: no manifest, no read of its own, or a
    read from inside the container's device cgroup (runc puts CRIU, and so the
    agent, there) that cannot place the checkpoint while the host has more GPU
    nodes: the hook's own Python then reads NVML from outside (plan_for_restore)."""
    from gpusnap.gpu.bundle_plan import plan_restore_here  # the agent loaded it ahead

    bundle = Path(state.get("bundle", "."))
    manifest_path = bundle / "checkpoint" / MANIFEST_NAME
    if not manifest_path.exists() or not dumped.whole(bundle / "checkpoint"):
        return NOT_HERE  # not a GPU restore: an agent of a fill alone never reads NVML
    seen = read()
    if seen is None:
        return NOT_HERE
    spec = json.loads((bundle / "config.json").read_text())
    problems, plan = plan_restore_here(manifest_path, spec, seen)
    if _too_narrow(problems, seen, dev):
        return NOT_HERE
    return _act(state, spec, problems, plan, seen)


def _live_move_problem(spec: dict, plan: "Plan") -> str | None:
    """Why the container's spec cannot take the planned move (post-resume makes it
    from this spec), in words; None where it can."""
    from gpusnap.oci.spec.cgroup import remap_cgroup_rules  # a planned move only
    from gpusnap.oci.spec.devices import remap_devices
    from gpusnap.oci.spec.errors import SpecError

    try:
        remap_cgroup_rules(remap_devices(spec, plan.remap), plan.remap)
    except SpecError as exc:
        return (f"its GPUs would move ({'; '.join(plan.describe())}), but the container's "
                f"devices cannot: {exc.message}")
    return None


def _act(state: dict, spec: dict, problems: list[str], plan: "Plan | None",
         inventory: "Inventory | None") -> int:
    """A restore's verdict (refused: 1, its words on stderr; a move onto other GPUs
    stashed for post-resume), then the container's GPUs recorded."""
    container_id = state.get("id", "unknown")
    if problems:
        journal.record("hook-refused-restore", container=container_id, problems=problems)
        print("gpusnap: cannot restore here: " + "; ".join(problems), file=sys.stderr)
        return 1
    if plan is not None and plan.needs_remap:
        problem = _live_move_problem(spec, plan)
        if problem:  # found at post-resume, it left the processes off the GPU, nobody told
            return _act(state, spec, [problem], None, inventory)
        stash_live_remap(int(state["pid"]), plan, spec)
        journal.record("restore-remap-planned", container=container_id, moves=plan.describe())
    devices = gpu_devices(spec)
    if devices:
        record_assignment(container_id, devices, inventory)
    return 0
