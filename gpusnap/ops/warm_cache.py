"""`gpusnap pull --prefetch REF`: a checkpoint's chunks into this host's cache.

The target of a pre-copy migration runs it on the pre-checkpoint round while
the container still runs on the source; the restore of the final round then
reads every chunk that did not change from the cache (transfer.Downloader
asks the cache first) and fetches only the rest. The blobs are stored as the
registry holds them (compressed; checked against their digest here and again
when a restore reads them). Entries appear by rename: a prefetch killed
halfway is resumed by running it again, and what it stored is not fetched twice.

Then the pages files themselves are written out from the cache, while the job
still runs on the source (pages/prepared_pages.py): the restore of the final
round patches them where they differ, a replica of REF links them.
"""

from __future__ import annotations

import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

from gpusnap.errors import GpusnapError
from gpusnap.oci import bundle as fmt
from gpusnap.oci import segments
from gpusnap.oci.cache import ChunkCache
from gpusnap.oci.malloc import one_heap_for_all_threads
from gpusnap.oci.registry import RegistryOptions
from gpusnap.oci.transfer import Progress
from gpusnap.pages import pages_aside
from gpusnap.pages import prepared_pages
from gpusnap.ops.pull import OnTrusted, fetch_small, open_remote
from gpusnap.trust.options import TrustOptions

# Blobs are fetched whole: I/O bound, and the digest check releases the GIL, so
# threads keep a loopback registry busy (docs/benchmarks.md). Each holds one blob
# (4-16 MiB): more threads, or a copy per blob, take the RSS past its 256 MiB bound.
WORKERS = 8


def _cache(cache_root: Path | None) -> ChunkCache:
    cache = ChunkCache.open(cache_root)
    if cache is None:
        root = cache_root or os.environ.get("GPUSNAP_CACHE_DIR") or "/var/cache/gpusnap/chunks"
        raise GpusnapError(f"cannot create the chunk cache {root}",
                           "prefetch as root, or point GPUSNAP_CACHE_DIR at a folder you can write")
    return cache


def prefetch(ref_text: str, opts: RegistryOptions, trust: TrustOptions | None = None,
             on_trusted: OnTrusted | None = None, cache_root: Path | None = None,
             workers: int = WORKERS, progress: Progress | None = None,
             total: Callable[[int], None] | None = None) -> dict:
    """Every chunk of REF that the cache lacks, fetched and stored there. The
    trust policy is checked first, as for a restore (nothing unsigned lands)."""
    cache = _cache(cache_root)
    remote = open_remote(ref_text, opts, trust, cache)  # keeps manifest and config there too
    if on_trusted:
        on_trusted(remote.trust)
    blobs = {c.blob: c.blob_size for f in remote.bundle.files for c in f.chunks}
    missing = {d: n for d, n in blobs.items() if not cache.has_blob(d)}
    stored, need = sum(blobs.values()), sum(missing.values())
    free = shutil.disk_usage(cache.root).free
    if need > free:
        raise GpusnapError(f"the chunk cache {cache.root} has {free >> 20} MiB free, "
                           f"{remote.client.ref} needs {need >> 20} MiB more",
                           "free space there, or point GPUSNAP_CACHE_DIR at a larger "
                           "filesystem; nothing was fetched")
    if total:
        total(stored)
    if progress:  # what is there already counts as done
        progress(stored - need, 0)
    one_heap_for_all_threads()  # an arena per thread would keep each one's freed blobs
    start = time.monotonic()

    def one(digest: str, size: int) -> None:
        blob = remote.client.get_blob(digest, size)  # checked against its digest (and size)
        cache.put_blob(digest, blob)  # sealed blobs stay sealed, as a pull caches them
        if progress:
            progress(len(blob), len(blob))

    with ThreadPoolExecutor(workers, thread_name_prefix="gpusnap-prefetch") as pool:
        futures = [pool.submit(one, d, n) for d, n in missing.items()]
        try:
            for f in futures:
                f.result()
        except BaseException:
            for f in futures:
                f.cancel()
            raise
    lost = [d for d in missing if not cache.has_blob(d)]
    if lost:  # ChunkCache never fails a transfer on a write error: a prefetch must
        raise GpusnapError(f"{len(lost)} of {len(blobs)} chunks of {remote.client.ref} could not "
                           f"be stored in {cache.root} (disk full?)",
                           "free space there and prefetch again: what is stored is kept")
    cache.prune(keep=frozenset(blobs))
    fetched_in = time.monotonic() - start
    prepared = _prepare(remote, cache)
    seconds = time.monotonic() - start
    return {"reference": str(remote.client.ref), "digest": remote.digest,
            "cache": str(cache.root), "chunks": len(blobs), "chunks_fetched": len(missing),
            "bytes": remote.bundle.total_bytes, "bytes_stored": stored,
            "bytes_fetched": need, "bytes_already_cached": stored - need,
            "over_cache_limit": stored > cache.max_bytes, "cache_limit": cache.max_bytes,
            "seconds": round(seconds, 3),
            "throughput_mb_s": round(need / seconds / 1e6, 1) if seconds else None,
            "pre_checkpoint": fmt.is_pre_checkpoint(remote.manifest),
            "fetch_seconds": round(fetched_in, 3), "prepared": prepared,
            "trust": remote.trust}


def _prepare(remote, cache: ChunkCache) -> dict | None:
    """The pages files written out ahead where a restore would write them beside
    Podman's import (worker processes, pages set aside, nothing sealed)."""
    workers = segments.default_workers()
    if remote.cipher is not None or workers < 2 or not pages_aside.enabled() \
            or not prepared_pages.big_pages(remote.bundle):
        return None
    pool = segments.FetchPool(str(remote.client.ref), remote.client.opts, cache.root, workers,
                              lambda counts: None)
    try:
        ref = remote.client.ref
        # the pagemaps too: a later round's restore reads this folder as CRIU's parent
        maps = fetch_small(remote, prepared_pages.pagemaps(remote.bundle), cache)
        return prepared_pages.prepare(remote.bundle, remote.digest, pool,
                                      repository=f"{ref.registry}/{ref.repository}",
                                      pre_checkpoint=fmt.is_pre_checkpoint(remote.manifest),
                                      pagemaps=maps)
    finally:
        pool.close()
