"""Push a checkpoint (archive, directory or running container) to an OCI registry."""

from __future__ import annotations

import functools
import os
import platform
import threading
import time
from concurrent.futures import Future
from concurrent.futures import BrokenExecutor  # not .process: it imports multiprocessing
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, Callable

from gpusnap import MANIFEST_NAME, archive, journal
from gpusnap.criu.version import criu_version
from gpusnap.errors import GpusnapError
from gpusnap.oci import bundle as fmt
from gpusnap.oci import chunker, reference, segments, tarfiles
from gpusnap.oci.cache import ChunkCache
from gpusnap.oci.registry import RegistryClient, RegistryOptions
from gpusnap.oci.transfer import Progress, Uploader
from gpusnap.pages import early_pages, kept_pages, pages_aside, prefetch, same_pages
from gpusnap.ops import container_busy, push_podman
from gpusnap.ops.checkpoint import SNAPSHOT_TRIES, StaleSnapshot, TakeAgain, gave_up
from gpusnap.ops.advice import push_command
from gpusnap.ops.push_source import KeptError, PushSource
from gpusnap.ops.push_checks import target_and_keys
from gpusnap.ops.sources import find_container, open_source
from gpusnap.runtime.storage import image_repo_digests
from gpusnap.trust.options import TrustOptions

if TYPE_CHECKING:  # cryptography: imported by push() itself
    from gpusnap.runtime.podman import Container
    from gpusnap.trust.remote import PushTrust

ZSTD_LEVEL = 3  # chunks cross a network: -3 is smaller than -1, still fast per core
WORKERS = 8
# Chunk sizes grow with the file (about 512 chunks per file for fine dedup,
# 4 MiB for big ones) and with the whole checkpoint past MAX_LAYERS * 4 MiB.
# 512, not 256: with 256, a 1% change of a mid-sized pages file sends chunks of
# up to 2 MiB around the change, too near the 5% the issue allows
# (docs/benchmarks.md).
_MIN_AVG, _MAX_AVG = 256 << 10, 4 << 20
_CHUNKS_PER_FILE = 512


# chunk_params is the same for every file bigger than this (its average is at its cap)
_FINAL_PARAMS_FROM = _MAX_AVG // 2 * _CHUNKS_PER_FILE + 1


