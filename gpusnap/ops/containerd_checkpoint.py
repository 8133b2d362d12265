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

`checkpoint_container` is `ctr c checkpoint --task --rw` through the API: a
running container checkpointed into such an image.

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
import uuid
from pathlib import Path
from typing import Any, Callable

from google.protobuf import any_pb2

from gpusnap.criu.log import SEIZE_TRIES, UNSEIZABLE_MARK
from gpusnap.ops.containerd_api import (
    CHECKPOINT_CONFIG_MEDIA, CHECKPOINT_MEDIA, Client, ContainerdError, extract_tar, host_arch,
    restore_from_dir, runc_checkpoint_options)
from gpusnap.ops.containerd_gpu import quiesced_first
from gpusnap.private import open_private, write_private
from gpusnap.waits import Bound

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
    rw = next((m for t, m in by_type.items() if t in RW_MEDIA), None)
    meta = {"format": FORMAT, "image": notes.get("org.opencontainers.image.ref.name", ""),
            "runtime": notes.get("io.containerd.checkpoint.runtime", ""),
            "snapshotter": notes.get("io.containerd.checkpoint.snapshotter", ""),
            "rw_media_type": rw["mediaType"] if rw else None, "source": image}
    _write_layout(c, dest, by_type[CHECKPOINT_MEDIA]["digest"], by_type[CHECKPOINT_CONFIG_MEDIA]["digest"],
                  rw["digest"] if rw else None, meta)
    return meta


def _write_layout(c: Client, dest: Path, criu: str, spec: str, rw: str | None, meta: dict) -> None:
    """DEST made from content blobs: the CRIU images' tar unpacked, the spec (an Any), the rw layer, META."""
    dest.mkdir(parents=True, mode=0o700)
    try:
        with tempfile.NamedTemporaryFile(dir=dest, prefix=".criu-", suffix=".tar") as tmp:
            c.read_blob(criu, tmp)
            tmp.flush()
            extract_tar(Path(tmp.name), dest / "checkpoint")
        spec_any = any_pb2.Any.FromString(c.read_blob(spec))
        write_private(dest / "spec.json", spec_any.value)  # the environment (API keys): root only
        if rw is not None:
            with open_private(dest / "rw.layer", "wb") as f:
                c.read_blob(rw, f)
        write_private(dest / "containerd.json", json.dumps(meta, indent=1))
    except BaseException:
        shutil.rmtree(dest, ignore_errors=True)
        raise


def checkpoint_container(c: Client, container_id: str, image: str, exit_after: bool = True) -> None:
    """`ctr c checkpoint --task --rw CONTAINER_ID IMAGE`: the running container checkpointed into a new image.

    As ctr: the task is paused while its read-write layer is diffed and CRIU
    dumps it (its GPU quiesced before the pause: containerd_gpu.py), then stopped
    (EXIT_AFTER; killed once the image exists: _checkpoint_paused) or resumed. The image holds the checkpoint
    until it is deleted, so a stopped container stays restorable from it
    whatever happens to a copy made from it (export_image).
    """
    ctr = c.call("containers", "Containers", "Get", id=container_id).container
    try:
        task = c.call("tasks", "Tasks", "Get", container_id=container_id).process
    except ContainerdError:
        task = None
    if task is None or task.status != c.pb.task_types.RUNNING:
        raise ContainerdError(f"container {container_id} has no running task")
    # The GPU first, so that the task stays paused from its rw diff to the end of the dump
    with quiesced_first(task.pid) as gpu:
        for attempt in range(1, SEIZE_TRIES + 1):
            try:
                if gpu is not None:
                    gpu.ask()
                _checkpoint_paused(c, ctr, container_id, image, exit_after,
                                   gpu.seen if gpu is not None else None)
                return
            except ContainerdError as e:
                # The pause caught a task in vfork() (criu.log.unseizable_words): resumed,
                # it runs on past it; paused again, its rw layer is diffed again too.
                if UNSEIZABLE_MARK not in str(e) or attempt == SEIZE_TRIES:
                    raise



