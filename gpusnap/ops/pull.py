"""Pull a checkpoint from an OCI registry: inspect it, write an archive, or restore it."""

from __future__ import annotations

import shutil
import tempfile
import time
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Callable

from gpusnap.errors import GpusnapError
from gpusnap.oci import bundle as fmt
from gpusnap.oci import podman_image, reference
from gpusnap.oci.cache import ChunkCache
from gpusnap.oci.registry import RegistryClient, RegistryOptions
from gpusnap.oci.tarfiles import ArchiveWriter
from gpusnap.oci.transfer import Downloader, Progress
from gpusnap.runtime import podman
from gpusnap.runtime.storage import staging_dir

WORKERS = 8


@dataclass
class Remote:
    client: RegistryClient
    digest: str
    manifest: dict
    bundle: fmt.Bundle


def open_remote(ref_text: str, opts: RegistryOptions) -> Remote:
    """Manifest and config only: what inspect and the pre-download checks read."""
    ref = reference.parse(ref_text)
    client = RegistryClient(ref, opts)
    client.ping()
    body, media, digest = client.get_manifest()
    manifest = fmt.parse_manifest(body, media, str(ref))
    config = manifest["config"]
    raw = client.get_blob(config["digest"], int(config["size"]))
    b = fmt.Bundle.from_json(raw, str(ref))
    layers = {layer["digest"] for layer in manifest.get("layers") or []}
    missing = {c.blob for f in b.files for c in f.chunks} - layers
    if missing:
        raise GpusnapError(f"{ref}: the file list names {len(missing)} chunk(s) the manifest "
                           "does not list", "the checkpoint in the registry is damaged; push it again")
    return Remote(client, digest, manifest, b)


def inspect(ref_text: str, opts: RegistryOptions) -> dict:
    try:
        remote = open_remote(ref_text, opts)
    except fmt.PodmanCheckpointImage as image:  # described from its manifest alone
        return podman_image.summary(image.manifest, str(reference.parse(ref_text)))
    summary = dict(remote.bundle.summary)
    summary["source"] = str(remote.client.ref)
    summary["registry"] = {
        "reference": str(remote.client.ref), "digest": remote.digest,
        "artifact_type": remote.manifest.get("artifactType"),
        "annotations": remote.manifest.get("annotations") or {},
        "subject": remote.manifest.get("subject"),
        "created": remote.bundle.created, "files": len(remote.bundle.files),
        "chunks": sum(len(f.chunks) for f in remote.bundle.files),
        "layers": len(remote.manifest.get("layers") or []),
        "stored_bytes": sum(int(layer["size"]) for layer in remote.manifest.get("layers") or []),
    }
    return summary


def default_output(ref: reference.Reference) -> Path:
    name = ref.repository.rsplit("/", 1)[-1]
    suffix = ref.tag if ref.tag else (ref.digest or "").split(":")[-1][:12]
    return Path(f"{name}-{suffix}.tar.zst")


def check_output(output: Path) -> None:
    if output.is_dir():
        raise GpusnapError(f"{output} is a directory", "pass -o FILE (e.g. ctr.tar.zst)")
    if not output.name.endswith((".tar", ".zst")):
        raise GpusnapError(f"cannot tell how to write {output.name}",
                           "name it .tar.zst (zstd, as Podman exports) or .tar (uncompressed)")
    if not output.absolute().parent.is_dir():
        raise GpusnapError(f"cannot write {output}: {output.absolute().parent} does not exist")


def write_archive(remote: Remote, output: Path, *, use_cache: bool = True,
                  cache_root: Path | None = None, workers: int = WORKERS,
                  progress: Progress | None = None,
                  total: Callable[[int], None] | None = None) -> dict:
    """Fetch every chunk (cache first), verify it, and write the archive."""
    check_output(output)
    cache = ChunkCache.open(cache_root) if use_cache else None
    b = remote.bundle
    if total:
        total(b.total_bytes)
    start = time.monotonic()
    downloader = Downloader(remote.client, cache, workers, progress)
    writer = ArchiveWriter(output)
    stream = downloader.fetch(c for f in b.files for c in f.chunks)
    try:
        for entry in b.files:
            writer.add(entry, islice(stream, len(entry.chunks)))
        writer.commit()
    except BaseException:
        writer.abort()
        raise
    finally:
        stream.close()
        downloader.close()
    if cache:
        cache.prune()
    seconds = time.monotonic() - start
    s = downloader.stats
    return {"reference": str(remote.client.ref), "digest": remote.digest,
            "output": str(output), "bytes": b.total_bytes, "files": len(b.files),
            "chunks": s.chunks, "bytes_fetched": s.network_bytes,
            "bytes_from_cache": s.cached_bytes, "seconds": round(seconds, 3),
            "throughput_mb_s": round(b.total_bytes / seconds / 1e6, 1) if seconds else None}


def pull(ref_text: str, output: str | None, opts: RegistryOptions, **kw) -> dict:
    if output:
        check_output(Path(output))  # before any network
    remote = open_remote(ref_text, opts)
    out = Path(output) if output else default_output(remote.client.ref)
    return write_archive(remote, out, **kw)


def _restore_checks(remote: Remote, name: str | None, gpu_map: str | None, dry_run: bool):
    """What restore would refuse, refused before gigabytes are downloaded; the GPU plan."""
    target = name or (remote.bundle.summary.get("container") or {}).get("name")
    if target and podman.exists(target) and not dry_run:
        raise GpusnapError(f"a container named {target} already exists",
                           f"remove it (`podman rm {target}`) or restore with --name NEW")
    from gpusnap.gpu.manifest import Manifest
    from gpusnap.ops.gpu_plan import plan_here

    manifest = remote.bundle.gpu_manifest
    return plan_here(Manifest.from_dict(manifest) if manifest else None, gpu_map,
                     refusal_hint="restore on a host with GPUs like the checkpoint's (`gpusnap "
                                  "inspect REF` lists them), or name targets with --gpu-map; "
                                  "nothing was downloaded")


def restore(ref_text: str, name: str | None, keep: bool, tcp_established: bool,
            opts: RegistryOptions, gpu_map: str | None = None, dry_run: bool = False,
            **kw) -> dict:
    """Pull into a staged plain tar (no compression round trip), restore it, drop it."""
    from gpusnap.ops import restore as ops_restore

    remote = open_remote(ref_text, opts)
    plan = _restore_checks(remote, name, gpu_map, dry_run)
    if dry_run:
        return ops_restore.plan_report(str(remote.client.ref), plan)
    work = Path(tempfile.mkdtemp(prefix=".gpusnap-pull-",
                                 dir=staging_dir(remote.bundle.total_bytes + (64 << 20))))
    try:
        archive = work / "checkpoint.tar"
        try:
            pulled = write_archive(remote, archive, **kw)
        except GpusnapError as exc:
            if "disk is full" not in exc.message:
                raise
            raise GpusnapError(exc.message.replace(str(archive), str(remote.client.ref)),
                               f"free {remote.bundle.total_bytes >> 20} MiB in {work.parent} "
                               "(restore stages the pull beside Podman's storage or in "
                               "/var/tmp, whichever has more room); nothing was restored") \
                from None
        try:
            result = ops_restore.run(str(archive), name, keep, tcp_established, gpu_map=gpu_map)
        except GpusnapError as exc:
            raise GpusnapError(exc.message.replace(str(archive), str(remote.client.ref)),
                               exc.hint) from None
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result["source"] = str(remote.client.ref)
    result["pull"] = pulled
    return result
