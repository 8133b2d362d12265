"""AMD GPUs (ROCm): the KFD topology CRIU's amdgpu plugin matches, and a plan for other GPUs.

CRIU's amdgpu_plugin restores KFD state itself; at restore it maps each saved
GPU onto a GPU it can see (through the container's device cgroup) whose
properties match, keeps CPU (NUMA) and XGMI neighbours consistent, and
reopens /dev/dri/renderD<minor> of the new GPU. gpusnap decides the same
mapping beforehand, from /sys/class/kfd/kfd/topology, so that it can refuse
early with the reason, give the container the right render nodes, and set the
plugin's KFD_*_CHECK variables for checks the user chose to relax.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from gpusnap.gpu.checks import CHECKS, Problem, split_skipped
from gpusnap.gpu.drm import DrmNodes, drm_changes
from gpusnap.gpu.gpumap import GpuMap, resolve_gpu_map
from gpusnap.gpu.nodes import ContainerPaths, DeviceRemap

KFD_TOPOLOGY = "/sys/class/kfd/kfd/topology"
IOLINK_PCIE = 2
IOLINK_XGMI = 11
HEAP_FB_PUBLIC, HEAP_FB_PRIVATE = 1, 2
SEARCH_BUDGET = 200_000  # search steps before settling for the best choice so far

# Must be equal for the plugin to map a GPU (device_properties_match in amdgpu_plugin_topology.c).
EXACT = ("vendor_id", "device_id", "simd_count", "mem_banks_count", "io_links_count",
         "max_waves_per_simd", "lds_size_in_kb", "wave_front_size", "array_count",
         "simd_arrays_per_engine", "cu_per_simd_array", "simd_per_cu", "max_slots_scratch_cu",
         "num_sdma_engines", "num_sdma_xgmi_engines", "num_sdma_queues_per_engine", "num_cp_queues")
# The target may have as much or more; each has a plugin variable that turns it off.
AT_LEAST = (("fw_version", "amd-fw"), ("sdma_fw_version", "amd-sdma-fw"),
            ("caches_count", "amd-caches"), ("num_gws", "amd-gws"))


class KfdError(ValueError):
    pass


@dataclass(frozen=True)
class IoLink:
    type: int
    node_to: int


@dataclass(frozen=True)
class KfdNode:
    node_id: int
    gpu_id: int  # 0 for a CPU node
    name: str
    properties: Mapping[str, int] = field(repr=False)
    io_links: tuple[IoLink, ...] = ()
    vram_size: int = 0
    vram_public: bool = False
    index: int = -1  # position among the GPUs, as the plugin counts them; -1 for CPUs

    @property
    def is_gpu(self) -> bool:
        return self.gpu_id != 0

    @property
    def uuid(self) -> str:  # for --gpu-map resolution: AMD GPUs are named by index
        return f"kfd-gpu-{self.gpu_id}"

    @property
    def render_minor(self) -> int | None:
        minor = self.properties.get("drm_render_minor")
        return minor if minor else None

    @property
    def pci_bdf(self) -> str:
        """KFD's location_id is bus << 8 | devfn."""
        loc = self.properties.get("location_id", 0)
        bus, devfn = loc >> 8, loc & 0xFF
        return f"{self.properties.get('domain', 0):04x}:{bus:02x}:{devfn >> 3:02x}.{devfn & 7}"

    @property
    def label(self) -> str:
        return f"GPU {self.index} (node {self.node_id}, gpu_id {self.gpu_id}, {self.name})"

    def to_dict(self) -> dict:
        return {"node_id": self.node_id, "gpu_id": self.gpu_id, "name": self.name,
                "properties": dict(self.properties), "vram_size": self.vram_size,
                "vram_public": self.vram_public,
                "io_links": [[link.type, link.node_to] for link in self.io_links]}


