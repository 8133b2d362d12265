"""Choose this host's GPUs for a checkpoint's GPUs, or say why none fit.

Pure: the checkpoint's GPU manifest, this host's inventory and optional facts
(--gpu-map, topology, DRM nodes, CRIU and kernel versions) go in; a Plan or a
list of Problems comes out. Nothing on the host is read or touched here, so a
dry run and the real restore decide the same way.

Preference among targets that fit (same chip and compute capability, enough
free memory, not MIG): the checkpoint's own GPU (no remap needed, works on
r570), then NVLink and NUMA neighbours kept together for multi-GPU containers,
then the same index, then the least loaded.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Collection, Mapping

from gpusnap import PLAN_NAME
from gpusnap.errors import GpusnapError
from gpusnap.gpu.assign import assign
from gpusnap.gpu.checks import (MIN_CHECKPOINT_DRIVER, MIN_REMAP_DRIVER, HostFacts, Problem,
                                driver_major, driver_problems, host_problems, split_skipped)
from gpusnap.gpu.drm import DrmNodes, drm_changes, sysfs_bdf
from gpusnap.gpu.gpumap import GpuMap, parse_gpu_map, resolve_gpu_map
from gpusnap.gpu.inventory import GpuInfo, Inventory
from gpusnap.gpu.manifest import Manifest
from gpusnap.gpu.nodes import NVIDIA_MAJOR, ContainerPaths, DeviceRemap, NodeChange, PathChange
from gpusnap.gpu.topology import Topology

GIB = 1 << 30


def gib(n: int) -> str:
    return f"{n / GIB:.1f} GiB"


@dataclass(frozen=True)
class GpuSlot:
    """One GPU as the planner sees it, on either side."""

    index: int
    uuid: str
    name: str
    compute_capability: str | None = None
    minor: int | None = None
    pci_bus_id: str | None = None
    memory_total: int | None = None
    memory_used: int = 0
    mig_enabled: bool = False
    drm: DrmNodes | None = None

    @classmethod
    def from_manifest(cls, g: dict) -> "GpuSlot":
        drm = g.get("drm")
        return cls(index=g["index"], uuid=g["uuid"], name=g["name"],
                   compute_capability=g.get("compute_capability"), minor=g.get("minor"),
                   pci_bus_id=g.get("pci_bus_id"), memory_total=g.get("memory_total"),
                   mig_enabled=bool(g.get("mig_enabled", False)),
                   drm=DrmNodes(drm.get("card"), drm.get("render")) if isinstance(drm, dict) else None)

    @classmethod
    def from_info(cls, g: GpuInfo, drm: DrmNodes | None = None) -> "GpuSlot":
        return cls(index=g.index, uuid=g.uuid, name=g.name, compute_capability=g.compute_capability,
                   minor=g.minor, pci_bus_id=g.pci_bus_id, memory_total=g.memory_total,
                   memory_used=g.memory_used, mig_enabled=g.mig_enabled, drm=drm)

    @property
    def free(self) -> int | None:
        return None if self.memory_total is None else max(self.memory_total - self.memory_used, 0)

    @property
    def chip(self) -> str:
        cc = f", compute capability {self.compute_capability}" if self.compute_capability else ""
        return f"{self.name}{cc}"

    @property
    def label(self) -> str:
        return f"GPU {self.index} ({self.name}, {self.uuid})"

    def same_chip(self, other: "GpuSlot") -> bool:
        # An older manifest may lack the compute capability: the name decides then.
        cc_known = self.compute_capability and other.compute_capability
        return self.name == other.name and (not cc_known or
                                            self.compute_capability == other.compute_capability)

    def to_dict(self) -> dict:
        d = {"index": self.index, "uuid": self.uuid, "name": self.name,
             "compute_capability": self.compute_capability, "minor": self.minor,
             "pci_bus_id": self.pci_bus_id}
        if self.drm is not None:
            d["drm"] = self.drm.to_dict()
        return d


@dataclass(frozen=True)
class Move:
    source: GpuSlot
    target: GpuSlot
    reasons: tuple[str, ...]

    @property
    def moved(self) -> bool:
        return self.source.uuid != self.target.uuid

    def describe(self) -> str:
        return (f"GPU {self.source.index} ({self.source.uuid}) -> GPU {self.target.index} "
                f"({self.target.uuid}): {'; '.join(self.reasons)}")

    def to_dict(self) -> dict:
        return {"source": self.source.to_dict(), "target": self.target.to_dict(),
                "reasons": list(self.reasons)}


@dataclass(frozen=True)
class Plan:
    moves: tuple[Move, ...]
    # every GPU the driver sees here as (old UUID, new UUID), for cuCheckpointProcessRestore
    uuid_pairs: tuple[tuple[str, str], ...]
    remap: DeviceRemap
    overridden: tuple[Problem, ...] = ()

    @property
    def needs_remap(self) -> bool:
        return any(m.moved for m in self.moves)

    def driver_pairs(self) -> list[tuple[str, str]] | None:
        """What CudaDriver.restore takes: None when every GPU is the checkpoint's own
        (then no r580 driver is needed), else the complete pairs."""
        return list(self.uuid_pairs) if self.needs_remap else None

    def pair_choices(self) -> list[tuple[str, list[tuple[str, str]] | None]]:
        """The GPU UUID pairs to offer the driver, in order: every GPU it sees (what it
        asks of a process that can reach them all), then only the moved ones (what it
        takes in a container that reaches only its own GPUs),
        then none (it maps by the nodes the process can open)."""
        every = self.driver_pairs()
        if every is None:
            return [("none", None)]
        moved = [(m.source.uuid, m.target.uuid) for m in self.moves if m.moved]
        choices: list[tuple[str, list[tuple[str, str]] | None]] = [("every GPU", every)]
        if sorted(moved) != sorted(every):
            choices.append(("moved GPUs", moved))
        return choices + [("none", None)]

    def describe(self) -> list[str]:
        lines = [m.describe() for m in self.moves]
        lines += [f"check overridden: {p.message}" for p in self.overridden]
        return lines

    def to_dict(self) -> dict:
        return {"moves": [m.to_dict() for m in self.moves],
                "uuid_pairs": [list(p) for p in self.uuid_pairs],
                "remap": self.remap.to_dict(),
                "overridden": [{"check": p.check, "message": p.message} for p in self.overridden]}

    @classmethod
    def from_json(cls, text: str | bytes) -> "Plan":
        """The plan `gpusnap restore` carried with a checkpoint; GpusnapError where
        it is damaged (the hook and the CRIU action script both read it)."""
        try:
            return cls.from_dict(json.loads(text))
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
            raise GpusnapError(f"the checkpoint's {PLAN_NAME} is not a GPU plan gpusnap can "
                               f"read ({type(exc).__name__}: {exc})",
                               "restore it with `gpusnap restore`, which plans it again") from None

    @classmethod
    def from_dict(cls, d: dict) -> "Plan":
        moves = tuple(Move(GpuSlot.from_manifest(m["source"]), GpuSlot.from_manifest(m["target"]),
                           tuple(m["reasons"])) for m in d["moves"])
        return cls(moves=moves, uuid_pairs=tuple((o, n) for o, n in d["uuid_pairs"]),
                   remap=DeviceRemap.from_dict(d["remap"]),
                   overridden=tuple(Problem(p["check"], p["message"]) for p in d.get("overridden", [])))


# --- placement ------------------------------------------------------------------------------

def _need(manifest: Manifest, uuid: str) -> int:
    return sum(p.gpu_memory.get(uuid, 0) for p in manifest.processes)


def _violations(s: GpuSlot, t: GpuSlot, need: int, prefix: str) -> list[Problem]:
    """What is wrong with putting s on t, one Problem per check."""
    out = []
    if not s.same_chip(t):
        out.append(Problem("chip", f"{prefix}GPU {t.index} here is a {t.chip}, GPU {s.index} of "
                           f"the checkpoint was a {s.chip}"))
    if t.free is not None and need > t.free:
        out.append(Problem("memory", f"{prefix}GPU {t.index} here has {gib(t.free)} free, GPU "
                           f"{s.index} of the checkpoint's processes used {gib(need)}"))
    if t.mig_enabled:
        out.append(Problem("mig", f"{prefix}GPU {t.index} here is in MIG mode, which the driver "
                           "cannot restore into"))
    return out


def _no_candidate(s: GpuSlot, pool: list[GpuSlot], need: int, skip: frozenset[str],
                  restricted: bool) -> Problem:
    """Why no GPU here can take s: the first filter that empties the pool."""
    where = "among the container's GPUs" if restricted else "here"
    if not pool:
        return Problem("count", f"{s.label} of the checkpoint has no GPU {where} to go to")
    chip_ok = [t for t in pool if "chip" in skip or s.same_chip(t)]
    if not chip_ok:
        have = ", ".join(f"GPU {t.index} is a {t.chip}" for t in pool)
        return Problem("chip", f"GPU {s.index} of the checkpoint ({s.uuid}) was a {s.chip} and no "
                       f"GPU {where} is the same chip: {have}")
    mem_ok = [t for t in chip_ok if "memory" in skip or t.free is None or need <= t.free]
    if not mem_ok:
        have = ", ".join(f"GPU {t.index} has {gib(t.free or 0)}" for t in chip_ok)
        return Problem("memory", f"GPU {s.index} of the checkpoint ({s.uuid}) needs {gib(need)} "
                       f"free on a {s.name} and no such GPU {where} has it: {have}")
    return Problem("mig", f"GPU {s.index} of the checkpoint ({s.uuid}) fits only GPUs in MIG mode "
                   f"{where} ({', '.join(f'GPU {t.index}' for t in mem_ok)}), which the driver "
                   "cannot restore into")


def _reasons(s: GpuSlot, t: GpuSlot, need: int, cands: list[GpuSlot], pin: str | None,
             chosen: dict[str, GpuSlot], topo: Topology) -> tuple[str, ...]:
    out = []
    if pin:
        out.append(f"chosen by --gpu-map {pin}")
    if s.uuid == t.uuid:
        out.append("the checkpoint's own GPU")
    out.append(f"same chip ({s.chip})" if s.same_chip(t) else f"other chip ({t.chip}), check skipped")
    if need and t.free is not None:
        out.append(f"{gib(t.free)} free for the {gib(need)} its processes used")
    if s.uuid != t.uuid and s.index == t.index:
        out.append(f"same index {t.index}")
    if not pin and s.uuid != t.uuid and len(cands) > 1 and \
            t.memory_used == min(c.memory_used for c in cands):
        out.append(f"least loaded of {len(cands)} candidates ({gib(t.memory_used)} in use)")
    for other in chosen.values():
        if other.uuid != t.uuid and topo.link(t.uuid, other.uuid):
            out.append(f"NVLink x{topo.link(t.uuid, other.uuid)} to GPU {other.index}")
    peers = [o.index for o in chosen.values() if o.uuid != t.uuid and topo.same_numa(t.uuid, o.uuid)]
    if peers:
        out.append(f"NUMA node {topo.numa[t.uuid]} with GPU {', '.join(map(str, peers))}")
    return tuple(out)


def _candidates(sources: list[GpuSlot], targets: list[GpuSlot], pool: list[GpuSlot],
                need: dict[str, int], pins: dict[str, str], pin_text: dict[str, str],
                skip: frozenset[str], remap: bool, restricted: bool
                ) -> tuple[dict[str, list[GpuSlot]], list[Problem]]:
    """Each source's possible targets, best first, and why a source has none."""
    cands: dict[str, list[GpuSlot]] = {}
    problems: list[Problem] = []
    for s in sources:
        if not remap:
            here = next((t for t in targets if t.uuid == s.uuid), None)
            if here is None or here not in pool:
                where = "is not on this host" if here is None else \
                    "is on this host but not among the container's GPUs"
                problems.append(Problem("count", f"GPU {s.index} of the checkpoint ({s.name}, "
                                                 f"{s.uuid}) {where}"))
                cands[s.uuid] = []
                continue
            if here.name != s.name:  # the same GPU reporting another chip: no override helps
                problems.append(Problem("chip", f"GPU {s.uuid} is a {here.name} here but was a "
                                                f"{s.name}", skippable=False))
                cands[s.uuid] = []
                continue
            found = _violations(s, here, need[s.uuid], f"GPU {s.index} of the checkpoint stays on "
                                                       "its GPU, but ")
        elif s.uuid in pins:
            here = next(t for t in targets if t.uuid == pins[s.uuid])
            if here not in pool:
                problems.append(Problem("gpu-map", f"--gpu-map {pin_text[s.uuid]}: GPU {here.index} "
                                        "is not among the container's GPUs"))
                cands[s.uuid] = []
                continue
            found = _violations(s, here, need[s.uuid], f"--gpu-map {pin_text[s.uuid]}: ")
        else:
            fits = [t for t in pool if not split_skipped(_violations(s, t, need[s.uuid], ""), skip)[0]]
            if not fits:
                problems.append(_no_candidate(s, pool, need[s.uuid], skip, restricted))
            cands[s.uuid] = sorted(fits, key=lambda t: (t.uuid != s.uuid, t.index != s.index,
                                                        t.memory_used, t.index))
            continue
        blocking = split_skipped(found, skip)[0]
        problems += blocking
        cands[s.uuid] = [] if blocking else [here]
    return cands, problems


