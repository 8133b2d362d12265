"""`--gpu-map 0=1,1=0`: the user's choice of target GPU for some checkpoint GPUs.

Parsing needs nothing but the text (errors are usage errors, raised at once);
resolving against the checkpoint and this host yields one line per mistake, so
a dry run can list them all.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Protocol, Sequence

from gpusnap.errors import GpusnapError

# NVML's form: GPU-8-4-4-4-12 hex digits.
_UUID = re.compile(r"^GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$", re.IGNORECASE)
_INDEX = re.compile(r"^[0-9]+$")
EXAMPLE = "e.g. --gpu-map 0=1,1=0 or GPU-<uuid>=1"
# The map, SRC=DST[,...], as an OCI spec annotation: for the restores gpusnap
# does not drive itself (plain `podman container restore`, containerd's shim).
GPU_MAP_ANNOTATION = "io.gpusnap.gpu-map"


class GpuMapError(GpusnapError, ValueError):
    """A --gpu-map that cannot be parsed or does not fit the checkpoint and this host."""

    def __init__(self, message: str) -> None:
        super().__init__(message, "give SOURCE=TARGET pairs, each an index or a UUID (`gpusnap "
                                  "inspect` lists the checkpoint's GPUs, `gpusnap gpus` this host's)")


@dataclass(frozen=True)
class GpuRef:
    """A GPU named by index or by UUID (exactly one is set)."""

    index: int | None = None
    uuid: str | None = None

    def __post_init__(self) -> None:
        if (self.index is None) == (self.uuid is None):
            raise ValueError("a GpuRef names a GPU by index or by UUID, not both or neither")

    def __str__(self) -> str:
        return str(self.index) if self.index is not None else str(self.uuid)

    def matches(self, index: int, uuid: str) -> bool:
        if self.index is not None:
            return self.index == index
        return self.uuid.lower() == uuid.lower()


@dataclass(frozen=True)
class MapEntry:
    source: GpuRef
    target: GpuRef

    def __str__(self) -> str:
        return f"{self.source}={self.target}"


@dataclass(frozen=True)
class GpuMap:
    entries: tuple[MapEntry, ...]

    def __str__(self) -> str:
        return ",".join(str(e) for e in self.entries)


def parse_ref(text: str, side: str, entry: str) -> GpuRef:
    if _INDEX.match(text):
        return GpuRef(index=int(text))
    if _UUID.match(text):
        return GpuRef(uuid="GPU-" + text[4:].lower())  # NVML prints GPU- and lower-case hex
    if text.upper().startswith("MIG-"):
        raise GpuMapError(f"--gpu-map: {side} {text!r} in {entry!r} is a MIG instance; the driver "
                          "cannot checkpoint MIG, name whole GPUs")
    raise GpuMapError(f"--gpu-map: {side} {text!r} in {entry!r} is neither a GPU index (0, 1, ...) "
                      "nor a GPU UUID (GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx)")


def parse_gpu_map(text: str) -> GpuMap:
    """Parse 'SRC=DST[,SRC=DST...]'; GpuMapError says exactly what is wrong."""
    if not text.strip():
        raise GpuMapError(f"--gpu-map is empty ({EXAMPLE})")
    entries: list[MapEntry] = []
    for position, raw in enumerate(text.split(","), start=1):
        item = raw.strip()
        if not item:
            raise GpuMapError(f"--gpu-map: entry {position} of {text!r} is empty ({EXAMPLE})")
        parts = item.split("=")
        if len(parts) != 2 or not parts[0].strip() or not parts[1].strip():
            raise GpuMapError(f"--gpu-map: {item!r} is not SOURCE=TARGET ({EXAMPLE})")
        entry = MapEntry(parse_ref(parts[0].strip(), "source", item),
                         parse_ref(parts[1].strip(), "target", item))
        for seen in entries:
            if seen.source == entry.source:
                raise GpuMapError(f"--gpu-map: source GPU {entry.source} is mapped twice "
                                  f"({seen} and {entry})")
            if seen.target == entry.target:
                raise GpuMapError(f"--gpu-map: target GPU {entry.target} is given twice "
                                  f"({seen} and {entry}); one GPU cannot take two")
        entries.append(entry)
    return GpuMap(tuple(entries))


class _Gpu(Protocol):
    index: int
    uuid: str


def _listing(gpus: Sequence[_Gpu]) -> str:
    return ", ".join(f"GPU {g.index}" for g in gpus) or "none"


def resolve_gpu_map(gpu_map: GpuMap, sources: Sequence[_Gpu], targets: Sequence[_Gpu]
                    ) -> tuple[dict[str, str], list[str]]:
    """Source UUID -> target UUID for each entry, and one line per entry that names a
    GPU the checkpoint did not use or this host does not have (or names one twice)."""
    pins: dict[str, str] = {}
    errors: list[str] = []
    by_target: dict[str, MapEntry] = {}
    by_source: dict[str, MapEntry] = {}
    for entry in gpu_map.entries:
        src = next((g for g in sources if entry.source.matches(g.index, g.uuid)), None)
        dst = next((g for g in targets if entry.target.matches(g.index, g.uuid)), None)
        if src is None:
            errors.append(f"--gpu-map {entry}: the checkpoint has no GPU {entry.source} "
                          f"(it used {_listing(sources)})")
        if dst is None:
            errors.append(f"--gpu-map {entry}: this host has no GPU {entry.target} "
                          f"(it has {_listing(targets)})")
        if src is None or dst is None:
            continue
        # One GPU named once by index and once by UUID is only visible now.
        if src.uuid in by_source:
            errors.append(f"--gpu-map: source GPU {src.index} ({src.uuid}) is mapped twice "
                          f"({by_source[src.uuid]} and {entry})")
            continue
        if dst.uuid in by_target:
            errors.append(f"--gpu-map: target GPU {dst.index} ({dst.uuid}) is given twice "
                          f"({by_target[dst.uuid]} and {entry})")
            continue
        by_source[src.uuid] = by_target[dst.uuid] = entry
        pins[src.uuid] = dst.uuid
    return pins, errors
