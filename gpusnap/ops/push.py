"""Push a checkpoint (archive, directory or running container) to an OCI registry."""

from __future__ import annotations

import platform
import shutil
import tarfile
import tempfile
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, Callable, Iterator

from gpusnap import MANIFEST_NAME, archive
from gpusnap.criu import pages_aside
from gpusnap.criu.action import DEFAULT_LOCK_TIMEOUT_MS
from gpusnap.errors import GpusnapError
from gpusnap.oci import bundle as fmt
from gpusnap.oci import chunker, reference, segments, tarfiles
from gpusnap.oci.cache import ChunkCache
from gpusnap.oci.registry import RegistryClient, RegistryOptions
from gpusnap.oci.transfer import Progress, Uploader
from gpusnap.ops import early_pages, prefetch
from gpusnap.runtime import memory, podman
from gpusnap.runtime.follow import follow
from gpusnap.runtime.storage import PUSH_PREFIX, discard, image_repo_digests, staging_dir
from gpusnap.runtime.stream import partial_path, tar_member
from gpusnap.trust.options import TrustOptions

if TYPE_CHECKING:  # cryptography: imported by push() itself
    from gpusnap.trust.remote import PushTrust

ZSTD_LEVEL = 3  # chunks cross a network: -3 is 5-10% smaller than -1 at ~1 GB/s per core
WORKERS = 8
# Chunk sizes grow with the file (about 512 chunks per file for fine dedup,
# 4 MiB for big ones) and with the whole checkpoint past MAX_LAYERS * 4 MiB.
# 512, not 256: a 1% change of a ~67 MB pages file sent 1.8-4.7% with 256
# (chunks up to 2 MiB around the change), too near the 5% the issue allows.
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


@dataclass
class PushSource:
    kind: str  # archive, directory, container
    path: Path
    estimated_bytes: int  # decides the chunk scale
    known_bytes: int | None = None  # for a progress bar, where it is known
    container: str | None = None  # checkpointed by this push
    # A container's export as it is written (the checkpoint runs beside the push).
    follow: Callable[[], BinaryIO] | None = None
    # Waits for that checkpoint and raises its error: called before the manifest
    # is put, so a checkpoint that failed late is never published.
    finish: Callable[[], None] = lambda: None
    # Podman's bundle dir of that container, while Podman writes into it: files
    # it copies into the export are chunked there first (prefetch.py).
    userdata: Path | None = None
    writer_done: Callable[[], bool] = lambda: True


def dir_size(root: Path) -> int:
    """Bytes of the regular files under ``root``: a directory source's size."""
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and not p.is_symlink())


def find_container(source: str) -> podman.Container | None:
    """The Podman container SOURCE names (None: a file, a directory or containerd's);
    one that names nothing is refused here, before any registry is asked."""
    if source.startswith("containerd://") or Path(source).is_dir() or Path(source).is_file():
        return None
    container = podman.find(source)
    if container is None:
        raise GpusnapError(f"{source}: no such file, directory or container",
                           "pass an exported archive, a checkpoint directory or a running "
                           "container's name (`podman ps`)")
    return container