def chunk_params(file_size: int, scale: int) -> chunker.ChunkParams:
    avg = _MIN_AVG
    while avg < _MAX_AVG and avg * _CHUNKS_PER_FILE < file_size:
        avg *= 2
    avg *= scale
    return chunker.ChunkParams(avg // 4, avg, avg * 4)


def layer_scale(estimated_bytes: int) -> int:
    scale = 1
    while estimated_bytes > fmt.MAX_LAYERS * _MAX_AVG * scale // 2:
        scale *= 2
    return scale


def _entries(src: PushSource):
    if src.path.is_dir():  # a directory, or one made from a containerd checkpoint
        @contextmanager
        def walk():
            yield tarfiles.directory_entries(src.path)
        return walk()
    return tarfiles.archive_entries(src.path, src.follow() if src.follow else None)


def _subject(client: RegistryClient, image: str | None) -> dict | None:
    """The container image's manifest, when it lives in the repository we push to
    (a referrers-aware registry then lists the checkpoint under its image)."""
    if not image:
        return None
    for digest in image_repo_digests(image):
        name, _, d = digest.partition("@")
        if name == f"{client.ref.registry}/{client.ref.repository}":
            found = client.head_manifest(d)  # Podman lists local digests too: ask
            if found:
                return found
    return None


def _direct(src: PushSource, entry: fmt.FileEntry) -> Path | None:
    """A file that holds ``entry``'s data as it is, to be read at any offset
    instead of from the stream: the file itself in a directory source; for a
    container, CRIU's image in Podman's bundle dir, which the export copies
    verbatim (kept by --keep; complete once the export's header for it came,
    and still that file if size and mtime agree)."""
    if entry.type != "file":
        return None
    if src.kind == "directory":
        path = src.path / entry.path
    elif src.userdata is not None and entry.path.startswith("checkpoint/"):
        path = src.userdata / entry.path
    else:
        return None
    try:
        st = path.stat()
    except OSError:
        return None
    same = st.st_size == entry.size and (src.kind == "directory" or int(st.st_mtime) == entry.mtime)
    return path if same else None


class _Parts:
    """Where each file's chunks come from: futures of single chunks (this
    process's Uploader) or of whole segments (worker processes)."""

    def __init__(self, uploader: Uploader, make_pool: Callable[[], segments.SegmentPool] | None,
                 push_id: str | None = None) -> None:
        self.uploader, self._make_pool, self.push_id = uploader, make_pool, push_id
        self.pool: segments.SegmentPool | None = None
        self.split_bytes = 0  # of the files the workers chunked
        self.early: early_pages.EarlyPages | None = None
        self._held: list[int] = []  # descriptors of the files the workers read (pin)
        self._lock = threading.Lock()

    def _pool(self) -> segments.SegmentPool:
        if self.pool is None:
            self.pool = self._make_pool()
        return self.pool

    def watch(self, images: Path, scale: int, done: Callable[[], bool],
              aside: Path | None = None) -> None:
        """Segments of CRIU's page images go to the workers while CRIU writes
        them, and those of memory pre-dump read ahead once it is read."""
        if self._make_pool is not None:
            self.early = early_pages.EarlyPages(
                images, lambda *a: self._counted(self._pool().submit(*a)),
                lambda size: chunk_params(size, scale), _FINAL_PARAMS_FROM, done, self.pin,
                aside, segments.known, self.push_id, self._count)

    def split_file(self, path: Path, size: int, params: chunker.ChunkParams
                   ) -> list[Future] | None:
        """Futures of the file's segments (worker processes), or None: not worth it."""
        if self._make_pool is None or not segments.worth_it(size, params):
            return None
        held = self.pin(path, size)
        if held is None:
            return None
        have = self.early.take(path, size, params) if self.early else {}
        futures = self._pool().submit_file(held, size, params, have)
        futures = [f if at in have else self._counted(f)
                   for at, f in zip(range(0, size, params.segment), futures)]
        self.split_bytes += size
        return futures

    def pin(self, path: Path, size: int | None = None) -> Path | None:
        """``path`` held open until the push ends, as the workers' way to it:
        CRIU's images in Podman's bundle dir go as soon as the export is
        written (a --leave-running dump is stale then, checkpoint.py drops it),
        while the workers may not have opened them yet (a migrate -P under a
        runtime that runs no action script, whose pages stay there, failed so
        under crun 1.21). None: not that file any more (read from the stream)."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return None
        if size is not None and os.fstat(fd).st_size != size:
            os.close(fd)
            return None
        with self._lock:  # the early-pages thread pins too
            self._held.append(fd)
        return Path(f"/proc/{os.getpid()}/fd/{fd}")

    def _counted(self, f: Future) -> Future:
        f.add_done_callback(self._count)
        return f

    def _count(self, f: Future) -> None:
        if not f.cancelled() and f.exception() is None:
            self.uploader.count_elsewhere(f.result().counts)

    @staticmethod
    def chunks(futures: list[Future]) -> list[fmt.Chunk]:
        out: list[fmt.Chunk] = []
        for f in futures:
            try:
                r = f.result()
            except BrokenExecutor:
                raise segments.worker_died("push") from None
            if isinstance(r, segments.SegmentResult):
                out.extend(r.chunks)
            else:
                out.append(r)
        return out

    def close(self) -> None:
        if self.early is not None:
            self.early.stop()
        if self.pool is not None:
            self.pool.close()
        with self._lock:
            for fd in self._held:
                os.close(fd)
            self._held.clear()


def _upload_files(src: PushSource, parts: _Parts, scale: int, label: str
                  ) -> tuple[list[fmt.FileEntry], archive.CheckpointContents, int]:
    """Chunk and upload every file in archive order; keep the small metadata files
    (config.dump, spec.dump, GPU manifest) for the summary. Also: the bytes
    chunked from Podman's bundle dir instead of the export (prefetch.py).
    Big files that can be read at any offset go to worker processes by segments."""
    uploader = parts.uploader
    contents = archive.CheckpointContents(source=label)
    files: list[tuple[fmt.FileEntry, list[Future]]] = []
    early = prefetch.Prefetch.for_podman(src.userdata, uploader.submit,
                                         lambda size: chunk_params(size, scale), src.writer_done)
    if src.userdata is not None:
        parts.watch(src.userdata / "checkpoint", scale, src.writer_done, src.pages_aside)
    with early, _entries(src) as entries:
        for entry, data in entries:
            aside = pages_aside.target(entry)  # pages moved out of the export: its symlink
            if aside is not None:
                entry = pages_aside.as_file(entry, aside)
            futures = []
            if entry.type == "file":
                contents.sizes[entry.path] = entry.size
                taken = early.take(entry)
                if taken is not None:  # chunked while Podman wrote it; the export's copy is skipped
                    files.append((entry, taken))
                    continue
                params = chunk_params(entry.size, scale)
                direct = _direct(src, entry) or aside
                split = direct and parts.split_file(direct, entry.size, params)
                if split:  # the stream skips this member's data
                    files.append((entry, split))
                    continue
                with open(aside, "rb") if aside is not None else nullcontext(data) as stream:
                    futures = _submit_member(entry, stream, params, uploader, contents)
            files.append((entry, futures))
        early.finish()
    for entry, futures in files:
        entry.chunks = parts.chunks(futures)
    return [e for e, _ in files], contents, early.taken_bytes


def _index_pages(aside: Path, files: list[fmt.FileEntry], scale: int, push_id: str) -> None:
    """A pre-checkpoint push's big pages files in RAM: the chunks each became,
    beside it, for the final round to take unhashed where its memory did not
    change (pages/same_pages.py; kept_pages moves them together)."""
    for entry in files:
        path = aside / Path(entry.path).name
        if pages_aside.is_pages(entry.path) and entry.size >= kept_pages.MIN_FILE \
                and path.is_file() and path.stat().st_size == entry.size:
            same_pages.write_index(path, entry.chunks, chunk_params(entry.size, scale), push_id)


def _submit_member(entry: fmt.FileEntry, data: BinaryIO, params: chunker.ChunkParams,
                   uploader: Uploader, contents: archive.CheckpointContents) -> list[Future]:
    """One member's chunks to the uploader; the small metadata files kept for the summary."""
    keep = entry.path in archive.METADATA and entry.size <= 8 << 20
    kept = bytearray()
    futures = []
    for piece in chunker.split(data, params, entry.size):
        if keep:
            kept += piece
        futures.append(uploader.submit(piece))
    if keep:
        contents.files[entry.path] = bytes(kept)
    return futures


def _bundle(source: str, files: list[fmt.FileEntry], contents: archive.CheckpointContents,
            scale: int, level: int) -> fmt.Bundle:
    """The config of what was uploaded: its files and what the checkpoint says of itself."""
    if not (contents.is_podman_checkpoint or contents.is_containerd_checkpoint):
        raise GpusnapError(f"{source} is not a Podman checkpoint (no spec.dump, "
                           "config.dump and checkpoint/ inside)",
                           "pass an export of `podman container checkpoint --export`, "
                           "its extracted directory or a container")
    gpu = contents.json_file(MANIFEST_NAME) or contents.json_file(f"checkpoint/{MANIFEST_NAME}")
    return fmt.Bundle(files=files, summary=contents.summary(), gpu_manifest=gpu,
                      chunking={"algorithm": chunker.ALGORITHM, "scale": scale,
                                "avg": "clamp(file size / 256, 256 KiB, 4 MiB) * scale",
                                "min": "avg / 4", "max": "avg * 4"},
                      compression={"algorithm": "zstd", "level": level})


def _annotations(b: fmt.Bundle, kind: str, pre_checkpoint: bool) -> dict[str, str]:
    criu = None
    if kind in ("container", "containerd-container"):  # checkpointed here, by this CRIU
        criu = criu_version()
    notes = fmt.annotations(b, criu, platform.machine())
    if pre_checkpoint:
        notes[fmt.PRE_CHECKPOINT] = "true"
    return notes


@dataclass
class _PushJob:
    """What push() settled before it touches the container: one attempt's inputs."""
    source: str
    ref: reference.Reference
    opts: RegistryOptions
    client: RegistryClient
    sealing: PushTrust
    container: Container | None  # a Podman container SOURCE names
    cache: ChunkCache | None
    leave_running: bool
    pre_checkpoint: bool
    image_format: str
    level: int
    workers: int
    processes: int
    containerd_address: str | None
    on_checkpoint: Callable[[str], None] | None
    on_checkpointed: Callable[[dict], None] | None
    total: Callable[[int], None] | None
    start: float
    push_again: Callable[[str], str]  # this push's retry from a path, flags and all


class _Counted:
    """The caller's progress, counting what one attempt reported, so that a
    checkpoint taken again starts the bar where it started."""

    def __init__(self, progress: Progress | None) -> None:
        self.progress, self.done, self.sent = progress, 0, 0

    def __call__(self, raw: int, network: int) -> None:
        self.done += raw
        self.sent += network
        if self.progress:
            self.progress(raw, network)

    def rewind(self) -> None:
        if self.progress and self.done:
            self.progress(-self.done, 0)
        self.done = 0


def push(source: str, ref_text: str, opts: RegistryOptions, *, leave_running: bool = False,
         level: int = ZSTD_LEVEL, workers: int = WORKERS, cache_root: Path | None = None,
         progress: Progress | None = None, total: Callable[[int], None] | None = None,
         on_checkpoint: Callable[[str], None] | None = None,
         image_format: str = "gpusnap", trust: TrustOptions | None = None,
         containerd_address: str | None = None, processes: int | None = None,
         pre_checkpoint: bool = False,
         on_checkpointed: Callable[[dict], None] | None = None,
         container_only: bool = False) -> dict:
    """``container_only``: SOURCE is a container, whatever files of its name
    lie here (migrate's). ``processes``: worker processes for big files (segments.py); default
    segments.default_workers(). ``pre_checkpoint``: the first round of a
    pre-copy migration (the container keeps running; annotated so that a
    restore does not take it for the final round). ``on_checkpointed``: a
    container SOURCE's checkpoint is complete on local storage (stopped or
    resumed, GPU released), the upload goes on: {export, container,
    init_pid, seconds, bytes (staged)}; called from the checkpoint's thread.
    A --leave-running checkpoint that would not restore (ops/snapshot_files.py)
    is refused before a reference is pushed, and taken again (SNAPSHOT_TRIES)."""
    leave_running = leave_running or pre_checkpoint
    ref, sealing = target_and_keys(source, ref_text, trust, image_format)
    # a mistyped name is not reported as the registry's fault, a busy one not as Podman's
    container = find_container(source, paths=not container_only)
    client = RegistryClient(ref, opts, push=True)
    client.ping()  # wrong credentials fail before a container is checkpointed
    if processes is None:
        processes = segments.default_workers(stopped=container is not None and not leave_running)
    again = functools.partial(push_command, ref_text=ref_text, opts=opts, trust=trust,
                              image_format=image_format, containerd_address=containerd_address)
    job = _PushJob(source, ref, opts, client, sealing, container, ChunkCache.open(cache_root),
                   leave_running, pre_checkpoint, image_format, level, workers, processes,
                   containerd_address, on_checkpoint, on_checkpointed, total, time.monotonic(),
                   again)
    try:
        # one gpusnap command at a time on a container, every try of it
        with container_busy.only_command(container.id, container.name, "gpusnap push") \
                if container is not None else nullcontext():
            return _push_tries(job, progress, source)
    except KeptError as exc:  # the retry as the user would type it: this push's flags
        raise exc.with_push(again(exc.push_from)) from None


def _push_tries(job: _PushJob, progress: Progress | None, source: str) -> dict:
    changed: list[str] = []
    last: TakeAgain | None = None
    sent_before = 0  # what the registry took from tries whose snapshot was refused
    for attempt in range(1, SNAPSHOT_TRIES + 1):
        counted = _Counted(progress)
        try:
            result = _push_once(job, counted)
        except TakeAgain as again:  # the container still runs: nothing was tagged
            counted.rewind()
            sent_before += counted.sent
            last = again
            changed = again.files if isinstance(again, StaleSnapshot) else changed
            continue
        if attempt > 1:
            result["retaken"] = {"tries": attempt, "files": changed,
                                 "bytes_sent_before": sent_before}
            result["bytes_sent"] += sent_before  # the network's cost, every try
        return result
    # push keeps a container running by default; --stop (migrate without -R) stops it
    raise gave_up(last, source, changed, "no reference was pushed",
                  "push it with --stop, or migrate it without --leave-running")


def _push_once(job: _PushJob, progress: Progress) -> dict:
    with open_source(job.source, job.leave_running, job.on_checkpoint,
                     stream=job.image_format == "gpusnap",
                     containerd_address=job.containerd_address, container=job.container,
                     on_checkpointed=job.on_checkpointed,
                     pre_checkpoint=job.pre_checkpoint, push_again=job.push_again) as src:
        if job.total and src.known_bytes:
            job.total(src.known_bytes)
        if job.image_format == "podman":
            with _entries(src) as entries:
                return push_podman.push_checkpoint(src, entries, job.client, job.source, job.level,
                                                   progress, job.start, job.sealing)
        scale = layer_scale(src.estimated_bytes)
        uploader = Uploader(job.client, job.cache, job.level, job.workers, progress,
                            cipher=job.sealing.cipher)
        make_pool = None if job.sealing.cipher or job.processes < 2 else (
            lambda: segments.SegmentPool(str(job.ref), job.opts,
                                         job.cache.root if job.cache else None, job.level,
                                         job.processes))
        push_id = f"{job.ref.endpoint}/{job.ref.repository} {chunker.ALGORITHM} zstd-{job.level}"
        parts = _Parts(uploader, make_pool, push_id)
        at = {"start": time.monotonic()}  # what the push's end waits on, for the journal
        try:
            files, contents, prefetched = _upload_files(src, parts, scale, str(job.ref))
            at["uploaded"] = time.monotonic()
            if job.pre_checkpoint and src.pages_aside is not None and make_pool is not None:
                _index_pages(src.pages_aside, files, scale, push_id)
            src.finish()  # the checkpoint's end: a stale one is refused before the manifest
            at["checkpointed"] = time.monotonic()
            b = _bundle(job.source, files, contents, scale, job.level)
            config = job.sealing.seal_config(b.to_json())
            config_digest = uploader.put_small(config)
        finally:
            parts.close()
            uploader.close()
        at["closed"] = time.monotonic()
        notes = _annotations(b, src.kind, job.pre_checkpoint)
        image = (b.summary.get("container") or {}).get("image")
        if b.summary.get("engine") == "containerd":
            image = None  # Podman's repo digests (the subject) do not describe containerd's images
        manifest = job.sealing.finish_manifest(
            fmt.build_manifest(b, config_digest, len(config), notes, _subject(job.client, image)))
        digest = job.client.put_manifest(manifest, fmt.OCI_MANIFEST, job.ref.target)
        signed_by = job.sealing.sign(job.client, digest, len(manifest))
        at["manifest"] = time.monotonic()
        back = src.gpu_back() if src.gpu_back else {}
    if job.cache:
        job.cache.prune()
    seconds = time.monotonic() - job.start
    journal.record("pushed", reference=str(job.ref), digest=digest, seconds=round(seconds, 3),
                   unchanged_bytes=uploader.stats.known_bytes,
                   timing={k: round(t - at["start"], 3) for k, t in at.items() if k != "start"},
                   left_s=round(time.monotonic() - at["manifest"], 3))
    stats = uploader.stats
    ref = job.ref
    return {"reference": str(ref), "digest": digest, "pinned": str(ref.with_digest(digest)),
            "source": job.source, "source_kind": src.kind, "container": src.container,
            "files": len(b.files), "bytes": b.total_bytes,
            "chunks": stats.chunks, "layers": len(b.unique_blobs()),
            "chunks_sent": stats.chunks_transferred, "bytes_sent": stats.network_bytes,
            "bytes_stored": sum(b.unique_blobs().values()),
            "prefetched_bytes": prefetched,
            "parallel_bytes": parts.split_bytes, "processes": parts.pool.workers if parts.pool else 0,
            "early_bytes": parts.early.early_bytes if parts.early else 0,
            "unchanged_bytes": stats.known_bytes,
            "seconds": round(seconds, 3),
            "throughput_mb_s": round(b.total_bytes / seconds / 1e6, 1) if seconds else None,
            "gpu": b.summary.get("gpu") is not None, "annotations": notes,
            "pre_checkpoint": job.pre_checkpoint,
            "trust": job.sealing.facts(signed_by), **back}