def complete_pairs(moves: dict[str, str], visible: list[str]) -> list[tuple[str, str]]:
    """Extend source -> target UUIDs to pairs whose new side is every GPU the driver sees.

    The driver wants every GPU it sees in the map (field notes), so GPUs the
    checkpoint did not use map to themselves, and a GPU here that was a source
    but is now free takes the old UUID of the target chain that displaced it
    (on one host this yields a permutation: 0->1 also gives 1->0).
    """
    pairs = [(s, t) for s, t in moves.items()]
    targets = set(moves.values())
    for gpu in visible:
        if gpu in targets:
            continue
        if gpu not in moves:
            pairs.append((gpu, gpu))
            continue
        end = moves[gpu]
        while end in moves:  # walk the chain gpu -> t1 -> t2 ... to a target that was no source
            end = moves[end]
        pairs.append((end, gpu))
    return pairs


def _remap(moves: list[Move], container_paths: ContainerPaths) -> DeviceRemap:
    nodes: list[NodeChange] = []
    paths: list[PathChange] = []
    ids: list[tuple[str, str]] = []
    unknown_drm: list[str] = []
    for m in moves:
        s, t = m.source, m.target
        if s.minor is not None and t.minor is not None and s.minor != t.minor:
            nodes.append(NodeChange(f"/dev/nvidia{s.minor}", f"/dev/nvidia{t.minor}",
                                    (NVIDIA_MAJOR, s.minor), (NVIDIA_MAJOR, t.minor)))
        old_bdf = sysfs_bdf(s.pci_bus_id) if s.pci_bus_id else None
        new_bdf = sysfs_bdf(t.pci_bus_id) if t.pci_bus_id else None
        if old_bdf and new_bdf and old_bdf != new_bdf:
            paths.append(PathChange(f"/proc/driver/nvidia/gpus/{old_bdf}",
                                    f"/proc/driver/nvidia/gpus/{new_bdf}"))
        if s.drm is not None and t.drm is not None and old_bdf and new_bdf:
            drm_nodes, drm_paths = drm_changes(old_bdf, s.drm, new_bdf, t.drm)
            nodes += drm_nodes
            paths += drm_paths
        elif old_bdf != new_bdf or s.minor != t.minor:
            unknown_drm.append(s.uuid)
        if s.index != t.index:
            ids.append((str(s.index), str(t.index)))
        if s.uuid != t.uuid:
            ids.append((s.uuid, t.uuid))
    return DeviceRemap(nodes=tuple(nodes), paths=tuple(paths), ids=tuple(ids),
                       container_paths=container_paths, unknown_drm=tuple(unknown_drm))


