"""containerd checkpoint images as plain directories, and back into a container of another namespace or host.

`ctr c checkpoint --task [--rw] CTR IMG` (and containerd's Go client) store an
OCI index of containerd media types that registries refuse: the CRIU image
as a tar, the spec as a protobuf Any, the read-write layer, and the image
name, runtime and snapshotter as annotations. `export_image` lays it out as a
directory gpusnap's chunked registry format can carry (dedup works on the
CRIU files as for Podman checkpoints):

    checkpoint/       the CRIU images (with the GPU manifest when there are GPUs)
    spec.json         the container's OCI spec
    rw.layer          the read-write layer as containerd stored it (when --rw)
    containerd.json   image, runtime, snapshotter, the layer's media type

`import_dir` makes the container again in a namespace (its image must be
there): a snapshot on the image's layers with the rw layer applied,
Containers.Create with the spec, then the task restored from checkpoint/ as
`nerdctl start --checkpoint` does (the shim plans the GPUs at Start).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from google.protobuf import any_pb2

from gpusnap.ops.containerd_api import (
    CHECKPOINT_CONFIG_MEDIA, CHECKPOINT_MEDIA, Client, ContainerdError, extract_tar, restore_from_dir)

FORMAT = "gpusnap.containerd-checkpoint.v1"
SPEC_TYPE = "types.containerd.io/opencontainers/runtime-spec/1/Spec"
RW_MEDIA = ("application/vnd.oci.image.layer.v1.tar", "application/vnd.oci.image.layer.v1.tar+gzip",
            "application/vnd.docker.image.rootfs.diff.tar.gzip")
_INDEX_TYPES = ("application/vnd.oci.image.index.v1+json", "application/vnd.docker.distribution.manifest.list.v2+json")


def _json_blob(c: Client, digest: str) -> dict:
    return json.loads(c.read_blob(digest))


def export_image(c: Client, image: str, dest: Path) -> dict:
    """Lay the checkpoint image IMAGE out in DEST (which must not exist); returns containerd.json's content."""
    if dest.exists():
        raise ContainerdError(f"{dest} already exists")
    target = c.call("images", "Images", "Get", name=image).image.target
    index = _json_blob(c, target.digest) if target.media_type in _INDEX_TYPES else {}
    by_type = {m["mediaType"]: m for m in index.get("manifests", [])}
    notes = index.get("annotations") or {}
    if CHECKPOINT_MEDIA not in by_type or CHECKPOINT_CONFIG_MEDIA not in by_type:
        raise ContainerdError(f"{image} is not a containerd checkpoint image (no CRIU tar and spec in its index)")
    dest.mkdir(parents=True, mode=0o700)
    try:
        with tempfile.NamedTemporaryFile(dir=dest, prefix=".criu-", suffix=".tar") as tmp:
            c.read_blob(by_type[CHECKPOINT_MEDIA]["digest"], tmp)
            tmp.flush()
            extract_tar(Path(tmp.name), dest / "checkpoint")
        spec_any = any_pb2.Any.FromString(c.read_blob(by_type[CHECKPOINT_CONFIG_MEDIA]["digest"]))
        (dest / "spec.json").write_bytes(spec_any.value)
        rw = next((m for t, m in by_type.items() if t in RW_MEDIA), None)
        if rw is not None:
            with open(dest / "rw.layer", "wb") as f:
                c.read_blob(rw["digest"], f)
        meta = {"format": FORMAT, "image": notes.get("org.opencontainers.image.ref.name", ""),
                "runtime": notes.get("io.containerd.checkpoint.runtime", ""),
                "snapshotter": notes.get("io.containerd.checkpoint.snapshotter", ""),
                "rw_media_type": rw["mediaType"] if rw else None, "source": image}
        (dest / "containerd.json").write_text(json.dumps(meta, indent=1))
    except BaseException:
        shutil.rmtree(dest, ignore_errors=True)
        raise
    return meta


