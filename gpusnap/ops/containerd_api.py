"""A small client of containerd's gRPC API, and the checkpoint flows nerdctl builds on it.

`checkpoint_to_dir` is what `nerdctl checkpoint create CTR NAME` does (nerdctl
2.x, pkg/cmd/checkpoint/create.go, on containerd's Go client): a lease, Pause,
Tasks.Checkpoint, an index image of the checkpoint written to the content
store, Resume; then the CRIU tar read back and unpacked into a directory, and
the image deleted. `restore_from_dir` is `nerdctl start --checkpoint NAME`
(pkg/taskutil): the directory re-tarred into a content blob, Tasks.Create with
that descriptor (containerd unpacks it and the shim restores at Start), Start.

What containerd 1.7 does with the checkpoint options depends on the runtime's
name (services/tasks/local.go, getCheckpointPath): only for
`io.containerd.runc.*` does it read CheckpointOptions.image_path and let the
runtime dump there without a content-store copy. For any other runtime, ours
included, it dumps into a temporary directory, tars that into the content
store and returns the descriptors; the options reach the shim unchanged.
nerdctl itself sets CheckpointOptions (only `exit`) for `io.containerd.runc.v2`
alone, so under io.containerd.gpusnap.v1 it sends none: see NERDCTL_OPTIONS.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import io
import json
import platform
import re
import tarfile
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
from google.protobuf import any_pb2, message_factory

from gpusnap.criu import dumped
from gpusnap.criu.log import first_error
from gpusnap.private import restrict_tree
from gpusnap.proto import load
from gpusnap.proto.rpc import bidi_stub, stream_stub, unary_stub
from gpusnap.waits import Bound

CHECKPOINT_MEDIA = "application/vnd.containerd.container.criu.checkpoint.criu.tar"
CHECKPOINT_CONFIG_MEDIA = "application/vnd.containerd.container.checkpoint.config.v1+proto"
INDEX_MEDIA = "application/vnd.oci.image.index.v1+json"
RUNC_V2 = "io.containerd.runc.v2"
_CHUNK = 1 << 20


class ContainerdError(RuntimeError):
    """A containerd call failed; the message is one line."""


_CRIU_LOG = re.compile(r"\(CRIU log: ([^)\s]+)\)")


def with_criu_error(details: str) -> str:
    """runc's shim answers a failed checkpoint or restore with "criu failed:
    type DUMP errno 0 (CRIU log: PATH)": CRIU's first error in that log says why."""
    m = _CRIU_LOG.search(details)
    why = first_error(Path(m.group(1))) if m else None
    return f"{details}; CRIU: {why}" if why else details


def runc_checkpoint_options(exit_after: bool) -> any_pb2.Any:
    """containerd.runc.v1.CheckpointOptions{exit}, as containerd's Go client packs it."""
    opts = load().runc_options.CheckpointOptions(exit=exit_after)
    return any_pb2.Any(type_url="containerd.runc.v1.CheckpointOptions", value=opts.SerializeToString())


def nerdctl_options(runtime: str, exit_after: bool) -> any_pb2.Any | None:
    """The checkpoint options nerdctl sends: CheckpointOptions{exit} for io.containerd.runc.v2 only."""
    if runtime != RUNC_V2:
        return None  # nerdctl's switch has no other case: --leave-running or not, nothing is sent
    return runc_checkpoint_options(exit_after)