def _crowded_out(sources: list[GpuSlot], targets: list[GpuSlot],
                 cands: dict[str, list[GpuSlot]], chosen: dict[str, GpuSlot]) -> list[Problem]:
    """A checkpoint GPU left without a target although some GPU here could take
    it: that GPU went to another of the checkpoint's GPUs."""
    problems = []
    for s in sources:
        if s.uuid not in chosen and cands[s.uuid]:
            takers = [f"GPU {o.index}->GPU {chosen[o.uuid].index}" for o in sources
                      if o.uuid in chosen and chosen[o.uuid] in cands[s.uuid]]
            where = "cannot stay on its GPU" if any(t.uuid == s.uuid for t in targets) else \
                "is not on this host"
            problems.append(Problem("count", f"GPU {s.index} of the checkpoint ({s.name}, {s.uuid}) "
                                    f"{where}, and the {len(cands[s.uuid])} GPU(s) here "
                                    f"that could take it go to the checkpoint's other GPUs "
                                    f"({', '.join(takers)})"))
    return problems


def _move_problems(moved: list[Move], inventory: Inventory) -> list[Problem]:
    """What stops the moves themselves: a driver too old to remap, nodes not recorded."""
    problems = []
    if moved and MIN_CHECKPOINT_DRIVER <= driver_major(inventory.driver_version) < MIN_REMAP_DRIVER:
        problems.append(Problem("remap-driver", "restoring onto other GPUs ("
                                + ", ".join(f"{m.source.index}->{m.target.index}" for m in moved)
                                + f") needs NVIDIA driver r{MIN_REMAP_DRIVER} or newer, this host "
                                  f"has {inventory.driver_version}"))
    lacking = [m.source.index for m in moved if m.source.minor is None or m.target.minor is None]
    if lacking:
        problems.append(Problem("devices", "the checkpoint does not record the device minor of "
                                f"GPU {', '.join(map(str, lacking))} (written by an older gpusnap), "
                                "so its device nodes cannot be moved"))
    return problems