@contextmanager
def resolve_source(source: str, leave_running: bool,
                   on_checkpoint: Callable[[str], None] | None = None,
                   stream: bool = True, containerd_address: str | None = None,
                   container: podman.Container | None = None,
                   on_checkpointed: Callable[[dict], None] | None = None
                   ) -> Iterator[PushSource]:
    """SOURCE as a file stream. A container is checkpointed into a staged plain
    tar; with ``stream`` the push reads that tar while Podman still writes it
    (upload overlaps the dump), else once it is complete. ``on_checkpointed``:
    called once a container's checkpoint succeeded (see push())."""
    if source.startswith("containerd://"):  # a containerd container or checkpoint image
        from gpusnap.ops import containerd_registry

        with containerd_registry.push_source(source, leave_running, on_checkpoint,
                                             containerd_address) as src:
            yield src
        return
    path = Path(source)
    if path.is_dir():
        size = dir_size(path)
        yield PushSource("directory", path, size, size)
        return
    if path.is_file():
        yield PushSource("archive", path, path.stat().st_size * 4)  # zstd -1 of memory: ~2-4x
        return
    container = container or find_container(source)
    from gpusnap.ops import checkpoint as ops_checkpoint  # CRIU/GPU code, only when needed

    sets_aside = stream and pages_aside.enabled()
    # The export holds the pages only where they are not set aside: then it
    # needs the roomiest place (36.7 GB at 32 GiB filled the disk beside
    # Podman's storage, where the set-aside export needs a few MB).
    root = _work_root(container) if sets_aside else staging_dir(0, container.graph_root)
    work = Path(tempfile.mkdtemp(prefix=PUSH_PREFIX, dir=root))
    # Plain, not zstd: the chunks are compressed one by one anyway, so a
    # compressed export would be compressed twice and decompressed once more.
    export = work / "checkpoint.tar"
    aside: Path | None = None  # where CRIU's memory pages go, out of Podman's export
    in_ram = False
    stopped = False  # the container is down and this archive is all that is left of it
    pool = ThreadPoolExecutor(1, thread_name_prefix="gpusnap-checkpoint")
    try:
        # The disk's room is checked below, once it is known whether the pages go to RAM.
        plan = ops_checkpoint.plan(source, str(export), leave_running, False,
                                   DEFAULT_LOCK_TIMEOUT_MS, skip_space_check=True,
                                   export_level=0, container=container)
        if sets_aside:
            aside, in_ram = _pages_folder(plan, work, root)
        if not in_ram:
            ops_checkpoint.require_space([plan.container.userdata, export.parent],
                                         plan.estimate_bytes)
        if aside is not None:  # this push drops the local checkpoint once it read the pages
            plan.keep, plan.pages_aside, plan.pages_prelinked = True, aside, in_ram
        if on_checkpoint:
            on_checkpoint(plan.container.name)
        if stream:  # one from an earlier export would be followed as if Podman wrote it
            (plan.container.userdata / prefetch.DEVSHM).unlink(missing_ok=True)
            early_pages.clear_stale(plan.container.checkpoint_dir)
        job = pool.submit(ops_checkpoint.run, plan)
        if on_checkpointed:
            job.add_done_callback(_when_checkpointed(on_checkpointed, plan, export, aside))
        if not stream:
            job.result()
        try:
            yield PushSource("container", export, plan.estimate_bytes, plan.estimate_bytes,
                             container=plan.container.name,
                             follow=(lambda: follow([partial_path(export), export], job.done,
                                                    head=_manifest_member(plan)))
                             if stream else None,
                             finish=job.result,
                             userdata=plan.container.userdata if stream else None,
                             writer_done=job.done)
        except BaseException:
            # The dump goes on to its end whatever the upload did: what is left
            # of the container decides what to say.
            futures_wait([job])
            job.result()  # a failed checkpoint is the cause: its words
            stopped = not leave_running
            raise
        job.result()
        stopped = not leave_running
    except (GpusnapError, KeyboardInterrupt) as exc:
        if not stopped:
            raise
        if aside is not None:  # the export alone must restore anywhere: pages into it
            _make_export_whole(exc, source, export, aside, container, ops_checkpoint.drop_local)
        raise kept_error(exc, source, f"in {export}", f"`gpusnap push {export} REF`",
                         f"`podman rm {source}; gpusnap restore {export}`") from None
    else:
        if aside is not None:
            ops_checkpoint.drop_local(container.userdata)
        discard(work, work.parent)  # the export (and the pages): as large as the checkpoint
        if in_ram:
            discard(aside, aside.parent)
        work = None
    finally:
        pool.shutdown(wait=True)
        if work is not None and not stopped:
            if aside is not None:
                _local_checkpoint_after_failure(container, aside, ops_checkpoint.drop_local)
            shutil.rmtree(work, ignore_errors=True)
            if in_ram:
                shutil.rmtree(aside, ignore_errors=True)


def _pages_folder(plan, work: Path, root: Path) -> tuple[Path | None, bool]:
    """Where CRIU's pages go for this push, and whether that is RAM: a folder on
    /dev/shm that CRIU writes into through links (the host can spare the pages
    and the GPU memory the driver moves into the process first:
    runtime/memory.py), else one beside Podman's storage they are moved into
    after the dump (a rename: the images' filesystem), else none (the export
    holds them)."""
    ram = memory.ram_dir(plan.estimate_bytes, held_too=plan.gpu_bytes)
    if ram is not None:
        return Path(tempfile.mkdtemp(prefix=PUSH_PREFIX, dir=ram)), True
    if _same_fs(root, plan.container.userdata):
        (work / "pages").mkdir(mode=0o700)
        return work / "pages", False
    return None, False


