"""What changes on the host side when a container's GPUs move to other GPUs.

Device numbers (/dev/nvidiaN, /dev/dri/cardN, renderDN), host paths named
after a GPU (/proc/driver/nvidia/gpus/<PCI address>, /dev/dri/by-path/...) and
GPU names (CDI device names, NVIDIA_VISIBLE_DEVICES). Both planners (NVIDIA
in plan.py, AMD in amd.py) produce a DeviceRemap; the spec modifiers and the
/dev image rewrite consume it without knowing the vendor.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

NVIDIA_MAJOR = 195
DRM_MAJOR = 226
FIRST_RENDER_MINOR = 128

# host: container paths follow the host (/dev/nvidia1 for host GPU node 1), as
# nvidia-container-toolkit lays them out. Needed: libcuda opens /dev/nvidia<minor
# the kernel reports> (driver 580: with the GPU's node only at another path, CUDA
# finds no GPU), and CRIU's amdgpu plugin opens
# /dev/dri/renderD<new minor>. keep: the container keeps the paths its processes
# saw (/dev/nvidia0 now reaches host node 195:1); only safe where minors do not change.
ContainerPaths = Literal["keep", "host"]


@dataclass(frozen=True)
class NodeChange:
    """One character device node whose host numbers change."""

    old_path: str
    new_path: str
    old: tuple[int, int]  # (major, minor) on the checkpoint's host
    new: tuple[int, int]  # (major, minor) here

    def to_dict(self) -> dict:
        return {"old_path": self.old_path, "new_path": self.new_path,
                "old": list(self.old), "new": list(self.new)}

    @classmethod
    def from_dict(cls, d: dict) -> "NodeChange":
        return cls(d["old_path"], d["new_path"], tuple(d["old"]), tuple(d["new"]))


@dataclass(frozen=True)
class PathChange:
    """A host path named after a GPU (a directory or a link); its subpaths follow it."""

    old: str
    new: str


@dataclass(frozen=True)
class DeviceRemap:
    nodes: tuple[NodeChange, ...] = ()
    paths: tuple[PathChange, ...] = ()
    # GPU names as a user or device plugin wrote them: index or UUID, old -> new
    ids: tuple[tuple[str, str], ...] = ()
    cdi_kinds: tuple[str, ...] = ("nvidia.com/gpu",)
    container_paths: ContainerPaths = "host"
    # moved GPUs whose DRM nodes the checkpoint does not record
    unknown_drm: tuple[str, ...] = ()
    _index: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # All edits apply at once (a swap 0<->1 is two changes): each old and each new
        # value may appear only once, or the result would depend on the order.
        for what, pairs in (("device", [(n.old, n.new) for n in self.nodes]),
                            ("path", [(p.old, p.new) for p in self.paths]),
                            ("GPU id", list(self.ids))):
            olds = [o for o, _ in pairs]
            news = [n for _, n in pairs]
            for values, side in ((olds, "from"), (news, "to")):
                dupes = sorted({str(v) for v in values if values.count(v) > 1})
                if dupes:
                    raise ValueError(f"{what} remap moves {side} {', '.join(dupes)} more than once")
        if self.container_paths not in ("keep", "host"):
            raise ValueError(f"container_paths is 'keep' or 'host', not {self.container_paths!r}")
        self._index.update(nodes={n.old: n for n in self.nodes},
                           ids=dict(self.ids))

    @property
    def empty(self) -> bool:
        return not (self.nodes or self.paths or self.ids)

    def node(self, major: int, minor: int) -> NodeChange | None:
        return self._index["nodes"].get((major, minor))

    def node_by_path(self, path: str) -> NodeChange | None:
        return next((n for n in self.nodes if n.old_path == path), None)

    def path(self, path: str) -> str | None:
        """The new form of a host path at or under a changed one, else None."""
        for change in self.paths:
            if path == change.old or path.startswith(change.old + "/"):
                return change.new + path[len(change.old):]
        node = self.node_by_path(path)
        return node.new_path if node else None

    def gpu_id(self, name: str) -> str | None:
        return self._index["ids"].get(name) or self._index["ids"].get(name.lower())

    def with_nodes(self, extra: tuple[NodeChange, ...]) -> "DeviceRemap":
        return replace(self, nodes=self.nodes + tuple(extra))

    def to_dict(self) -> dict:
        return {"nodes": [n.to_dict() for n in self.nodes],
                "paths": [[p.old, p.new] for p in self.paths],
                "ids": [list(i) for i in self.ids], "cdi_kinds": list(self.cdi_kinds),
                "container_paths": self.container_paths, "unknown_drm": list(self.unknown_drm)}

    @classmethod
    def from_dict(cls, d: dict) -> "DeviceRemap":
        return cls(nodes=tuple(NodeChange.from_dict(n) for n in d.get("nodes", [])),
                   paths=tuple(PathChange(o, n) for o, n in d.get("paths", [])),
                   ids=tuple((o, n) for o, n in d.get("ids", [])),
                   cdi_kinds=tuple(d.get("cdi_kinds", ("nvidia.com/gpu",))),
                   container_paths=d.get("container_paths", "host"),
                   unknown_drm=tuple(d.get("unknown_drm", ())))