class Client:
    """Calls to one containerd (gRPC socket ADDRESS) in NAMESPACE."""

    def __init__(self, address: str, namespace: str) -> None:
        self.pb = load()
        self.namespace = namespace
        self.lease = ""
        self.channel = grpc.insecure_channel(f"unix:{address}", options=[
            ("grpc.max_receive_message_length", 16 << 20), ("grpc.max_send_message_length", 16 << 20)])

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _metadata(self) -> list[tuple[str, str]]:
        md = [("containerd-namespace", self.namespace)]
        if self.lease:
            md.append(("containerd-lease", self.lease))
        return md

    def _service(self, module: str, name: str):
        return getattr(self.pb, module).DESCRIPTOR.services_by_name[name]

    def call(self, module: str, service: str, method: str, timeout: float = 300, **fields: Any):
        """One unary call, e.g. call("tasks", "Tasks", "Start", container_id=...)."""
        svc = self._service(module, service)
        req = getattr(self.pb, module).DESCRIPTOR.message_types_by_name[svc.methods_by_name[method].input_type.name]
        msg = message_factory.GetMessageClass(req)(**fields)
        try:
            return unary_stub(self.channel, svc, method)(msg, metadata=self._metadata(), timeout=timeout)
        except grpc.RpcError as e:
            raise ContainerdError(f"{service}.{method}: "
                                  f"{with_criu_error(e.details() or e.code().name)}") from None

    # --- leases ------------------------------------------------------------------

    @contextlib.contextmanager
    def leased(self, hours: int = 24) -> Iterator[str]:
        """Content written inside is kept from GC until the block ends (as the Go client's WithLease)."""
        expire = (datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(hours=hours))
        lease = self.call("leases", "Leases", "Create", id=f"gpusnap-{uuid.uuid4().hex[:12]}",
                          labels={"containerd.io/gc.expire": expire.strftime("%Y-%m-%dT%H:%M:%SZ")}).lease.id
        self.lease = lease
        try:
            yield lease
        except BaseException:  # the block's failure is what the caller must see
            self.lease = ""
            with contextlib.suppress(ContainerdError):
                self.call("leases", "Leases", "Delete", id=lease)
            raise
        self.lease = ""
        self.call("leases", "Leases", "Delete", id=lease)

    # --- content -----------------------------------------------------------------

    def read_blob(self, digest: str, out: io.RawIOBase | io.BufferedIOBase | None = None) -> bytes:
        """The blob DIGEST (written to OUT when given, else returned), its digest checked."""
        svc = self._service("content", "Content")
        h = hashlib.sha256()
        parts = []
        try:
            for resp in stream_stub(self.channel, svc, "Read")(
                    self.pb.content.ReadContentRequest(digest=digest), metadata=self._metadata(), timeout=3600):
                h.update(resp.data)
                if out is not None:
                    out.write(resp.data)
                else:
                    parts.append(resp.data)
        except grpc.RpcError as e:
            raise ContainerdError(f"Content.Read {digest}: {e.details() or e.code().name}") from None
        if f"sha256:{h.hexdigest()}" != digest:
            raise ContainerdError(f"Content.Read {digest}: data has digest sha256:{h.hexdigest()}")
        return b"".join(parts)

    def write_blob(self, f: io.BufferedIOBase, size: int, digest: str, labels: dict[str, str] | None = None) -> None:
        """Stream F (SIZE bytes, DIGEST) into the content store; a blob already there is kept."""
        try:
            self.call("content", "Content", "Info", digest=digest)
            return  # content-addressed: the same bytes are there already
        except ContainerdError:
            pass
        pb = self.pb.content
        ref = f"gpusnap-{uuid.uuid4().hex}"

        def requests() -> Iterator[Any]:
            yield pb.WriteContentRequest(action=pb.STAT, ref=ref, total=size, expected=digest)
            offset = 0
            while chunk := f.read(_CHUNK):
                yield pb.WriteContentRequest(action=pb.WRITE, ref=ref, offset=offset, data=chunk)
                offset += len(chunk)
            yield pb.WriteContentRequest(action=pb.COMMIT, ref=ref, total=size, expected=digest,
                                         offset=offset, labels=labels or {})

        svc = self._service("content", "Content")
        try:
            last = None
            for last in bidi_stub(self.channel, svc, "Write")(requests(), metadata=self._metadata(), timeout=3600):
                pass
        except grpc.RpcError as e:
            raise ContainerdError(f"Content.Write {digest}: {e.details() or e.code().name}") from None
        if last is None or last.digest != digest:
            raise ContainerdError(f"Content.Write {digest}: committed {getattr(last, 'digest', 'nothing')}")

    def write_bytes(self, data: bytes, labels: dict[str, str] | None = None) -> str:
        digest = f"sha256:{hashlib.sha256(data).hexdigest()}"
        self.write_blob(io.BytesIO(data), len(data), digest, labels)
        return digest


def _tar_dir(src: Path, out: io.BufferedIOBase) -> None:
    """SRC's tree as a tar of relative paths, owners and modes kept (what CRIU restores needs)."""
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in sorted(src.rglob("*")):
            tar.add(path, arcname=str(path.relative_to(src)), recursive=False)


def extract_tar(tar_path: Path, dest: Path) -> None:
    """TAR_PATH unpacked into DEST (made, 0700), owners kept, modes root only."""
    dest.mkdir(parents=True, mode=0o700)
    with tarfile.open(tar_path) as tar:
        tar.extractall(dest, filter="fully_trusted")  # root-owned CRIU images: owners must stay
    # CRIU wrote its images 0644 (and a "./" member sets DEST's mode): group and others out
    restrict_tree(dest)


NERDCTL = "nerdctl"