@dataclass(frozen=True)
class KfdTopology:
    nodes: tuple[KfdNode, ...]

    @property
    def gpus(self) -> list[KfdNode]:
        return [n for n in self.nodes if n.is_gpu]

    def node(self, node_id: int) -> KfdNode | None:
        return next((n for n in self.nodes if n.node_id == node_id), None)

    def cpu_of(self, gpu: KfdNode) -> int | None:
        """The CPU (NUMA) node the GPU hangs off, if the topology links it to one."""
        for link in gpu.io_links:
            peer = self.node(link.node_to)
            if peer is not None and not peer.is_gpu:
                return peer.node_id
        return None

    def xgmi(self, a: KfdNode, b: KfdNode) -> bool:
        return any(link.type == IOLINK_XGMI and link.node_to == b.node_id for link in a.io_links)

    def to_dict(self) -> dict:
        """What to record at checkpoint (the plugin's own image holds the same facts)."""
        return {"nodes": [n.to_dict() for n in self.nodes]}

    @classmethod
    def from_dict(cls, data: dict) -> "KfdTopology":
        try:
            nodes = [KfdNode(node_id=n["node_id"], gpu_id=n["gpu_id"], name=n["name"],
                             properties=dict(n["properties"]), vram_size=n.get("vram_size", 0),
                             vram_public=bool(n.get("vram_public")),
                             io_links=tuple(IoLink(t, to) for t, to in n.get("io_links", [])))
                     for n in data["nodes"]]
        except (KeyError, TypeError, ValueError) as exc:
            raise KfdError(f"KFD topology record is malformed ({exc!r})") from None
        return _indexed(nodes)


def _indexed(nodes: list[KfdNode]) -> KfdTopology:
    nodes = sorted(nodes, key=lambda n: n.node_id)
    out, gpu_index = [], 0
    for n in nodes:
        if n.is_gpu:
            n = KfdNode(n.node_id, n.gpu_id, n.name, n.properties, n.io_links, n.vram_size,
                        n.vram_public, gpu_index)
            gpu_index += 1
        out.append(n)
    return KfdTopology(tuple(out))


# --- reading sysfs -------------------------------------------------------------------------

def _properties(path: Path) -> dict[str, int]:
    props: dict[str, int] = {}
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise KfdError(f"cannot read {path}: {exc.strerror}") from None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        parts = line.split()
        if len(parts) != 2 or not parts[1].isdigit():
            raise KfdError(f"{path} line {number}: {line!r} is not 'name value'")
        props[parts[0]] = int(parts[1])
    return props


def _numbered(folder: Path) -> list[Path]:
    if not folder.is_dir():
        return []
    return sorted((p for p in folder.iterdir() if p.name.isdigit()), key=lambda p: int(p.name))


def read_kfd_topology(root: str | Path = KFD_TOPOLOGY) -> KfdTopology:
    """Every KFD node under root/nodes; KfdError names the file and line that is wrong."""
    nodes_dir = Path(root) / "nodes"
    if not nodes_dir.is_dir():
        raise KfdError(f"{nodes_dir} does not exist: no amdgpu driver with KFD on this host")
    nodes = []
    for folder in _numbered(nodes_dir):
        gpu_id_text = (folder / "gpu_id").read_text().strip() if (folder / "gpu_id").exists() else ""
        if not gpu_id_text.isdigit():
            raise KfdError(f"{folder / 'gpu_id'} holds {gpu_id_text!r}, expected a number")
        gpu_id = int(gpu_id_text)
        name = (folder / "name").read_text().strip() if (folder / "name").exists() else ""
        props = _properties(folder / "properties")
        links = []
        for link_dir in _numbered(folder / "io_links"):
            lp = _properties(link_dir / "properties")
            if lp.get("type") in (IOLINK_PCIE, IOLINK_XGMI):  # the only ones the plugin keeps
                links.append(IoLink(lp["type"], lp.get("node_to", 0)))
        vram, public = 0, False
        if gpu_id:
            for bank in _numbered(folder / "mem_banks"):
                bp = _properties(bank / "properties")
                if bp.get("heap_type") in (HEAP_FB_PUBLIC, HEAP_FB_PRIVATE):
                    vram, public = bp.get("size_in_bytes", 0), bp["heap_type"] == HEAP_FB_PUBLIC
                    break
            if not vram:
                raise KfdError(f"{folder / 'mem_banks'}: no VRAM bank (heap_type 1 or 2) with a size")
        nodes.append(KfdNode(int(folder.name), gpu_id, name, props, tuple(links), vram, public))
    return _indexed(nodes)


# --- matching -------------------------------------------------------------------------------

def _gib(n: int) -> str:
    return f"{n / (1 << 30):.1f} GiB"


