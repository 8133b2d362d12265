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
from dataclasses import asdict, dataclass, field
from pathlib import Path

from gpusnap import MANIFEST_NAME
from gpusnap.gpu.inventory import GpuInfo, Inventory
from gpusnap.procs import ProcessGpuUse

SCHEMA = "gpusnap.manifest/v1"


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
        if data.get("schema") != SCHEMA:
            raise ValueError(f"unknown GPU manifest schema {data.get('schema')!r}")
        fields = dict(data)
        fields["processes"] = [ManifestProcess(**p) for p in data.get("processes", [])]
        return cls(**fields)


def host_facts() -> dict[str, str]:
    return {"hostname": socket.gethostname(), "kernel": platform.release(),
            "arch": platform.machine()}


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
    gpus = [{k: v for k, v in asdict(g).items() if k != "memory_used"}
            for g in sorted(used.values(), key=lambda g: g.index)]
    return Manifest(gpus=gpus, processes=mprocs, driver_version=inventory.driver_version,
                    cuda_driver_version=inventory.cuda_driver_version,
                    criu_version=criu_version, quiesced_by=quiesced_by, host=host_facts(),
                    created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))


def write(manifest: Manifest, image_dir: str | os.PathLike) -> Path:
    """Write atomically: a reader never sees half a manifest."""
    path = Path(image_dir) / MANIFEST_NAME
    tmp = path.with_suffix(".tmp")
    tmp.write_text(manifest.to_json())
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)
    return path


def read(image_dir: str | os.PathLike) -> Manifest | None:
    path = Path(image_dir) / MANIFEST_NAME
    if not path.exists():
        return None
    return Manifest.from_dict(json.loads(path.read_text()))
