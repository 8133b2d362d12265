"""What encryption costs a push and a pull, per chunk, on one core:
`python -m gpusnap.trust.bench [MiB] [chunk MiB]` (default 64 MiB in 4 MiB chunks).

Push per chunk is sha256(raw), zstd -3, then sha256 of the blob (what
transfer.Uploader does); encrypted, the zstd frame is sealed first. Pull is
the reverse. Both are timed on the same memory-like data in the same run.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time

import zstandard

from gpusnap.trust.encrypt import ChunkCipher


def memory_like(size: int) -> bytes:
    """Pages: 1/2 random (weights), 1/4 zero, 1/4 repetitive text."""
    page, out = 4096, bytearray()
    text = b"tensor kv-cache block " * 200
    for i in range(size // page):
        kind = i % 4
        out += os.urandom(page) if kind < 2 else bytes(page) if kind == 2 else text[:page]
    return bytes(out)


def run(total_mib: int = 64, chunk_mib: int = 4) -> dict:
    data = memory_like(total_mib << 20)
    step = chunk_mib << 20
    chunks = [data[i:i + step] for i in range(0, len(data), step)]
    cctx, dctx = zstandard.ZstdCompressor(level=3), zstandard.ZstdDecompressor()
    cipher = ChunkCipher(os.urandom(32))
    res: dict = {"bytes": len(data), "chunk_bytes": step, "chunks": len(chunks)}

    def timed(name, fn):
        best = None
        for _ in range(2):  # best of 2: the machine is shared
            t = time.perf_counter()
            out = fn()
            dt = time.perf_counter() - t
            best = dt if best is None else min(best, dt)
        res[name + "_mb_s"] = round(len(data) / best / 1e6, 1)
        return out

    def push(seal: bool):
        blobs = []
        for c in chunks:
            raw = "sha256:" + hashlib.sha256(c).hexdigest()
            blob = cctx.compress(c)
            if seal:
                blob = cipher.seal_chunk(raw, blob)
            hashlib.sha256(blob).hexdigest()
            blobs.append((raw, blob))
        return blobs

    def pull(blobs, sealed: bool):
        for raw, blob in blobs:
            hashlib.sha256(blob).hexdigest()
            frame = cipher.open_chunk(raw, blob, "bench") if sealed else blob
            assert "sha256:" + hashlib.sha256(dctx.decompress(frame)).hexdigest() == raw

    plain = timed("push_plain", lambda: push(False))
    sealed = timed("push_encrypted", lambda: push(True))
    timed("pull_plain", lambda: pull(plain, False))
    timed("pull_encrypted", lambda: pull(sealed, True))
    frames = [(r, b) for r, b in plain]
    stored = sum(len(b) for _, b in frames)
    t = time.perf_counter()
    for r, b in frames:
        cipher.seal_chunk(r, b)
    res["seal_only_mb_s_of_stored"] = round(stored / (time.perf_counter() - t) / 1e6, 1)
    res["stored_bytes"] = stored
    res["overhead_bytes"] = sum(len(b) for _, b in sealed) - stored
    return res


if __name__ == "__main__":
    args = [int(a) for a in sys.argv[1:3]]
    print(json.dumps(run(*args), indent=2))
