"""Read a checkpoint without restoring it: a Podman export archive or a directory.

An archive is streamed once (zstd, gzip or plain tar), keeping only the sizes
of all members and the contents of the few small metadata files, so memory
stays bounded however large the checkpoint is.
"""

from __future__ import annotations

import json
import re
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

from gpusnap import MANIFEST_NAME
from gpusnap.errors import GpusnapError
from gpusnap.gpu.manifest import Manifest, ManifestError
from gpusnap.tarstream import DamagedStream, TarStream

METADATA = ("config.dump", "spec.dump", "stats-dump", "network.status",
            f"checkpoint/{MANIFEST_NAME}", MANIFEST_NAME,
            "containerd.json", "spec.json")  # the last two: a containerd checkpoint's
_METADATA_LIMIT = 8 << 20


@dataclass
class CheckpointContents:
    source: str
    sizes: dict[str, int] = field(default_factory=dict)
    files: dict[str, bytes] = field(default_factory=dict)

    def json_file(self, name: str) -> dict | None:
        raw = self.files.get(name)
        if raw is None:
            return None
        try:
            data = json.loads(raw)
        except (ValueError, RecursionError) as exc:
            raise GpusnapError(f"{self.source}: {name} is not valid JSON ({exc})",
                               "the checkpoint is damaged: take it again") from None
        if not isinstance(data, dict):  # every reader takes it for an object
            raise GpusnapError(f"{self.source}: {name} is JSON but not an object",
                               "the checkpoint is damaged: take it again")
        return data

    @property
    def manifest(self) -> Manifest | None:
        data = self.json_file(MANIFEST_NAME) or self.json_file(f"checkpoint/{MANIFEST_NAME}")
        if data is None:
            return None
        try:
            return Manifest.from_dict(data)
        except ManifestError as exc:
            raise ManifestError(f"{self.source}: {exc.message}") from None

    @property
    def is_podman_checkpoint(self) -> bool:
        return ("spec.dump" in self.files and "config.dump" in self.files
                and any(n.startswith("checkpoint/") for n in self.sizes))

    @property
    def is_containerd_checkpoint(self) -> bool:
        """The layout of gpusnap.ops.containerd_checkpoint (containerd.json, spec.json, checkpoint/)."""
        return ("containerd.json" in self.files and "spec.json" in self.files
                and any(n.startswith("checkpoint/") for n in self.sizes))

    def _containerd(self) -> dict | None:
        """containerd.json's facts, for a containerd checkpoint."""
        if not self.is_containerd_checkpoint:
            return None
        meta = self.json_file("containerd.json") or {}
        return {k: meta.get(k) for k in ("image", "runtime", "snapshotter", "namespace", "source")}

    def summary(self) -> dict:
        """What `gpusnap inspect` shows: the container, the CRIU images, the GPUs."""
        config = self.json_file("config.dump") or {}
        spec = self.json_file("spec.dump") or self.json_file("spec.json") or {}
        containerd = self._containerd()
        if containerd is not None:  # the same fields, from containerd.json
            name = (self.json_file("containerd.json") or {}).get("container")
            config = {"name": name, "id": name, "rootfsImageName": containerd["image"],
                      "runtime": containerd["runtime"]}
        images = {n: s for n, s in self.sizes.items() if n.startswith("checkpoint/")}
        pages = sum(s for n, s in images.items() if re.match(r"checkpoint/pages-\d+\.img$", n))
        tasks = sorted(int(m.group(1)) for n in images
                       if (m := re.match(r"checkpoint/mm-(\d+)\.img$", n)))
        devices = [d.get("path") for d in spec.get("linux", {}).get("devices") or []]
        manifest = self.manifest
        engine = {} if containerd is None else {"engine": "containerd", "containerd": containerd}
        return {
            **engine,
            "source": self.source,
            "container": {"name": config.get("name"), "id": config.get("id"),
                          "image": config.get("rootfsImageName"),
                          "created": config.get("createdTime")},
            "runtime": config.get("runtime"),
            "devices": devices,
            "criu": {"processes": len(tasks), "memory_pages_bytes": pages,
                     "images_bytes": sum(images.values())},
            "rootfs_diff_bytes": self.sizes.get("rootfs-diff.tar", self.sizes.get("rw.layer", 0)),
            "total_bytes": sum(self.sizes.values()),
            "gpu": None if manifest is None else {
                "quiesced_by": manifest.quiesced_by, "driver": manifest.driver_version,
                "cuda": manifest.cuda_driver_version, "criu": manifest.criu_version,
                "host": manifest.host, "gpus": manifest.gpus,
                "gpu_memory_bytes": manifest.gpu_memory_total,
                "processes": [vars(p) for p in manifest.processes],
                "timing": manifest.timing},
        }