def _when_checkpointed(callback: Callable[[dict], None], plan, export: Path,
                       aside: Path | None) -> Callable[[Future], None]:
    """The checkpoint job's done-callback: ``callback`` with what is on local
    storage now (the container stopped or resumed, its GPU released)."""
    def done(job: Future) -> None:
        if job.cancelled() or job.exception() is not None:
            return
        staged = export.stat().st_size if export.exists() else 0
        if aside is not None:
            staged += sum(p.stat().st_size for p in aside.iterdir() if p.is_file())
        callback({"export": str(export), "container": plan.container.name,
                  "init_pid": plan.container.pid, "seconds": job.result().get("seconds"),
                  "bytes": staged})
    return done


def _make_export_whole(exc: BaseException, source: str, export: Path, aside: Path,
                       container: podman.Container, drop_local: Callable[[Path], None]) -> None:
    """The pages into the kept export, then the local checkpoint and the pages
    folder go (one copy on disk). Where the export cannot take them (disk
    full), the local checkpoint stays whole and is what the error offers."""
    try:
        pages_aside.materialize(export)
    except (OSError, tarfile.TarError) as werr:
        pages = f"{aside} (RAM: a reboot loses it)" if memory.in_ram(aside) else str(aside)
        raise GpusnapError(f"{_cause(exc)}; {source} is checkpointed and stopped; its export could not "
                           f"take its memory pages ({getattr(werr, 'strerror', None) or werr}), "
                           "so its checkpoint is kept "
                           f"locally, in {container.checkpoint_dir} and {pages}",
                           f"`gpusnap restore {source}` brings it back here") from None
    drop_local(container.userdata)
    shutil.rmtree(aside, ignore_errors=True)


def _work_root(container: podman.Container) -> Path:
    """Beside Podman's storage, where the pages can be moved by a rename (the
    export holds little else); elsewhere only if there is no such folder."""
    root = container.graph_root.parent if container.graph_root else None
    return root if root is not None and root.is_dir() else staging_dir(0, container.graph_root)


def _same_fs(a: Path, b: Path) -> bool:
    try:
        return a.stat().st_dev == b.stat().st_dev
    except OSError:
        return False


def _local_checkpoint_after_failure(container: podman.Container, aside: Path,
                                    drop_local: Callable[[Path], None]) -> None:
    """A push that failed and stopped nothing: a container that runs on has a
    stale dump (dropped); one the failed dump stopped keeps its local
    checkpoint, whose pages go back where CRIU wrote them."""
    if podman.exists(container.id) and podman.inspect(container.id).running:
        pages_aside.drop_links(container.checkpoint_dir, aside)
        if any(aside.iterdir()):
            drop_local(container.userdata)
    elif any(aside.iterdir()):
        # A copy where the pages are in RAM: the checkpoint must outlive the folder.
        pages_aside.bring_back(container.checkpoint_dir, copy=True)


def _cause(exc: BaseException) -> str:
    """What stopped a push, in the words of its error (Ctrl-C: "interrupted")."""
    return "interrupted" if isinstance(exc, KeyboardInterrupt) else getattr(exc, "message",
                                                                            str(exc))


def kept_error(exc: BaseException, container: str, kept: str, again: str,
               back: str) -> GpusnapError:
    """A push that failed after its checkpoint stopped ``container``: what
    failed, where the checkpoint is kept, and the two ways on (engine's words)."""
    return GpusnapError(f"{_cause(exc)}; {container} is checkpointed and stopped, its checkpoint is "
                        f"kept {kept}",
                        f"{again} tries again (chunks already sent are skipped); {back} brings "
                        "it back here",
                        exit_code=130 if isinstance(exc, KeyboardInterrupt) else 1)