def plan_restore(manifest: Manifest | None, inventory: Inventory, *,
                 gpu_map: GpuMap | None = None,
                 host: HostFacts | None = None,
                 topology: Topology | None = None,
                 drm: Mapping[str, DrmNodes] | None = None,
                 skip: frozenset[str] = frozenset(),
                 remap: bool = True,
                 only_minors: Collection[int] | None = None,
                 container_paths: ContainerPaths = "host") -> Plan | list[Problem]:
    """A Plan, or every Problem that stops the restore (skipped checks land in Plan.overridden).

    ``remap=False`` allows only the checkpoint's own GPUs (what a plain `podman
    container restore` can do: its spec still names them). ``drm`` is this host's
    DRM nodes by PCI address (sysfs form); ``only_minors`` limits the targets to
    the GPUs a container was given; ``host`` adds the CPU, kernel and CRIU checks.
    """
    if gpu_map is not None and not remap:
        raise ValueError("a --gpu-map needs remap=True: without it only the checkpoint's GPUs count")
    topo = topology or Topology()
    sources = [GpuSlot.from_manifest(g) for g in (manifest.gpus if manifest else [])]
    problems = host_problems(manifest, host, bool(sources))
    if not sources:
        kept, skipped = split_skipped(problems, skip)
        return kept or Plan((), (), DeviceRemap(container_paths=container_paths), tuple(skipped))
    if inventory.error:
        return [Problem("nvidia", f"the checkpoint used {len(sources)} NVIDIA GPU(s) but this host "
                                  f"has none usable ({inventory.error})")] + \
            split_skipped(problems, skip)[0]
    problems = driver_problems(manifest, inventory) + problems

    def drm_of(g: GpuInfo) -> DrmNodes | None:
        return (drm or {}).get(sysfs_bdf(g.pci_bus_id)) if drm and g.pci_bus_id else None

    targets = [GpuSlot.from_info(g, drm_of(g)) for g in inventory.gpus]
    pool = [t for t in targets if only_minors is None or t.minor in only_minors]
    need = {s.uuid: _need(manifest, s.uuid) for s in sources}
    pins: dict[str, str] = {}
    if gpu_map is not None:
        pins, errors = resolve_gpu_map(gpu_map, sources, targets)
        problems += [Problem("gpu-map", e) for e in errors]
    pin_text = {}
    for entry in (gpu_map.entries if gpu_map else ()):
        for s in sources:
            if entry.source.matches(s.index, s.uuid):
                pin_text[s.uuid] = str(entry)

    cands, placing = _candidates(sources, targets, pool, need, pins, pin_text, skip, remap,
                                 only_minors is not None)
    problems += placing
    # Pinned targets are not on offer to the others.
    pinned = {t.uuid for s in sources if s.uuid in pins for t in cands[s.uuid]}
    for s in sources:
        if s.uuid not in pins:
            cands[s.uuid] = [t for t in cands[s.uuid] if t.uuid not in pinned]
    chosen = assign(sources, cands, topo)
    problems += _crowded_out(sources, targets, cands, chosen)

    moves = [Move(s, chosen[s.uuid], _reasons(s, chosen[s.uuid], need[s.uuid], cands[s.uuid],
                                               pin_text.get(s.uuid) if s.uuid in pins else None,
                                               chosen, topo))
             for s in sources if s.uuid in chosen]
    problems += _move_problems([m for m in moves if m.moved], inventory)

    kept, skipped = split_skipped(problems, skip)
    if kept:
        return kept
    overridden = list(skipped)
    for m in moves:
        overridden += _violations(m.source, m.target, need[m.source.uuid],
                                  f"GPU {m.source.index} -> GPU {m.target.index}: ")
    pairs = complete_pairs({m.source.uuid: m.target.uuid for m in moves},
                           [g.uuid for g in inventory.gpus])
    return Plan(tuple(moves), tuple(pairs), _remap(moves, container_paths), tuple(overridden))


def recheck(plan: Plan, manifest: Manifest, inventory: Inventory) -> list[Problem]:
    """What stops ``plan`` (made by `gpusnap restore` before Podman ran, and
    carried in the checkpoint) on this host now: its targets are held to, not
    chosen again, and the checks the plan's user skipped stay skipped."""
    pins = None
    if plan.needs_remap:
        pins = parse_gpu_map(",".join(f"{m.source.uuid}={m.target.uuid}" for m in plan.moves))
    # A plan that moves nothing is held to as a restore onto the checkpoint's own
    # GPUs, and said so ("stays on its GPU, but ..."), not as a --gpu-map nobody gave.
    result = plan_restore(manifest, inventory, gpu_map=pins, remap=plan.needs_remap,
                          skip=frozenset(p.check for p in plan.overridden))
    return result if isinstance(result, list) else []