def checkpoint_to_dir(c: Client, container_id: str, dest: Path, exit_after: bool = True,
                      options: any_pb2.Any | None | str = NERDCTL) -> list[Any]:
    """`nerdctl checkpoint create`: checkpoint CONTAINER_ID through containerd, unpack the CRIU image into DEST.

    OPTIONS: the checkpoint options to send; by default the ones nerdctl would
    (nerdctl_options). Returns the descriptors Tasks.Checkpoint answered
    (checkpoint tar, spec).
    """
    if dest.exists():
        raise ContainerdError(f"checkpoint directory {dest} already exists")
    with c.leased():
        ctr = c.call("containers", "Containers", "Get", id=container_id).container
        opts = nerdctl_options(ctr.runtime.name, exit_after) if options == NERDCTL else options
        c.call("tasks", "Tasks", "Pause", container_id=container_id)
        try:
            descs = list(c.call("tasks", "Tasks", "Checkpoint", container_id=container_id,
                                timeout=Bound.of("RUNC").seconds,  # the shim's runc checkpoint
                                **({"options": opts} if opts is not None else {})).descriptors)
            index = _write_index(c, ctr, descs)
            name = f"gpusnap-checkpoint/{container_id}:{uuid.uuid4().hex[:8]}"
            c.call("images", "Images", "Create", image=c.pb.images.Image(
                name=name, target=index, labels={"containerd.io/checkpoint": "true"}))
        finally:
            # Resumed after everything, as the Go client's deferred Resume; a task that exited has none.
            with contextlib.suppress(ContainerdError):
                c.call("tasks", "Tasks", "Resume", container_id=container_id)
        try:
            manifests = json.loads(c.read_blob(index.digest))["manifests"]
            (cp,) = [m for m in manifests if m["mediaType"] == CHECKPOINT_MEDIA]
            with tempfile.NamedTemporaryFile(dir=dest.parent, prefix=".ckpt-", suffix=".tar") as tmp:
                c.read_blob(cp["digest"], tmp)
                tmp.flush()
                extract_tar(Path(tmp.name), dest)
        finally:
            c.call("images", "Images", "Delete", name=name, sync=True)
    return descs


def host_arch() -> str:
    """This host's architecture as OCI names it (GOARCH): amd64, arm64."""
    return {"x86_64": "amd64", "aarch64": "arm64"}.get(platform.machine(), platform.machine())


def _write_index(c: Client, ctr: Any, descs: list[Any]):
    """The checkpoint's OCI index, as containerd's client writes it (image, checkpoint, spec)."""
    arch = host_arch()
    manifests = [{"mediaType": d.media_type, "digest": d.digest, "size": d.size,
                  "platform": {"os": "linux", "architecture": arch}} for d in descs]
    annotations = {}
    if ctr.image:
        img = c.call("images", "Images", "Get", name=ctr.image).image.target
        manifests.append({"mediaType": img.media_type, "digest": img.digest, "size": img.size,
                          "annotations": {"org.opencontainers.image.ref.name": ctr.image}})
        annotations["image.name"] = ctr.image
    data = json.dumps({"schemaVersion": 2, "manifests": manifests, "annotations": annotations}).encode()
    labels = {f"containerd.io/gc.ref.content.{i}": m["digest"] for i, m in enumerate(manifests)}
    digest = c.write_bytes(data, labels)
    return c.pb.descriptor.Descriptor(media_type=INDEX_MEDIA, digest=digest, size=len(data))


def start_task(c: Client, container_id: str, stdout: str = "", stderr: str = "", terminal: bool = False,
               checkpoint: Any = None) -> int:
    """A new task of CONTAINER_ID (restored from CHECKPOINT, a content descriptor, when given), started; its pid.

    As containerd's Go client (container.NewTask): the rootfs mounts come from
    the container's snapshot, then Tasks.Create and Tasks.Start.
    """
    ctr = c.call("containers", "Containers", "Get", id=container_id).container
    rootfs = []
    if ctr.snapshot_key:
        rootfs = list(c.call("snapshots", "Snapshots", "Mounts", snapshotter=ctr.snapshotter,
                             key=ctr.snapshot_key).mounts)
    # A restore's Create unpacks the checkpoint and its Start is the shim's `runc
    # restore`: bound as the shim bounds runc, or this side would give up (and
    # undo) while the shim still restores
    bound = Bound.of("RUNC").seconds + 60 if checkpoint is not None else 300  # the shim's first
    pid = c.call("tasks", "Tasks", "Create", container_id=container_id, rootfs=rootfs, stdout=stdout,
                 stderr=stderr, terminal=terminal, checkpoint=checkpoint, timeout=bound).pid
    return c.call("tasks", "Tasks", "Start", container_id=container_id, timeout=bound).pid or pid


def restore_from_dir(c: Client, container_id: str, src: Path, stdout: str = "", stderr: str = "") -> int:
    """`nerdctl start --checkpoint`: a new task of CONTAINER_ID restored from the CRIU image in SRC; its pid."""
    if not dumped.whole(src):
        raise ContainerdError(f"{src} holds no CRIU image (no inventory.img)")
    with tempfile.TemporaryFile(dir=src.parent) as tmp:
        _tar_dir(src, tmp)
        size = tmp.tell()
        tmp.seek(0)
        h = hashlib.sha256()
        while chunk := tmp.read(_CHUNK):
            h.update(chunk)
        tmp.seek(0)
        digest = f"sha256:{h.hexdigest()}"
        now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        c.write_blob(tmp, size, digest, {"containerd.io/gc.root": now})
    desc = c.pb.descriptor.Descriptor(media_type=CHECKPOINT_MEDIA, digest=digest, size=size)
    try:
        return start_task(c, container_id, stdout, stderr, checkpoint=desc)
    finally:
        # nerdctl drops the blob once the task is made: containerd unpacked it for the shim at Create.
        with contextlib.suppress(ContainerdError):
            c.call("content", "Content", "Delete", digest=digest)