def _chain_id(diff_ids: list[str]) -> str:
    """The snapshot name of an image's top layer: each layer's id chained onto its parent's."""
    chain = diff_ids[0]
    for d in diff_ids[1:]:
        chain = "sha256:" + hashlib.sha256(f"{chain} {d}".encode()).hexdigest()
    return chain


def _image_chain_id(c: Client, image: str, arch: str = "amd64") -> str:
    try:
        desc = c.call("images", "Images", "Get", name=image).image.target
    except ContainerdError:
        raise ContainerdError(f"image {image} is not in namespace {c.namespace}: "
                              f"pull or import it there first") from None
    doc = _json_blob(c, desc.digest)
    if desc.media_type in _INDEX_TYPES:
        found = [m for m in doc["manifests"] if (m.get("platform") or {}).get("architecture", arch) == arch]
        if not found:
            raise ContainerdError(f"image {image} has no linux/{arch} manifest")
        doc = _json_blob(c, found[0]["digest"])
    config = _json_blob(c, doc["config"]["digest"])
    return _chain_id(config["rootfs"]["diff_ids"])


def import_dir(c: Client, src: Path, container_id: str, stdout: str = "", stderr: str = "",
               runtime: str | None = None) -> int:
    """A container CONTAINER_ID made from the exported checkpoint SRC and restored; the task's pid."""
    try:
        meta = json.loads((src / "containerd.json").read_text())
        spec = json.loads((src / "spec.json").read_text())
    except (OSError, ValueError) as e:
        raise ContainerdError(f"{src} is not an exported containerd checkpoint ({e})") from None
    if meta.get("format") != FORMAT:
        raise ContainerdError(f"{src}/containerd.json: unknown format {meta.get('format')!r}")
    parent = _image_chain_id(c, meta["image"])
    snapshotter = meta["snapshotter"] or "overlayfs"
    # The cgroup follows containerd's own naming (/NAMESPACE/ID), as a container created here would get.
    spec.setdefault("linux", {})["cgroupsPath"] = f"/{c.namespace}/{container_id}"
    made: list[str] = []
    try:
        with c.leased():
            mounts = c.call("snapshots", "Snapshots", "Prepare", snapshotter=snapshotter, key=container_id,
                            parent=parent).mounts
            made.append("snapshot")
            if meta.get("rw_media_type"):
                _apply_layer(c, src / "rw.layer", meta["rw_media_type"], list(mounts))
            ctr = c.pb.containers.Container(
                id=container_id, image=meta["image"], snapshotter=snapshotter, snapshot_key=container_id,
                runtime=c.pb.containers.Container.Runtime(name=runtime or meta["runtime"]),
                spec=any_pb2.Any(type_url=SPEC_TYPE, value=json.dumps(spec).encode()))
            c.call("containers", "Containers", "Create", container=ctr)
            made.append("container")
        return restore_from_dir(c, container_id, src / "checkpoint", stdout, stderr)
    except BaseException:
        _undo(c, container_id, snapshotter, made)
        raise


def _apply_layer(c: Client, layer: Path, media_type: str, mounts: list[Any]) -> None:
    h = hashlib.sha256()
    with open(layer, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
        size = f.tell()
        f.seek(0)
        digest = f"sha256:{h.hexdigest()}"
        c.write_blob(f, size, digest)  # under the caller's lease until applied
    desc = c.pb.descriptor.Descriptor(media_type=media_type, digest=digest, size=size)
    c.call("diff", "Diff", "Apply", diff=desc, mounts=mounts)


def _undo(c: Client, container_id: str, snapshotter: str, made: list[str]) -> None:
    """Remove what import_dir made before it failed (the task, if any, first)."""
    with contextlib.suppress(ContainerdError):
        c.call("tasks", "Tasks", "Delete", container_id=container_id)
    if "container" in made:
        with contextlib.suppress(ContainerdError):
            c.call("containers", "Containers", "Delete", id=container_id)
    if "snapshot" in made:
        with contextlib.suppress(ContainerdError):
            c.call("snapshots", "Snapshots", "Remove", snapshotter=snapshotter, key=container_id)
