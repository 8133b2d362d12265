"""A local store of pulled chunk blobs, and of which blob a raw chunk became.

Pulls read from it before the network, so a repeated or interrupted pull
fetches only what it lacks; pushes look up a raw chunk's blob digest there and
skip compressing chunks the registry already has. Every blob read back is
checked against its digest (a damaged entry is dropped, never used). Files
appear by rename, so a killed process leaves no half-written entry.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
import time
from pathlib import Path

from gpusnap.private import open_private, private_dir, restrict

DEFAULT_ROOT = Path("/var/cache/gpusnap/chunks")
DEFAULT_MAX_BYTES = 16 << 30


class ChunkCache:
    def __init__(self, root: Path = DEFAULT_ROOT, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.root = root
        self.max_bytes = max_bytes
        self._seq = 0
        self._lock = threading.Lock()
        for sub in ("", "blobs", "index", "tmp"):  # chunks are process memory: root only
            private_dir(root / sub)

    @classmethod
    def open(cls, root: Path | None = None) -> "ChunkCache | None":
        """The cache (GPUSNAP_CACHE_DIR, else /var/cache/gpusnap/chunks; at most
        GPUSNAP_CACHE_MAX_BYTES, else 16 GiB), or None where it cannot be created
        (not root): transfers then go to the registry for everything."""
        root = root or Path(os.environ.get("GPUSNAP_CACHE_DIR") or DEFAULT_ROOT)
        try:
            max_bytes = int(os.environ.get("GPUSNAP_CACHE_MAX_BYTES") or DEFAULT_MAX_BYTES)
            return cls(root, max_bytes)
        except (OSError, ValueError):
            return None

    def _path(self, kind: str, digest: str) -> Path:
        algo, _, hexd = digest.partition(":")
        return self.root / kind / algo / hexd[:2] / hexd

    def _store(self, path: Path, data: bytes | bytearray) -> None:
        with self._lock:
            self._seq += 1
            tmp = self.root / "tmp" / f"{os.getpid()}-{threading.get_ident()}-{self._seq}"
        try:
            private_dir(path.parent)
            with open_private(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except OSError:  # a full disk must not fail the transfer: the cache is optional
            tmp.unlink(missing_ok=True)

    def get_blob(self, digest: str) -> bytes | None:
        path = self._path("blobs", digest)
        try:
            data = path.read_bytes()
        except OSError:
            return None
        algo, _, hexd = digest.partition(":")
        if hashlib.new(algo, data).hexdigest() != hexd:
            path.unlink(missing_ok=True)
            return None
        os.utime(path)  # recently used: pruned last
        return data

    def has_blob(self, digest: str) -> bool:
        """An entry is there (not read: get_blob checks it when it is used)."""
        return self._path("blobs", digest).is_file()

    def put_blob(self, digest: str, data: bytes | bytearray) -> None:
        self._store(self._path("blobs", digest), data)

    def blob_for(self, raw_digest: str) -> tuple[str, int] | None:
        """(blob digest, blob size) a raw chunk was compressed to before."""
        try:
            blob, size = self._path("index", raw_digest).read_text().split()
            return blob, int(size)
        except (OSError, ValueError):
            return None

    def remember(self, raw_digest: str, blob: str, blob_size: int) -> None:
        self._store(self._path("index", raw_digest), f"{blob} {blob_size}\n".encode())

    def prune(self, keep: frozenset[str] = frozenset()) -> int:
        """Drop the least recently used blobs beyond max_bytes, never those in
        ``keep`` (a prefetched checkpoint's); returns bytes freed."""
        kept = {self._path("blobs", d) for d in keep}
        entries = []
        for dirpath, _, names in os.walk(self.root / "blobs"):
            with contextlib.suppress(OSError):
                restrict(dirpath)  # folders of a version that made them 0755
            for name in names:
                p = Path(dirpath) / name
                try:
                    st = p.stat()
                    if st.st_mode & 0o077:  # written by a version that made files 0644
                        restrict(p)
                except OSError:
                    continue
                entries.append((st.st_mtime, st.st_size, p))
        total = sum(e[1] for e in entries)
        freed = 0
        for _, size, p in sorted(entries):
            if total - freed <= self.max_bytes:
                break
            if p in kept:
                continue
            p.unlink(missing_ok=True)
            freed += size
        for p in (self.root / "tmp").iterdir():  # left by killed processes
            try:
                if p.stat().st_mtime < time.time() - 3600:
                    p.unlink()
            except OSError:
                pass
        return freed