def _checkpoint_paused(c: Client, ctr: Any, container_id: str, image: str, exit_after: bool,
                       check: Callable[[], None] | None) -> None:
    """Pause, the rw diff, the dump, ``check`` (before any image is made), the image,
    (``exit_after``) the task killed, Resume.

    The dump always leaves the task as it was, paused: `ctr c checkpoint --task`
    dumps with runc's exit and makes its image after, so a check, an index or an
    image that failed there lost the task and, its blobs held by the lease alone,
    the checkpoint too. Here the task is killed only once its image holds the
    checkpoint; any failure before that resumes it."""
    with c.leased():
        c.call("tasks", "Tasks", "Pause", container_id=container_id)
        try:
            rw = _rw_diff(c, ctr)
            descs = list(c.call("tasks", "Tasks", "Checkpoint", container_id=container_id,
                                timeout=Bound.of("RUNC").seconds,  # the shim's runc checkpoint
                                options=runc_checkpoint_options(False)).descriptors)
            if check is not None:
                check()
            target = _write_checkpoint_index(c, ctr, descs + ([rw] if rw is not None else []))
            c.call("images", "Images", "Create", image=c.pb.images.Image(
                name=image, target=target, labels={"containerd.io/checkpoint": "true"}))
            if exit_after:  # paused, SIGKILL is all it gets: it dies as the Resume thaws it
                c.call("tasks", "Tasks", "Kill", container_id=container_id, signal=9, all=True)
        finally:
            # As ctr's deferred Resume: a task that exited has none to do.
            with contextlib.suppress(ContainerdError):
                c.call("tasks", "Tasks", "Resume", container_id=container_id)
    if exit_after:  # stopped when this returns, as a dump with runc's exit leaves it
        c.call("tasks", "Tasks", "Wait", container_id=container_id,
               timeout=Bound.of("RUNC").seconds)


def _write_checkpoint_index(c: Client, ctr: Any, descs: list[Any]) -> Any:
    """The index `ctr c checkpoint` writes: its blobs, and the image, runtime and snapshotter as annotations."""
    arch = host_arch()
    manifests = [{"mediaType": d.media_type, "digest": d.digest, "size": d.size,
                  "platform": {"os": "linux", "architecture": arch}} for d in descs]
    annotations = {"org.opencontainers.image.ref.name": ctr.image,
                   "io.containerd.checkpoint.runtime": ctr.runtime.name,
                   "io.containerd.checkpoint.snapshotter": ctr.snapshotter}
    data = json.dumps({"schemaVersion": 2, "mediaType": _INDEX_TYPES[0], "manifests": manifests,
                       "annotations": annotations}).encode()
    # The labels keep the blobs as long as the index (the image) lives, once the lease is gone.
    labels = {f"containerd.io/gc.ref.content.{i}": m["digest"] for i, m in enumerate(manifests)}
    digest = c.write_bytes(data, labels)
    return c.pb.descriptor.Descriptor(media_type=_INDEX_TYPES[0], digest=digest, size=len(data))


def _rw_diff(c: Client, ctr: Any) -> Any:
    """The container's read-write layer as a layer in the content store (containerd's rootfs.CreateDiff)."""
    if not ctr.snapshot_key:
        return None
    sn, key = ctr.snapshotter, ctr.snapshot_key
    parent = c.call("snapshots", "Snapshots", "Stat", snapshotter=sn, key=key).info.parent
    view = f"{key}-parent-view-{uuid.uuid4().hex[:12]}"
    lower = c.call("snapshots", "Snapshots", "View", snapshotter=sn, key=view, parent=parent).mounts
    try:
        upper = c.call("snapshots", "Snapshots", "Mounts", snapshotter=sn, key=key).mounts
        # gzip, as ctr's: `ctr c restore --rw` takes no other layer type.
        return c.call("diff", "Diff", "Diff", left=list(lower), right=list(upper), media_type=RW_MEDIA[1],
                      ref=f"checkpoint-rw-{key}-{uuid.uuid4().hex[:8]}", timeout=3600).diff
    finally:
        with contextlib.suppress(ContainerdError):
            c.call("snapshots", "Snapshots", "Remove", snapshotter=sn, key=view)


def _chain_id(diff_ids: list[str]) -> str:
    """The snapshot name of an image's top layer: each layer's id chained onto its parent's."""
    chain = diff_ids[0]
    for d in diff_ids[1:]:
        chain = "sha256:" + hashlib.sha256(f"{chain} {d}".encode()).hexdigest()
    return chain


def _image_chain_id(c: Client, image: str, arch: str | None = None) -> str:
    try:
        desc = c.call("images", "Images", "Get", name=image).image.target
    except ContainerdError:
        raise ContainerdError(f"image {image} is not in namespace {c.namespace}: "
                              f"pull or import it there first") from None
    doc = _json_blob(c, desc.digest)
    arch = arch or host_arch()  # the manifest containerd pulled the layers of: this host's
    if desc.media_type in _INDEX_TYPES:
        found = [m for m in doc["manifests"] if (m.get("platform") or {}).get("architecture", arch) == arch]
        if not found:
            raise ContainerdError(f"image {image} has no linux/{arch} manifest")
        doc = _json_blob(c, found[0]["digest"])
    config = _json_blob(c, doc["config"]["digest"])
    return _chain_id(config["rootfs"]["diff_ids"])


def import_dir(c: Client, src: Path, container_id: str, stdout: str = "", stderr: str = "",
               runtime: str | None = None, annotations: dict[str, str] | None = None) -> int:
    """A container CONTAINER_ID made from the exported checkpoint SRC and restored; the task's pid.

    ANNOTATIONS are added to the spec (e.g. io.gpusnap.gpu-map, which the shim's GPU plan reads).
    """
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
    if annotations:
        spec.setdefault("annotations", {}).update(annotations)
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
