"""The GPU manifest: which GPUs a checkpoint was taken on and what used them.

Written as ``gpusnap-manifest.json`` into CRIU's image directory, so Podman's
``--export`` archives carry it. Reading it needs no GPU.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import time
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path

from gpusnap import MANIFEST_NAME
from gpusnap.errors import GpusnapError
from gpusnap.gpu.drm import read_drm_nodes
from gpusnap.gpu.inventory import GpuInfo, Inventory
from gpusnap.private import write_private
from gpusnap.procs import ProcessGpuUse

SCHEMA = "gpusnap.manifest/v1"


class ManifestError(GpusnapError, ValueError):
    """A damaged or foreign GPU manifest (a ValueError too, for callers that catch that)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, "the checkpoint is damaged or was not written by this gpusnap version")


_JSON_TYPES = {dict: "an object", list: "an array", str: "a string", int: "an integer",
               float: "a number", bool: "a boolean", type(None): "null"}


def _expect(value, types: tuple, where: str) -> None:
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
        expected = " or ".join(_JSON_TYPES[t] for t in types)
        found = _JSON_TYPES.get(type(value), type(value).__name__)
        raise ManifestError(f"GPU manifest: {where} is {found}, expected {expected}")


def _check_items(items, where: str, keys: dict[str, tuple]) -> None:
    _expect(items, (list,), where)
    for i, item in enumerate(items):
        _expect(item, (dict,), f"{where}[{i}]")
        missing = [k for k in keys if k not in item]
        if missing:
            raise ManifestError(f"GPU manifest: {where}[{i}] lacks {', '.join(missing)}")
        for key, types in keys.items():
            _expect(item[key], types, f"{where}[{i}].{key}")


@dataclass
class ManifestProcess:
    pid: int
    comm: str
    gpus: list[str]  # UUIDs
    gpu_memory: dict[str, int]  # UUID -> bytes, as NVML saw it before quiesce


@dataclass
class Manifest:
    gpus: list[dict]
    processes: list[ManifestProcess]
    driver_version: str | None
    cuda_driver_version: str | None
    criu_version: str | None
    quiesced_by: str  # "gpusnap", "criu-cuda-plugin" or "none"
    timing: dict[str, float] = field(default_factory=dict)
    host: dict[str, str] = field(default_factory=dict)
    created: str = ""
    schema: str = SCHEMA

    @property
    def gpu_memory_total(self) -> int:
        return sum(sum(p.gpu_memory.values()) for p in self.processes)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict) -> "Manifest":
        """Parse a manifest; ManifestError names what is wrong with a malformed one."""
        _expect(data, (dict,), "the top level")
        if data.get("schema") != SCHEMA:
            raise ManifestError(f"unknown GPU manifest schema {data.get('schema')!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ManifestError(f"GPU manifest: unknown field(s) {', '.join(unknown)}")
        required = [f.name for f in fields(cls)
                    if f.default is MISSING and f.default_factory is MISSING]
        missing = [name for name in required if name not in data]
        if missing:
            raise ManifestError(f"GPU manifest: missing field(s) {', '.join(missing)}")
        optional_str = (str, type(None))
        for name in ("driver_version", "cuda_driver_version", "criu_version"):
            _expect(data[name], optional_str, name)
        _expect(data["quiesced_by"], (str,), "quiesced_by")
        for name in ("timing", "host"):
            _expect(data.get(name, {}), (dict,), name)
        _check_items(data["gpus"], "gpus", {"index": (int,), "uuid": (str,), "name": (str,)})
        process_keys = {"pid": (int,), "comm": (str,), "gpus": (list,), "gpu_memory": (dict,)}
        _check_items(data["processes"], "processes", process_keys)
        for i, proc in enumerate(data["processes"]):
            extra = sorted(set(proc) - set(process_keys))
            if extra:
                raise ManifestError(f"GPU manifest: processes[{i}] has unknown field(s) "
                                    f"{', '.join(extra)}")
        values = dict(data)
        values["processes"] = [ManifestProcess(**p) for p in data["processes"]]
        return cls(**values)


def host_facts() -> dict[str, str]:
    return {"hostname": socket.gethostname(), "kernel": platform.release(),
            "arch": platform.machine()}


def _gpu_entry(gpu: GpuInfo) -> dict:
    entry = {k: v for k, v in asdict(gpu).items() if k != "memory_used"}
    # The DRM nodes (nvidia-drm) a container may also have been given: a restore
    # onto another GPU moves them too.
    if gpu.pci_bus_id:
        try:
            drm = read_drm_nodes(gpu.pci_bus_id)
        except ValueError:
            drm = None
        if drm is not None and (drm.card is not None or drm.render is not None):
            entry["drm"] = drm.to_dict()
    return entry


def build(procs: list[ProcessGpuUse], inventory: Inventory, criu_version: str | None,
          quiesced_by: str) -> Manifest:
    """Describe ``procs`` as they are now: call before quiescing them."""
    used: dict[str, GpuInfo] = {}
    mprocs = []
    for proc in procs:
        uuids = []
        for minor in proc.gpu_minors:
            gpu = inventory.by_minor(minor)
            if gpu is not None:
                used[gpu.uuid] = gpu
                uuids.append(gpu.uuid)
        memory = inventory.process_memory.get(proc.pid, {})
        for uuid in memory:
            gpu = inventory.by_uuid(uuid)
            if gpu is not None:
                used[uuid] = gpu
                if uuid not in uuids:
                    uuids.append(uuid)
        mprocs.append(ManifestProcess(pid=proc.pid, comm=proc.comm, gpus=uuids,
                                      gpu_memory=dict(memory)))
    gpus = [_gpu_entry(g) for g in sorted(used.values(), key=lambda g: g.index)]
    return Manifest(gpus=gpus, processes=mprocs, driver_version=inventory.driver_version,
                    cuda_driver_version=inventory.cuda_driver_version,
                    criu_version=criu_version, quiesced_by=quiesced_by, host=host_facts(),
                    created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))


def write(manifest: Manifest, image_dir: str | os.PathLike) -> Path:
    """Write atomically (a reader never sees half a manifest), 0600 as CRIU's images."""
    return write_private(Path(image_dir) / MANIFEST_NAME, manifest.to_json())


def parse(text: str | bytes, where: str) -> Manifest:
    """A manifest from its JSON text; ManifestError names `where` and what is wrong."""
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise ManifestError(f"{where} is not valid JSON ({exc})") from None
    return Manifest.from_dict(data)  # refuses any JSON value but an object too


def read(image_dir: str | os.PathLike) -> Manifest | None:
    path = Path(image_dir) / MANIFEST_NAME
    if not path.exists():
        return None
    return parse(path.read_text(), str(path))