def pair_problems(s: KfdNode, t: KfdNode, src: KfdTopology, dst: KfdTopology) -> list[Problem]:
    """Why the plugin would not map s onto t, one Problem per check (exact ones joined)."""
    prefix = f"GPU {s.index} of the checkpoint ({s.name}) -> GPU {t.index} here ({t.name}): "
    def show(key: str, value: int) -> str:
        return f"{value:#06x}" if key in ("vendor_id", "device_id") else str(value)

    exact = [f"{k} {show(k, s.properties.get(k, 0))} vs {show(k, t.properties.get(k, 0))}"
             for k in EXACT if s.properties.get(k, 0) != t.properties.get(k, 0)]
    if s.vram_public != t.vram_public:
        exact.append(f"host-visible VRAM {'yes' if s.vram_public else 'no'} vs "
                     f"{'yes' if t.vram_public else 'no'}")
    valid = [link for link in s.io_links if src.node(link.node_to) is not None]
    here = [link for link in t.io_links if dst.node(link.node_to) is not None]
    if len(valid) > len(here):
        exact.append(f"{len(valid)} IO links vs {len(here)}")
    out = [Problem("amd-gpu", prefix + "not the same GPU model: " + ", ".join(exact))] if exact else []
    for key, check in AT_LEAST:
        if s.properties.get(key, 0) > t.properties.get(key, 0):
            out.append(Problem(check, f"{prefix}{key} {s.properties.get(key, 0)} here is "
                               f"{t.properties.get(key, 0)}, older or fewer than the checkpoint's"))
    if s.vram_size > t.vram_size:
        out.append(Problem("amd-vram", f"{prefix}{_gib(t.vram_size)} VRAM here, the checkpoint's GPU "
                           f"had {_gib(s.vram_size)}"))
    cap_s, cap_t = s.properties.get("capability", 0), t.properties.get("capability", 0)
    if cap_s != cap_t:
        out.append(Problem("amd-capability", f"{prefix}KFD capability {cap_s:#x} vs {cap_t:#x} here"))
    return out


@dataclass(frozen=True)
class AmdMove:
    source: KfdNode
    target: KfdNode
    relaxed: tuple[str, ...]  # checks this pair needs skipped

    def describe(self) -> str:
        how = f" (relaxed: {', '.join(self.relaxed)})" if self.relaxed else ""
        return f"{self.source.label} -> {self.target.label}{how}"


@dataclass(frozen=True)
class AmdPlan:
    moves: tuple[AmdMove, ...]
    remap: DeviceRemap
    kfd_env: dict[str, str] = field(default_factory=dict)  # for CRIU's amdgpu plugin
    overridden: tuple[Problem, ...] = ()

    @property
    def gpu_id_pairs(self) -> list[tuple[int, int]]:
        return [(m.source.gpu_id, m.target.gpu_id) for m in self.moves]


def _consistent(chosen: dict[int, KfdNode], src: KfdTopology, dst: KfdTopology, numa: bool) -> bool:
    """The plugin's neighbour rules for a partial choice (source node id -> target GPU)."""
    cpu_map: dict[int, int] = {}
    for s_id, t in chosen.items():
        s = src.node(s_id)
        if numa:
            a, b = src.cpu_of(s), dst.cpu_of(t)
            if a is not None:
                if b is None or cpu_map.setdefault(a, b) != b:
                    return False
        for o_id, u in chosen.items():  # an XGMI pair must stay XGMI
            if o_id != s_id and src.xgmi(s, src.node(o_id)) and not dst.xgmi(t, u):
                return False
    if numa and len(set(cpu_map.values())) != len(cpu_map):
        return False  # two CPU nodes of the checkpoint cannot become one
    return True


def _search(order: list[KfdNode], cands: dict[int, list[KfdNode]], src: KfdTopology,
            dst: KfdTopology, numa: bool) -> dict[int, KfdNode] | None:
    best: dict[int, KfdNode] | None = None
    best_key: tuple | None = None
    steps = 0
    chosen: dict[int, KfdNode] = {}

    def dfs(i: int) -> None:
        nonlocal best, best_key, steps
        steps += 1
        if steps > SEARCH_BUDGET and best_key is not None:
            return
        if i == len(order):
            key = (sum(chosen[s.node_id].gpu_id == s.gpu_id for s in order),
                   sum(chosen[s.node_id].index == s.index for s in order),
                   tuple(-chosen[s.node_id].index for s in order))
            if best_key is None or key > best_key:
                best, best_key = dict(chosen), key
            return
        s = order[i]
        for t in cands[s.node_id]:
            if t in chosen.values():
                continue
            chosen[s.node_id] = t
            if _consistent(chosen, src, dst, numa):
                dfs(i + 1)
            del chosen[s.node_id]

    dfs(0)
    return best