def _manifest_member(plan) -> Callable[[], bytes]:
    """The GPU manifest as the archive's first member, as `gpusnap checkpoint
    --export` writes it (restore checks read it without the memory pages).
    The CRIU action script wrote it during the dump, before Podman's export."""
    path = plan.container.checkpoint_dir / MANIFEST_NAME

    def member() -> bytes:
        try:
            return tar_member(MANIFEST_NAME, path.read_bytes())
        except FileNotFoundError:
            return b""  # no CUDA process: no manifest
    return member


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

    def __init__(self, uploader: Uploader, make_pool: Callable[[], segments.SegmentPool] | None
                 ) -> None:
        self.uploader, self._make_pool = uploader, make_pool
        self.pool: segments.SegmentPool | None = None
        self.split_bytes = 0  # of the files the workers chunked
        self.early: early_pages.EarlyPages | None = None

    def _pool(self) -> segments.SegmentPool:
        if self.pool is None:
            self.pool = self._make_pool()
        return self.pool

    def watch(self, images: Path, scale: int, done: Callable[[], bool]) -> None:
        """Segments of CRIU's page images go to the workers while CRIU writes them."""
        if self._make_pool is not None:
            self.early = early_pages.EarlyPages(
                images, lambda *a: self._counted(self._pool().submit(*a)),
                lambda size: chunk_params(size, scale), _FINAL_PARAMS_FROM, done)

    def split_file(self, path: Path, size: int, params: chunker.ChunkParams
                   ) -> list[Future] | None:
        """Futures of the file's segments (worker processes), or None: not worth it."""
        if self._make_pool is None or not segments.worth_it(size, params):
            return None
        futures, start = self.early.take(path, size, params) if self.early else ([], 0)
        futures += [self._counted(f) for f in self._pool().submit_file(path, size, params, start)]
        self.split_bytes += size
        return futures

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
            except BrokenProcessPool:
                raise GpusnapError("a push worker process died (out of memory?)",
                                   "push again: chunks already sent are skipped") from None
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
        parts.watch(src.userdata / "checkpoint", scale, src.writer_done)
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


FORMATS = ("gpusnap", "podman")


def push(source: str, ref_text: str, opts: RegistryOptions, *, leave_running: bool = False,
         level: int = ZSTD_LEVEL, workers: int = WORKERS, cache_root: Path | None = None,
         progress: Progress | None = None, total: Callable[[int], None] | None = None,
         on_checkpoint: Callable[[str], None] | None = None,
         image_format: str = "gpusnap", trust: TrustOptions | None = None,
         containerd_address: str | None = None, processes: int | None = None,
         pre_checkpoint: bool = False,
         on_checkpointed: Callable[[dict], None] | None = None) -> dict:
    """``processes``: worker processes for big files (segments.py); default
    segments.default_workers(). ``pre_checkpoint``: the first round of a
    pre-copy migration (the container keeps running; annotated so that a
    restore does not take it for the final round). ``on_checkpointed``: a
    container SOURCE's checkpoint is complete on local storage (stopped or
    resumed, GPU released), the upload goes on: {export, container,
    init_pid, seconds, bytes (staged)}; called from the checkpoint's thread."""
    leave_running = leave_running or pre_checkpoint
    from gpusnap.trust.remote import PushTrust  # cryptography: imported only when pushing

    ref = reference.parse(ref_text)
    if ref.digest:
        raise GpusnapError(f"{ref_text}: push to a tag, not a digest",
                           "the digest is known only once the checkpoint is pushed")
    if image_format not in FORMATS:
        raise GpusnapError(f"unknown format {image_format!r}", f"pass one of {', '.join(FORMATS)}")
    if image_format == "podman" and source.startswith("containerd://"):
        raise GpusnapError("--format podman makes images Podman restores, not containerd",
                           "push containerd checkpoints in gpusnap's format (the default)")
    # keys first: a wrong key or passphrase fails before a container is checkpointed
    sealing = PushTrust.load(trust, chunked=image_format == "gpusnap")
    container = find_container(source)  # a mistyped name is not reported as the registry's fault
    client = RegistryClient(ref, opts, push=True)
    client.ping()  # wrong credentials fail before a container is checkpointed
    start = time.monotonic()
    processes = segments.default_workers() if processes is None else processes
    cache = ChunkCache.open(cache_root)
    with resolve_source(source, leave_running, on_checkpoint,
                        stream=image_format == "gpusnap",
                        containerd_address=containerd_address, container=container,
                        on_checkpointed=on_checkpointed) as src:
        if total and src.known_bytes:
            total(src.known_bytes)
        if image_format == "podman":
            return _push_podman(src, client, source, level, progress, start, sealing)
        scale = layer_scale(src.estimated_bytes)
        uploader = Uploader(client, cache, level, workers, progress, cipher=sealing.cipher)
        make_pool = None if sealing.cipher or processes < 2 else (
            lambda: segments.SegmentPool(str(ref), opts, cache.root if cache else None, level,
                                         processes))
        parts = _Parts(uploader, make_pool)
        try:
            files, contents, prefetched = _upload_files(src, parts, scale, str(ref))
            src.finish()
            if not (contents.is_podman_checkpoint or contents.is_containerd_checkpoint):
                raise GpusnapError(f"{source} is not a Podman checkpoint (no spec.dump, "
                                   "config.dump and checkpoint/ inside)",
                                   "pass an export of `podman container checkpoint --export`, "
                                   "its extracted directory or a container")
            gpu = contents.json_file(MANIFEST_NAME) or contents.json_file(f"checkpoint/{MANIFEST_NAME}")
            b = fmt.Bundle(files=files, summary=contents.summary(), gpu_manifest=gpu,
                           chunking={"algorithm": chunker.ALGORITHM, "scale": scale,
                                     "avg": "clamp(file size / 256, 256 KiB, 4 MiB) * scale",
                                     "min": "avg / 4", "max": "avg * 4"},
                           compression={"algorithm": "zstd", "level": level})
            config = sealing.seal_config(b.to_json())
            config_digest = uploader.put_small(config)
        finally:
            parts.close()
            uploader.close()
        criu = None
        if src.kind in ("container", "containerd-container"):  # checkpointed here, by this CRIU
            from gpusnap.criu.version import criu_version
            criu = criu_version()
        notes = fmt.annotations(b, criu, platform.machine())
        if pre_checkpoint:
            notes[fmt.PRE_CHECKPOINT] = "true"
        image = (b.summary.get("container") or {}).get("image")
        if b.summary.get("engine") == "containerd":
            image = None  # Podman's repo digests (the subject) do not describe containerd's images
        manifest = sealing.finish_manifest(
            fmt.build_manifest(b, config_digest, len(config), notes, _subject(client, image)))
        digest = client.put_manifest(manifest, fmt.OCI_MANIFEST, ref.target)
        signed_by = sealing.sign(client, digest, len(manifest))
    if cache:
        cache.prune()
    seconds = time.monotonic() - start
    stats = uploader.stats
    return {"reference": str(ref), "digest": digest, "pinned": str(ref.with_digest(digest)),
            "source": source, "source_kind": src.kind, "container": src.container,
            "files": len(b.files), "bytes": b.total_bytes,
            "chunks": stats.chunks, "layers": len(b.unique_blobs()),
            "chunks_sent": stats.chunks_transferred, "bytes_sent": stats.network_bytes,
            "bytes_stored": sum(b.unique_blobs().values()),
            "prefetched_bytes": prefetched,
            "parallel_bytes": parts.split_bytes, "processes": parts.pool.workers if parts.pool else 0,
            "early_bytes": parts.early.early_bytes if parts.early else 0,
            "seconds": round(seconds, 3),
            "throughput_mb_s": round(b.total_bytes / seconds / 1e6, 1) if seconds else None,
            "gpu": b.summary.get("gpu") is not None, "annotations": notes,
            "pre_checkpoint": pre_checkpoint,
            "trust": sealing.facts(signed_by)}


