"""`gpusnap push --format podman`: the checkpoint as a Podman checkpoint image
(see gpusnap/oci/podman_image.py), streamed: the layer is tarred, compressed
by multi-threaded zstd and uploaded in pieces as the checkpoint is read."""

from __future__ import annotations

import hashlib
import platform
import tarfile
import time
from typing import TYPE_CHECKING, Iterator, Sequence

from gpusnap import archive
from gpusnap.criu.version import criu_version
from gpusnap.errors import GpusnapError
from gpusnap.oci import podman_image, tarfiles
from gpusnap.oci.lazy import need
from gpusnap.oci.malloc import one_heap_for_all_threads
from gpusnap.oci.registry import RegistryClient
from gpusnap.oci.transfer import Progress
from gpusnap.runtime import podman

if TYPE_CHECKING:  # cryptography: only where a push is encrypted
    from gpusnap.ops.push_source import PushSource
    from gpusnap.trust.ocicrypt_layer import LayerEncryptor
    from gpusnap.trust.remote import PushTrust

_READ = 1 << 20


class LayerStream:
    """The checkpoint's files as one zstd-compressed tar, in pieces; keeps the
    metadata files (config.dump, spec.dump) and the uncompressed tar's digest."""

    def __init__(self, entries, label: str, level: int, progress: Progress | None) -> None:
        zstd = need("zstandard")
        one_heap_for_all_threads()
        # One zstd worker per core, as `zstd -T0`, on 1 MiB jobs: the default job
        # size (4 windows) holds several times the memory of 1 MiB jobs.
        params = zstd.ZstdCompressionParameters.from_level(level, threads=-1, job_size=1 << 20)
        self._compressor = zstd.ZstdCompressor(compression_params=params).compressobj()
        self._entries = entries
        self._progress = progress
        self.contents = archive.CheckpointContents(source=label)
        self._tar_hash = hashlib.sha256()
        self.raw_bytes = 0
        self.files = 0

    @property
    def diff_id(self) -> str:
        return "sha256:" + self._tar_hash.hexdigest()

    def _tar(self) -> Iterator[bytes]:
        for entry, data in self._entries:
            self.files += 1
            yield tarfiles.tarinfo(entry).tobuf(format=tarfile.PAX_FORMAT)
            if data is None:
                continue
            self.contents.sizes[entry.path] = entry.size
            keep = entry.path in archive.METADATA and entry.size <= 8 << 20
            kept = bytearray()
            left = entry.size
            while left:
                piece = data.read(min(_READ, left))
                if not piece:
                    raise GpusnapError(f"{entry.path} ended {left} bytes early while it was read",
                                       "the checkpoint changed or is damaged")
                left -= len(piece)
                if keep:
                    kept += piece
                if self._progress:
                    self._progress(len(piece), 0)
                yield piece
            if keep:
                self.contents.files[entry.path] = bytes(kept)
            yield b"\0" * (-entry.size % tarfile.BLOCKSIZE)
        yield b"\0" * (2 * tarfile.BLOCKSIZE)

    def __iter__(self) -> Iterator[bytes]:
        for block in self._tar():
            self._tar_hash.update(block)
            self.raw_bytes += len(block)
            out = self._compressor.compress(block)
            if out:
                yield out
        yield self._compressor.flush()


def push_image(src_entries, client: RegistryClient, label: str, level: int,
               criu_version: str | None, progress: Progress | None,
               encryptor: LayerEncryptor | None = None, recipients: Sequence = ()) -> dict:
    """Upload the layer and config, then the manifest; what was pushed. With an
    ``encryptor`` (gpusnap/trust/ocicrypt_layer.py) the zstd layer is encrypted
    as it streams, and its descriptor says so as ocicrypt writes it."""
    info = podman.info()  # before gigabytes are sent: `podman info` must work
    if not info:
        raise GpusnapError("`podman info` failed: a Podman checkpoint image names the host's "
                           "runtime and versions", "check `podman info`, or push without "
                           "--format podman")
    layer = LayerStream(src_entries, label, level, progress)
    pieces = (encryptor.update(p) for p in layer) if encryptor else iter(layer)
    layer_digest, layer_size = client.put_blob_stream(pieces)
    layer_notes = encryptor.finish(recipients) if encryptor else None
    contents = layer.contents
    if not contents.is_podman_checkpoint:
        raise GpusnapError(f"{label} is not a Podman checkpoint (no spec.dump, config.dump and "
                           "checkpoint/ inside)", "pass an export of `podman container "
                           "checkpoint --export`, its extracted directory or a container")
    notes = podman_image.annotations(contents.json_file("config.dump") or {}, info, criu_version)
    config = podman_image.image_config(layer.diff_id,
                                       notes[podman_image.PREFIX + "host.arch"])
    config_digest = "sha256:" + hashlib.sha256(config).hexdigest()
    if not client.blob_exists(config_digest):
        client.put_blob(config_digest, config)
    body = podman_image.manifest(config_digest, len(config), layer_digest, layer_size, notes,
                                 layer_notes)
    digest = client.put_manifest(body, podman_image.OCI_MANIFEST, client.ref.target)
    return {"digest": digest, "manifest_bytes": len(body), "files": layer.files,
            "bytes": sum(contents.sizes.values()),
            "layer_bytes": layer_size, "annotations": notes, "arch": platform.machine(),
            "summary": contents.summary()}


def push_checkpoint(src: "PushSource", entries, client: RegistryClient, source: str, level: int,
                    progress: Progress | None, start: float, sealing: "PushTrust") -> dict:
    """``src`` (its tar ``entries``) as one layer with Podman's annotations:
    `podman container restore REF` takes it; encrypted to ``sealing.recipients``
    as ocicrypt encrypts layers."""
    criu = criu_version() if src.kind == "container" else None  # checkpointed here, by this CRIU
    pushed = push_image(entries, client, str(client.ref), level, criu, progress,
                        sealing.layer_encryptor(), sealing.recipients)
    signed_by = sealing.sign(client, pushed["digest"], pushed["manifest_bytes"])
    seconds = time.monotonic() - start
    ref = client.ref
    # the restore line is advice.after_push's, as for gpusnap's own format
    return {"reference": str(ref), "digest": pushed["digest"], "format": "podman",
            "pinned": str(ref.with_digest(pushed["digest"])), "source": source,
            "source_kind": src.kind, "container": src.container, "files": pushed["files"],
            "bytes": pushed["bytes"], "bytes_sent": pushed["layer_bytes"], "layers": 1,
            "seconds": round(seconds, 3),
            "throughput_mb_s": round(pushed["bytes"] / seconds / 1e6, 1) if seconds else None,
            "annotations": pushed["annotations"], "trust": sealing.facts(signed_by)}