def plan_amd(source: KfdTopology, target: KfdTopology, *, skip: frozenset[str] = frozenset(),
             gpu_map: GpuMap | None = None, drm: Mapping[str, DrmNodes] | None = None,
             source_drm: Mapping[str, DrmNodes] | None = None,
             container_paths: ContainerPaths = "host") -> AmdPlan | list[Problem]:
    """Map the checkpoint's AMD GPUs onto this host's, as CRIU's amdgpu plugin will.

    ``drm``/``source_drm``: DRM card nodes by PCI address here and on the
    checkpoint's host, where known (render nodes come from KFD itself).
    """
    sources, targets = source.gpus, target.gpus
    problems: list[Problem] = []
    if len(targets) < len(sources):
        problems.append(Problem("count", f"the checkpoint used {len(sources)} AMD GPU(s), this host "
                                f"has {len(targets)}"))
    pins: dict[str, str] = {}
    if gpu_map is not None:
        pins, errors = resolve_gpu_map(gpu_map, sources, targets)
        problems += [Problem("gpu-map", e) for e in errors]
    cands: dict[int, list[KfdNode]] = {}
    for s in sources:
        pool = [t for t in targets if t.uuid == pins[s.uuid]] if s.uuid in pins else targets
        verdicts = {t.node_id: pair_problems(s, t, source, target) for t in pool}
        fits = [t for t in pool if not split_skipped(verdicts[t.node_id], skip)[0]]
        cands[s.node_id] = sorted(fits, key=lambda t: (t.gpu_id != s.gpu_id, t.index != s.index,
                                                       len(verdicts[t.node_id]), t.index))
        if not fits and pool:
            # the closest target: fewest blocking problems
            closest = min(pool, key=lambda t: len(split_skipped(verdicts[t.node_id], skip)[0]))
            blocking = split_skipped(verdicts[closest.node_id], skip)[0]
            hard = [p for p in blocking if not p.can_skip]
            problems += hard or blocking  # a knob is no help while the model differs
    if problems:
        return problems
    numa = "amd-numa" not in skip
    order = sorted(sources, key=lambda s: len(cands[s.node_id]))
    chosen = _search(order, cands, source, target, numa)
    if chosen is None and numa and _search(order, cands, source, target, False) is not None:
        return [Problem("amd-numa", "no choice of GPUs here keeps the checkpoint's GPUs on "
                        "separate CPU (NUMA) nodes as they were: " +
                        ", ".join(f"GPU {s.index} on CPU node {source.cpu_of(s)}" for s in sources))]
    if chosen is None:
        return [Problem("amd-gpu", "no choice of GPUs here keeps the checkpoint's XGMI-linked GPUs "
                        "linked: " + ", ".join(f"GPU {s.index}" for s in sources))]

    moves, overridden = [], []
    for s in sources:
        t = chosen[s.node_id]
        relaxed = pair_problems(s, t, source, target)
        overridden += relaxed
        moves.append(AmdMove(s, t, tuple(p.check for p in relaxed)))
    if not numa and _search(order, cands, source, target, True) is None:
        overridden.append(Problem("amd-numa", "GPUs move to other CPU (NUMA) neighbours"))
    env = {CHECKS[p.check].kfd_env: "0" for p in overridden if CHECKS[p.check].kfd_env}
    return AmdPlan(tuple(moves), _remap(moves, drm or {}, source_drm or {}, container_paths),
                   dict(sorted(env.items())), tuple(overridden))


def _remap(moves: list[AmdMove], drm: Mapping[str, DrmNodes], source_drm: Mapping[str, DrmNodes],
           container_paths: ContainerPaths) -> DeviceRemap:
    nodes, paths, ids, unknown = [], [], [], []
    for m in moves:
        s, t = m.source, m.target
        old_bdf, new_bdf = s.pci_bdf, t.pci_bdf
        old = DrmNodes(source_drm[old_bdf].card if old_bdf in source_drm else None, s.render_minor)
        new = DrmNodes(drm[new_bdf].card if new_bdf in drm else None, t.render_minor)
        drm_nodes, drm_paths = drm_changes(old_bdf, old, new_bdf, new)
        nodes += drm_nodes
        paths += drm_paths
        if (old.card is None or new.card is None) and (old_bdf != new_bdf or old != new):
            unknown.append(f"GPU {s.index} card node")
        if s.index != t.index:
            ids.append((str(s.index), str(t.index)))
    # render nodes come from KFD itself: only card nodes can be unaccounted for
    return DeviceRemap(nodes=tuple(nodes), paths=tuple(paths), ids=tuple(ids),
                       cdi_kinds=("amd.com/gpu",), container_paths=container_paths,
                       unknown_drm=tuple(unknown))