def _norm(name: str) -> str:
    return name[2:] if name.startswith("./") else name


def read_directory(path: Path) -> CheckpointContents:
    """A Podman userdata dir (holding checkpoint/) or a bare CRIU image dir."""
    root = path if (path / "checkpoint").is_dir() else None
    contents = CheckpointContents(source=str(path))
    if root is None:  # bare image dir: present it as checkpoint/
        for f in path.iterdir():
            if f.is_file():
                contents.sizes[f"checkpoint/{f.name}"] = f.stat().st_size
        if (path / MANIFEST_NAME).exists():
            contents.files[f"checkpoint/{MANIFEST_NAME}"] = (path / MANIFEST_NAME).read_bytes()
        return contents
    for f in root.rglob("*"):
        if f.is_file():
            contents.sizes[str(f.relative_to(root))] = f.stat().st_size
    for name in METADATA:
        if (root / name).is_file():
            contents.files[name] = (root / name).read_bytes()
    return contents


def _head_complete(contents: CheckpointContents, first: str | None) -> bool:
    """gpusnap's exports start with the GPU manifest; once the config files and
    the first CRIU image have passed, nothing a restore check needs is left."""
    return (first == MANIFEST_NAME and contents.is_podman_checkpoint)


_NOT_AN_EXPORT = ("pass a file made by `podman container checkpoint --export` or `gpusnap "
                  "checkpoint --export`")


def read_archive(path: Path, head_only: bool = False) -> CheckpointContents:
    """Stream the archive once. ``head_only`` stops early where the archive
    allows it (then ``sizes`` is incomplete: for checks, not for inspect)."""
    try:
        with open(path, "rb") as f:
            f.read(4)  # readable: the errors below say why not
    except FileNotFoundError:
        raise GpusnapError(f"no such file: {path}") from None
    except OSError as exc:
        raise GpusnapError(f"cannot read {path}: {exc.strerror}") from None
    contents = CheckpointContents(source=str(path))
    stream = None
    stopped_early = False
    try:
        stream = TarStream(path)
        first = None
        for member in stream.tar:
            name = _norm(member.name)
            first = first or name
            if head_only and _head_complete(contents, first):
                stopped_early = True
                break
            if not member.isfile():
                continue
            contents.sizes[name] = member.size
            if name in METADATA and member.size <= _METADATA_LIMIT:
                extracted = stream.data(member)
                if extracted is not None:
                    contents.files[name] = extracted.read()
        if not stopped_early and first is not None and not stream.ended():
            raise EOFError("it ends between two files, before the tar's end")
    except DamagedStream:
        raise GpusnapError(f"{path} is not a valid zstd archive",
                           "the file is damaged or truncated") from None
    except (EOFError, tarfile.ReadError) as exc:
        if not isinstance(exc, EOFError) and "unexpected end" not in str(exc):
            raise GpusnapError(f"{path} is not a readable checkpoint archive ({exc})",
                               _NOT_AN_EXPORT) from None
        raise GpusnapError(f"{path} is cut short ({exc}): a copy or an export that did not "
                           "finish", "copy it again, or export the container again") from None
    except (tarfile.TarError, OSError) as exc:
        raise GpusnapError(f"{path} is not a readable checkpoint archive ({exc})",
                           _NOT_AN_EXPORT) from None
    finally:
        # zstd's verdict wins over tarfile's: a cut stream is "damaged", not "not a checkpoint"
        if stream is not None and stream.close(read_to_end=not stopped_early):
            raise GpusnapError(f"{path} is not a valid zstd archive",
                               "the file is damaged or truncated")
    if not contents.is_podman_checkpoint:
        raise GpusnapError(f"{path} is not a Podman checkpoint archive "
                           "(no spec.dump, config.dump and checkpoint/ inside)",
                           "pass a file made by `podman container checkpoint --export`")
    return contents


def read(source: str, head_only: bool = False) -> CheckpointContents:
    path = Path(source)
    if path.is_dir():
        if not (path / "checkpoint").is_dir() and not (path / "inventory.img").is_file():
            raise GpusnapError(f"{path} holds no checkpoint: neither a checkpoint/ folder "
                               "(Podman's, containerd's) nor CRIU's inventory.img",
                               "pass an exported archive, a folder of CRIU images or a "
                               "checkpointed container's name")
        return read_directory(path)
    return read_archive(path, head_only)
