"""How fast one push worker cuts and hashes a pages file: read by pread into a
buffer and copied per chunk (gpusnap before 2026-11-26 19:00) against mapped
(chunks are views into the page cache: oci/segments.py), then N processes.

    python bench/push_hash.py [--mib 512] [--processes 1,8,14]

Prints GB/s per way; the file is random data on /dev/shm.
"""

from __future__ import annotations

import argparse
import hashlib
import mmap
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpusnap.oci import chunker  # noqa: E402

PARAMS = chunker.ChunkParams()


class _Pread:
    def __init__(self, fd: int, size: int) -> None:
        self.fd, self.pos, self.end = fd, 0, size

    def readinto(self, buf) -> int:
        n = os.preadv(self.fd, [memoryview(buf)[:min(len(buf), self.end - self.pos)]], self.pos)
        self.pos += n
        return n


def copied(path: str) -> int:
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        return sum(len(hashlib.sha256(c).digest()) for c in
                   chunker.split(_Pread(fd, size), PARAMS, size))
    finally:
        os.close(fd)


def mapped(path: str) -> int:
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m, \
            memoryview(m) as view:
        n = 0
        for c in chunker.chunks_of(view, PARAMS):
            hashlib.sha256(c).digest()
            n += 1
            del c
        return n


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--processes", default="1,8,14")
    args = ap.parse_args()
    path = f"/dev/shm/push-hash-{os.getpid()}.img"
    size = args.mib << 20
    with open(path, "wb") as f:
        for _ in range(args.mib):
            f.write(os.urandom(1 << 20))
    try:
        for name, fn in (("copied", copied), ("mapped", mapped)):
            fn(path)  # warm: page cache, tables
            t = time.perf_counter()
            fn(path)
            print(f"{name:7s} 1 process  {size / (time.perf_counter() - t) / 1e9:6.2f} GB/s", flush=True)
        for n in (int(x) for x in args.processes.split(",") if int(x) > 1):
            with ProcessPoolExecutor(n) as pool:
                list(pool.map(mapped, [path] * n))
                t = time.perf_counter()
                list(pool.map(mapped, [path] * n))
                print(f"mapped  {n} processes {n * size / (time.perf_counter() - t) / 1e9:6.2f} GB/s",
                      flush=True)
    finally:
        os.unlink(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