def _push_podman(src: PushSource, client: RegistryClient, source: str, level: int,
                 progress: Progress | None, start: float, sealing: PushTrust) -> dict:
    """One layer, Podman's annotations: `podman container restore REF` takes it;
    encrypted to ``sealing.recipients`` as ocicrypt encrypts layers."""
    from gpusnap.ops import push_podman

    criu = None
    if src.kind == "container":  # checkpointed here, by this CRIU
        from gpusnap.criu.version import criu_version
        criu = criu_version()
    with _entries(src) as entries:
        pushed = push_podman.push_image(entries, client, str(client.ref), level, criu, progress,
                                        sealing.layer_encryptor(), sealing.recipients)
    signed_by = sealing.sign(client, pushed["digest"], pushed["manifest_bytes"])
    seconds = time.monotonic() - start
    ref = client.ref
    pull = f"podman pull --decryption-key KEY {ref}" if sealing.encrypts else f"podman pull {ref}"
    return {"reference": str(ref), "digest": pushed["digest"], "format": "podman",
            "pinned": str(ref.with_digest(pushed["digest"])), "source": source,
            "source_kind": src.kind, "container": src.container, "files": pushed["files"],
            "bytes": pushed["bytes"], "bytes_sent": pushed["layer_bytes"], "layers": 1,
            "seconds": round(seconds, 3),
            "throughput_mb_s": round(pushed["bytes"] / seconds / 1e6, 1) if seconds else None,
            "annotations": pushed["annotations"], "trust": sealing.facts(signed_by),
            "restore_command": f"{pull} && podman container restore {ref}"}
