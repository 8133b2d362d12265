"""The registry format of a checkpoint: an OCI 1.1 image manifest whose layers
are zstd-compressed, content-addressed chunks of the checkpoint's files, and
whose config lists those files (tar metadata and chunk digests) and carries
the GPU manifest. Manifest annotations hold the facts a target host checks
before it downloads anything (GPUs, driver, CUDA, CRIU, arch).
"""

from __future__ import annotations

import json
import platform
import time
from dataclasses import asdict, dataclass, field

from gpusnap.errors import GpusnapError
from gpusnap.oci import podman_image

ARTIFACT_TYPE = "application/vnd.gpusnap.checkpoint.v1"
CONFIG_MEDIA_TYPE = "application/vnd.gpusnap.checkpoint.config.v1+json"
CHUNK_MEDIA_TYPE = "application/vnd.gpusnap.checkpoint.chunk.v1+zstd"
# Sealed to recipients (docs/trust.md): ocicrypt's "+encrypted" suffix
ENCRYPTED_CONFIG_MEDIA_TYPE = CONFIG_MEDIA_TYPE + "+encrypted"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
CONFIG_SCHEMA = "gpusnap.checkpoint/v1"
TITLE = "org.opencontainers.image.title"
ANNOTATION = "io.gpusnap."
# Registries refuse manifests over 4 MiB (distribution, GHCR): one chunk's layer
# descriptor is ~190 bytes, so keep well under 20,000 layers.
MAX_LAYERS = 16000


@dataclass(frozen=True)
class Chunk:
    digest: str  # sha256 of the raw (uncompressed) bytes
    size: int
    blob: str  # sha256 of the zstd blob: the layer's digest
    blob_size: int

    def to_list(self) -> list:
        return [self.digest, self.size, self.blob, self.blob_size]

    @classmethod
    def from_list(cls, item: list) -> "Chunk":
        digest, size, blob, blob_size = item
        return cls(str(digest), int(size), str(blob), int(blob_size))


@dataclass
class FileEntry:
    """One member of the checkpoint archive, as tar describes it."""
    path: str
    type: str  # file, dir, symlink, link
    mode: int = 0o644
    uid: int = 0
    gid: int = 0
    uname: str = ""
    gname: str = ""
    mtime: int = 0
    size: int = 0
    linkname: str = ""
    pax: dict[str, str] = field(default_factory=dict)
    chunks: list[Chunk] = field(default_factory=list)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["chunks"] = [c.to_list() for c in self.chunks]
        return {k: v for k, v in d.items() if v not in ("", {}, []) or k in ("path", "type")}

    @classmethod
    def from_dict(cls, d: dict) -> "FileEntry":
        d = dict(d)
        d["chunks"] = [Chunk.from_list(c) for c in d.get("chunks", [])]
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in d.items() if k in known})


