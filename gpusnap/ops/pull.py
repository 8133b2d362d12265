"""Pull a checkpoint from an OCI registry: open it (manifest, config, trust),
inspect it, or write its files as an archive Podman imports. Restoring it is
restore_ref.py's, on top of these."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field, replace
from itertools import islice
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from gpusnap.pages import pages_aside
from gpusnap.errors import GpusnapError
from gpusnap.oci import bundle as fmt
from gpusnap.oci import podman_image, reference, segments
from gpusnap.oci.cache import ChunkCache
from gpusnap.oci.registry import RegistryClient, RegistryOptions
from gpusnap.oci.bundle import FileEntry
from gpusnap.oci.tarfiles import ArchiveWriter, ReaderStopped, sized
from gpusnap.oci.transfer import Downloader, Progress, Stats
from gpusnap.pages import prepared_pages
from gpusnap.ops import restore as ops_restore
from gpusnap.pages import memory
from gpusnap.trust import remote as trust_remote
from gpusnap.trust.options import TrustOptions

WORKERS = 8


@dataclass
class Remote:
    client: RegistryClient
    digest: str  # the verified manifest's: every later read is a blob it names
    manifest: dict
    bundle: fmt.Bundle
    trust: dict = field(default_factory=dict)  # the policy's decision (verify.check), for --json
    cipher: Any = None  # encrypt.ChunkCipher of an encrypted checkpoint: pass it to Downloader
    asked: bool = True  # False: manifest and config came from this host's cache (PULL_MISSING)


# --pull: ask the registry for a REF pinned by digest only when this host lacks it
# (Podman's default for images), or every time. A tag is always asked: tags move.
PULL_MISSING, PULL_ALWAYS = "missing", "always"


def _read_manifest(ref_text: str, opts: RegistryOptions) -> tuple[RegistryClient, bytes, str, str]:
    ref = reference.parse(ref_text)
    client = RegistryClient(ref, opts)
    client.ping()
    body, media, digest = client.get_manifest()
    return client, body, media, digest


def _bundle(raw: bytes, manifest: dict, where: str) -> fmt.Bundle:
    b = fmt.Bundle.from_json(raw, where)
    layers = {layer["digest"] for layer in manifest.get("layers") or []}
    missing = {c.blob for f in b.files for c in f.chunks} - layers
    if missing:
        raise GpusnapError(f"{where}: the file list names {len(missing)} chunk(s) the manifest "
                           "does not list", "the checkpoint in the registry is damaged; push it again")
    return b


def open_remote(ref_text: str, opts: RegistryOptions, trust: TrustOptions | None = None,
                cache: ChunkCache | None = None, pull: str = PULL_ALWAYS) -> Remote:
    """Manifest and config only: what the pre-download checks read. The manifest
    is checked against the trust policy (docs/trust.md) before the config or any
    chunk is read; an encrypted config is opened with a --decrypt-key.

    With a ``cache``, both are kept in it (blobs by digest); with PULL_MISSING, a
    REF pinned by digest whose manifest and config the cache holds is opened
    from it without a word to the registry (which is then asked only for a
    chunk the cache lacks), unless the policy wants a signature (its `.sig`
    tag is the registry's to say)."""
    trust = trust or TrustOptions()
    # keys before the network: a wrong passphrase fails first
    private = trust_remote.load_private_keys(trust.decrypt_keys, trust.passphrase_file)
    if cache is not None and pull == PULL_MISSING:
        remote = _cached_remote(ref_text, opts, trust, private, cache)
        if remote is not None:
            return remote
    client, body, media, digest = _read_manifest(ref_text, opts)
    where = str(client.ref)
    try:
        manifest = fmt.parse_manifest(body, media, where)
    except fmt.PodmanCheckpointImage as image:  # Podman's to restore: its command, our flags
        command = podman_image.restore_command(where, opts, rename=_rename(image.manifest))
        raise GpusnapError(image.message, f"restore it with `{command}`") from None
    decision = trust_remote.check(client, digest, trust)
    blob = _config_blob(client, manifest)
    remote = _opened(client, digest, manifest, blob, private, decision)
    if cache is not None and digest.startswith("sha256:"):
        cache.put_blob(digest, body)
        cache.put_blob(manifest["config"]["digest"], blob)
    return remote


def _rename(image_manifest: dict) -> str | None:
    """The --name a Podman checkpoint image's restore line needs here (its name taken)."""
    return ops_restore.free_name(podman_image.container_name(image_manifest))


def _opened(client: RegistryClient, digest: str, manifest: dict, blob: bytes, private: list,
            decision: dict, asked: bool = True) -> Remote:
    """The Remote once the policy decided: its config opened (decrypted where sealed)."""
    where = str(client.ref)
    raw, cipher = trust_remote.open_config(manifest, blob, private, where)
    decision["encrypted"] = cipher is not None
    return Remote(client, digest, manifest, _bundle(raw, manifest, where), decision, cipher, asked)


def _config_blob(client: RegistryClient, manifest: dict) -> bytes:
    desc = manifest["config"]
    return bytes(client.get_blob(desc["digest"], int(desc["size"])))


def _cached_remote(ref_text: str, opts: RegistryOptions, trust: TrustOptions, private: list,
                   cache: ChunkCache) -> Remote | None:
    """The Remote of a pinned REF from the cache alone (each blob checked against
    its digest), or None where the registry must be asked."""
    ref = reference.parse(ref_text)
    if not ref.digest or not ref.digest.startswith("sha256:") \
            or trust_remote.needs_registry(ref, trust):
        return None
    body = cache.get_blob(ref.digest)
    if body is None:
        return None
    manifest = fmt.parse_manifest(body, fmt.OCI_MANIFEST, str(ref))
    blob = cache.get_blob(manifest["config"]["digest"])
    if blob is None:
        return None
    client = RegistryClient(ref, opts)  # no request yet: only for a chunk the cache lacks
    return _opened(client, ref.digest, manifest, blob, private,
                   trust_remote.check(client, ref.digest, trust), asked=False)


def _registry_facts(client: RegistryClient, digest: str, manifest: dict) -> dict:
    layers = manifest.get("layers") or []
    notes = manifest.get("annotations") or {}
    return {"reference": str(client.ref), "digest": digest,
            "artifact_type": manifest.get("artifactType"), "annotations": notes,
            "subject": manifest.get("subject"),
            "created": notes.get("org.opencontainers.image.created"), "files": None,
            "chunks": None, "layers": len(layers),
            "stored_bytes": sum(int(layer["size"]) for layer in layers)}


def _sealed_summary(client: RegistryClient, digest: str, manifest: dict, facts: dict) -> dict:
    """An encrypted checkpoint inspected without a key: its manifest's annotations."""
    notes = manifest.get("annotations") or {}
    a = fmt.ANNOTATION
    return {"source": str(client.ref), "sealed": True,
            "container": {"name": notes.get(a + "container.name"),
                          "image": notes.get(a + "container.image"), "id": None},
            "runtime": notes.get(a + "runtime"),
            "total_bytes": int(notes.get(a + "size") or 0) or None,
            "gpu_count": int(notes.get(a + "gpu.count") or 0),
            "registry": _registry_facts(client, digest, manifest), "trust": facts}


def inspect(ref_text: str, opts: RegistryOptions, trust: TrustOptions | None = None) -> dict:
    """What REF holds, and whether it is signed and encrypted (to whom); needs no
    key and no policy (nothing is verified). With a --decrypt-key, an encrypted
    checkpoint's config is opened and described like a plain one."""
    trust = trust or TrustOptions()
    private = trust_remote.load_private_keys(trust.decrypt_keys, trust.passphrase_file)
    client, body, media, digest = _read_manifest(ref_text, opts)
    where = str(client.ref)
    try:
        manifest = fmt.parse_manifest(body, media, where)
    except fmt.PodmanCheckpointImage as image:  # described from its manifest alone
        summary = podman_image.summary(image.manifest, where, opts, _rename(image.manifest))
        summary["trust"] = trust_remote.describe(client, digest, image.manifest)
        return summary
    facts = trust_remote.describe(client, digest, manifest)
    if facts["encrypted"] and not private:
        return _sealed_summary(client, digest, manifest, facts)
    raw, _ = trust_remote.open_config(manifest, _config_blob(client, manifest), private, where)
    b = _bundle(raw, manifest, where)
    summary = dict(b.summary)
    summary["source"] = where
    summary["registry"] = {**_registry_facts(client, digest, manifest), "created": b.created,
                           "files": len(b.files), "chunks": sum(len(f.chunks) for f in b.files)}
    summary["trust"] = facts
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
        raise GpusnapError(f"cannot write {output}: {output.absolute().parent} does not exist",
                           "create that folder, or pass -o FILE in one that exists")


def write_archive(remote: Remote, output: Path, **kw) -> dict:
    """Fetch every chunk (cache first), verify it, and write the archive."""
    check_output(output)
    return write_files(remote, ArchiveWriter(output), output, **kw)


def _add(writer, pages: Path | None, entry: FileEntry, data: Iterable[bytes]) -> None:
    """``entry`` into the tar; with ``pages``, CRIU's memory pages are written
    there instead and the tar holds a symlink to each (pages/pages_aside.py)."""
    if pages is not None and entry.type == "file" and pages_aside.is_pages(entry.path):
        entry, data = pages_aside.write(pages, entry, sized(entry, data)), ()
    writer.add(entry, data)


def write_files(remote: Remote, writer, output: Path, *, use_cache: bool = True,
                cache_root: Path | None = None, workers: int = WORKERS,
                progress: Progress | None = None,
                total: Callable[[int], None] | None = None,
                cancel: threading.Event | None = None, processes: int | None = None,
                prepared: prepared_pages.Match | None = None,
                edits: dict[str, bytes] | None = None) -> dict:
    """The bundle's files, each chunk fetched (cache first) and verified, into
    ``writer`` (an ArchiveWriter, or a DirectoryWriter: add/commit/abort).
    ``cancel`` set stops it between two chunks (the reader gave up).
    ``prepared``: pages files written ahead on this host (pages/prepared_pages.py),
    linked or patched instead of written anew. ``edits``: files written as
    given instead of fetched (a restore onto moved GPUs: retarget.edit_members), and
    one the bundle lacks added before the first file of its folder."""
    edits = edits or {}
    cache = ChunkCache.open(cache_root) if use_cache else None
    processes = segments.default_workers() if processes is None else processes
    b = remote.bundle
    if total:
        total(b.total_bytes)
    start = time.monotonic()
    downloader = Downloader(remote.client, cache, workers, progress, cipher=remote.cipher)
    pages = getattr(writer, "pages", None)
    # Big files (CRIU's pages of a GPU process) are fetched by worker processes
    # (segments.py); sealed chunks stay here, with the keys that open them.
    # Pages files a prepared folder holds go that way on any host: linked, they
    # start no worker; on a host too small for workers one fetches what a patch lacks.
    held = {*prepared.sources, *prepared.plans} if prepared is not None and pages else set()
    big = {id(f) for f in b.files if f.type == "file" and remote.cipher is None and (
        (segments.worth_fetching(f.size) and processes >= 2) or f.path in held)
           and f.path not in edits}
    stream = downloader.fetch(c for f in b.files if id(f) not in big and f.path not in edits
                              for c in f.chunks)
    added = _added(b, edits)
    if cancel is not None:
        stream = _until(stream, cancel)
    fetch = segments.FetchPool(str(remote.client.ref), remote.client.opts,
                               cache.root if cache else None, max(processes, 1),
                               downloader.count_elsewhere) if big else None
    beside = 0  # pages written by the workers beside the import
    try:
        for entry in b.files:
            for extra in added.pop(entry.path.rpartition("/")[0], ()):
                writer.add(extra, [edits[extra.path]])
            image = prepared_pages.rewritten(prepared, entry.path) if pages else None
            if entry.path in edits:
                writer.add(replace(entry, size=len(edits[entry.path]), chunks=[]),
                           [edits[entry.path]])
            elif id(entry) in big and pages is not None and pages_aside.is_pages(entry.path):
                path = pages_aside.path_in(pages, entry)
                beside += _write_pages(entry, path, fetch, prepared, cancel)
                writer.add(pages_aside.link_entry(entry, path), ())
            elif image is not None:  # CRIU reads this one, rewritten against its parent
                for _ in islice(stream, len(entry.chunks)):
                    pass
                path = pages_aside.path_in(pages, entry)
                path.write_bytes(image)
                writer.add(pages_aside.link_entry(entry, path), ())
            elif id(entry) in big:
                pieces = fetch.pieces(entry.chunks)
                _add(writer, pages, entry, _until(pieces, cancel) if cancel is not None else pieces)
            else:
                _add(writer, pages, entry, islice(stream, len(entry.chunks)))
        for extra in (e for extras in added.values() for e in extras):  # a folder with no file
            writer.add(extra, [edits[extra.path]])
        writer.commit()
    except BaseException:
        writer.abort()
        raise
    finally:
        stream.close()
        if fetch is not None:
            fetch.close()
        downloader.close()
    s = downloader.stats
    if cache and s.network_bytes:  # nothing fetched: the cache did not grow (a replica)
        cache.prune()
    return _report(remote, output, s, time.monotonic() - start, fetch, beside, prepared)


def _write_pages(entry: fmt.FileEntry, path: Path, fetch: segments.FetchPool,
                 prepared: prepared_pages.Match | None, cancel: threading.Event | None) -> int:
    """A pages file written where CRIU reads it, by the worker processes: from
    its parent's images, patched from a prepared file, or anew. Its bytes."""
    stop, mapped = (lambda: _stopped(cancel)), memory.in_ram(path)
    if prepared is not None and entry.path in prepared.plans:
        return prepared_pages.write_parent(prepared, entry, path, fetch, stop, mapped)
    runs = prepared_pages.use(prepared, entry, path) if prepared else None
    if runs is None:
        return fetch.write_file(entry.chunks, path, stop, mapped)
    return fetch.patch_file(runs, path, stop, mapped)


def _report(remote: Remote, output: Path, s: Stats, seconds: float,
            fetch: segments.FetchPool | None, beside: int,
            prepared: prepared_pages.Match | None) -> dict:
    b = remote.bundle
    return {"reference": str(remote.client.ref), "digest": remote.digest,
            "output": str(output), "bytes": b.total_bytes, "files": len(b.files),
            "chunks": s.chunks, "bytes_fetched": s.network_bytes,
            "bytes_from_cache": s.cached_bytes, "bytes_repeated": s.repeated_bytes,
            "seconds": round(seconds, 3),
            "throughput_mb_s": round(b.total_bytes / seconds / 1e6, 1) if seconds else None,
            "processes": fetch.workers if fetch and fetch.started else 0,
            "pages_written_in_place": beside,
            "pages_prepared": prepared_pages.report(prepared), "trust": remote.trust}


def _added(b: fmt.Bundle, edits: dict[str, bytes]) -> dict[str, list[fmt.FileEntry]]:
    """The files of ``edits`` the bundle lacks (the plan a moved restore carries),
    by the folder they go in: each is written before that folder's first file."""
    known = {f.path for f in b.files}
    added: dict[str, list[fmt.FileEntry]] = {}
    for path in sorted(set(edits) - known):
        folder = path.rpartition("/")[0]
        if folder and folder not in known:
            raise ValueError(f"{path}: the bundle has no folder {folder}")
        added.setdefault(folder, []).append(
            fmt.FileEntry(path=path, type="file", mode=0o600, size=len(edits[path])))
    return added


def _stopped(cancel: threading.Event | None) -> None:
    """Raise ReaderStopped once ``cancel`` is set (the restore failed: Podman's
    error is the one to report, not this)."""
    if cancel is not None and cancel.is_set():
        raise ReaderStopped("the download was stopped: the restore failed")


def _until(stream: Iterator[bytes], cancel: threading.Event) -> Iterator[bytes]:
    try:
        for piece in stream:
            _stopped(cancel)
            yield piece
    finally:
        stream.close()


# Called with the trust decision once every check passed, before the download:
# the CLI warns there about a skipped verification (not for a refused pull).
OnTrusted = Callable[[dict], None]


def pull(ref_text: str, output: str | None, opts: RegistryOptions,
         trust: TrustOptions | None = None, on_trusted: OnTrusted | None = None, **kw) -> dict:
    if output:
        check_output(Path(output))  # before any network
    remote = open_remote(ref_text, opts, trust)
    if on_trusted:
        on_trusted(remote.trust)
    out = Path(output) if output else default_output(remote.client.ref)
    result = write_archive(remote, out, **kw)
    result["container"] = (remote.bundle.summary.get("container") or {}).get("name")
    return result


def fetch_small(remote: Remote, entries: list[fmt.FileEntry],
                cache: ChunkCache | None) -> dict[str, bytes]:
    """Small files of the bundle, whole, by path (cache first)."""
    downloader = Downloader(remote.client, cache, 2, None, cipher=remote.cipher)
    try:
        return {f.path: b"".join(downloader.fetch(f.chunks)) for f in entries}
    finally:
        downloader.close()