@dataclass
class Bundle:
    """The config blob's contents."""
    files: list[FileEntry]
    summary: dict
    gpu_manifest: dict | None
    chunking: dict
    compression: dict
    created: str = field(default_factory=lambda: time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    schema: str = CONFIG_SCHEMA

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def unique_blobs(self) -> dict[str, int]:
        """Each distinct blob once, in first-use order (the manifest's layers)."""
        blobs: dict[str, int] = {}
        for f in self.files:
            for c in f.chunks:
                blobs.setdefault(c.blob, c.blob_size)
        return blobs

    def to_json(self) -> bytes:
        data = {"schema": self.schema, "created": self.created, "chunking": self.chunking,
                "compression": self.compression, "summary": self.summary,
                "gpu_manifest": self.gpu_manifest,
                "files": [f.to_dict() for f in self.files]}
        return json.dumps(data, sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: bytes, where: str) -> "Bundle":
        try:
            data = json.loads(raw)
            if data.get("schema") != CONFIG_SCHEMA:
                raise ValueError(f"unknown schema {data.get('schema')!r}")
            return cls(files=[FileEntry.from_dict(f) for f in data["files"]],
                       summary=data.get("summary") or {}, gpu_manifest=data.get("gpu_manifest"),
                       chunking=data.get("chunking") or {},
                       compression=data.get("compression") or {},
                       created=data.get("created", ""), schema=data["schema"])
        except (ValueError, KeyError, TypeError) as exc:
            raise GpusnapError(f"{where}: the checkpoint config is not readable ({exc})",
                               "it was pushed by another gpusnap version, or is damaged") from None


# A checkpoint of a container that kept running, pushed as the first round of
# a pre-copy migration (`gpusnap migrate -P`): the final round supersedes it.
PRE_CHECKPOINT = ANNOTATION + "pre-checkpoint"


def is_pre_checkpoint(manifest: dict) -> bool:
    return (manifest.get("annotations") or {}).get(PRE_CHECKPOINT) == "true"


def annotations(bundle: Bundle, criu_version: str | None, arch: str | None) -> dict[str, str]:
    """What a target checks before pulling (strings only, as OCI requires)."""
    s = bundle.summary
    gm = bundle.gpu_manifest or {}
    gpus = gm.get("gpus") or []
    out = {
        "org.opencontainers.image.created": bundle.created,
        ANNOTATION + "container.name": (s.get("container") or {}).get("name") or "",
        ANNOTATION + "container.image": (s.get("container") or {}).get("image") or "",
        ANNOTATION + "runtime": s.get("runtime") or "",
        ANNOTATION + "processes": str((s.get("criu") or {}).get("processes", "")),
        ANNOTATION + "size": str(bundle.total_bytes),
        ANNOTATION + "arch": (gm.get("host") or {}).get("arch") or arch or platform.machine(),
        ANNOTATION + "criu.version": gm.get("criu_version") or criu_version or "",
        ANNOTATION + "gpu.count": str(len(gpus)),
        ANNOTATION + "gpu.names": ",".join(sorted({g.get("name", "") for g in gpus})),
        ANNOTATION + "gpu.driver": gm.get("driver_version") or "",
        ANNOTATION + "gpu.cuda": gm.get("cuda_driver_version") or "",
        # absent: Podman (a Podman checkpoint's summary names no engine)
        ANNOTATION + "engine": s.get("engine") or "",
        ANNOTATION + "containerd.snapshotter": (s.get("containerd") or {}).get("snapshotter") or "",
    }
    return {k: v for k, v in out.items() if v != ""}


def _titles(blobs: list[str]) -> dict[str, str]:
    """Short, unique file names for `oras pull` (it skips untitled layers)."""
    short = {b: f"chunk-{b.split(':')[1][:16]}.zst" for b in blobs}
    if len(set(short.values())) != len(short):
        short = {b: f"chunk-{b.split(':')[1]}.zst" for b in blobs}
    return short


def build_manifest(bundle: Bundle, config_digest: str, config_size: int,
                   annotations_: dict[str, str], subject: dict | None) -> bytes:
    blobs = bundle.unique_blobs()
    if len(blobs) > MAX_LAYERS:
        raise GpusnapError(f"the checkpoint needs {len(blobs)} chunks, more than a registry "
                           f"manifest holds ({MAX_LAYERS})",
                           "this should not happen: chunks grow with the checkpoint; report it")
    titles = _titles(list(blobs))
    manifest = {
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "artifactType": ARTIFACT_TYPE,
        "config": {"mediaType": CONFIG_MEDIA_TYPE, "digest": config_digest, "size": config_size},
        "layers": [{"mediaType": CHUNK_MEDIA_TYPE, "digest": b, "size": size,
                    "annotations": {TITLE: titles[b]}} for b, size in blobs.items()],
        "annotations": annotations_,
    }
    if subject:
        manifest["subject"] = subject
    return json.dumps(manifest, separators=(",", ":")).encode()


class PodmanCheckpointImage(GpusnapError):
    """A checkpoint image for Podman itself (`push --format podman`, or Podman's
    own `--create-image`): Podman restores it, gpusnap only describes it."""

    def __init__(self, where: str, manifest: dict) -> None:
        super().__init__(f"{where} is a Podman checkpoint image, not a gpusnap checkpoint",
                         f"restore it with `podman pull {where} && podman container restore "
                         f"{where}`")
        self.manifest = manifest


def parse_manifest(body: bytes, media_type: str, where: str) -> dict:
    """The manifest, if it is a gpusnap checkpoint; else one clear error."""
    try:
        manifest = json.loads(body)
    except ValueError:
        raise GpusnapError(f"{where}: the registry returned a manifest that is not JSON",
                           "check that the reference names a registry, not a web server; "
                           "push the checkpoint again if it is one") from None
    if podman_image.is_checkpoint_image(manifest):
        raise PodmanCheckpointImage(where, manifest)
    media = manifest.get("mediaType") or media_type
    artifact = manifest.get("artifactType") or (manifest.get("config") or {}).get("mediaType")
    if media != OCI_MANIFEST or artifact != ARTIFACT_TYPE:
        what = artifact or media or "unknown"
        raise GpusnapError(f"{where} is not a gpusnap checkpoint (it is {what})",
                           "pass a reference written by `gpusnap push`; `oras manifest fetch "
                           "REF` shows what this one holds")  # inspect refuses it the same way
    config = manifest.get("config") or {}
    if config.get("mediaType") not in (CONFIG_MEDIA_TYPE, ENCRYPTED_CONFIG_MEDIA_TYPE):
        raise GpusnapError(f"{where}: unknown checkpoint config type {config.get('mediaType')!r}",
                           "it was pushed by a newer gpusnap: upgrade")
    return manifest
