"""How fast can each stage of a push go on this host, alone and together?

    /opt/gpusnap/venv/bin/python bench/ingest.py [--gib 4] [--workdir /dev/shm] [--out F]

A fake Podman checkpoint directory (config.dump, spec.dump, one large
checkpoint/pages-1.img) is written under --workdir: bf16 values drawn from a
normal distribution (std 0.02), the bit statistics of model weights, not
uniform noise. Then, each timed on its own:

  split      gpusnap's content-defined chunker over the file, one thread
  sha256     hashlib over the chunks, one thread
  zstd-1/3   one chunk at a time, one thread
  put xN     the already-compressed chunks uploaded as blobs by N threads
             (gpusnap's RegistryClient: POST + PUT per blob), N = 1, 4, 8, 16:
             the registry's ingest ceiling, and its CPU seconds
  push       `gpusnap push DIR REF` of the whole directory (all stages at once)
  pull       `gpusnap pull --prefetch REF` of it into an empty chunk cache, with
             gpusnap's CPU seconds beside the registry's
  oras       `oras push` of the pages file as one blob

into a docker-registry on loopback whose storage is under --workdir (the first
`docker-registry` on PATH: put another build's folder first to compare). Each line
prints MB/s of raw (uncompressed) bytes; registry CPU is read from /proc.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpusnap.oci import chunker, reference  # noqa: E402
from gpusnap.oci.registry import RegistryClient, RegistryOptions  # noqa: E402
from gpusnap.ops.push import chunk_params  # noqa: E402
from tests.faults.netreg import make_registry  # noqa: E402
from tests.integration.oci_registry import permissive_policy  # noqa: E402

BLOCK = 64 << 20


def weights_like(n: int):
    """``n`` bytes of bf16 normals, 64 MiB at a time (torch on a GPU, else an imitation)."""
    try:
        import torch
        if torch.cuda.is_available():
            g = torch.Generator(device="cuda").manual_seed(1)
            done = 0
            while done < n:
                k = min(BLOCK, n - done)
                t = (torch.randn(k // 2, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
                yield t.view(torch.uint8).cpu().numpy().tobytes()
                done += k
            return
    except ImportError:
        pass
    # No GPU: the same statistics from os.urandom. A bf16 of N(0, 0.02) has a random
    # low byte; its high byte is the sign and the top of the exponent: 0x3c or 0x3b
    # (|x| in [2^-7, 2^-1) or smaller), as often as a normal draw makes them.
    high = bytes((0x3C if b % 128 < 104 else 0x3B) | (b & 0x80) for b in range(256))
    done = 0
    while done < n:
        k = min(BLOCK, n - done)
        out = bytearray(k)
        out[0::2] = os.urandom(k // 2)
        out[1::2] = os.urandom(k // 2).translate(high)
        yield bytes(out)
        done += k


def make_checkpoint(root: Path, size: int) -> Path:
    (root / "checkpoint").mkdir(parents=True)
    (root / "config.dump").write_text(json.dumps({"name": "ingest-bench", "id": "0" * 64}))
    (root / "spec.dump").write_text(json.dumps({"ociVersion": "1.0.2"}))
    (root / "checkpoint" / "inventory.img").write_bytes(b"\0" * 64)
    pages = root / "checkpoint" / "pages-1.img"
    with open(pages, "wb") as f:
        for block in weights_like(size):
            f.write(block)
    return pages


def rate(n: int, seconds: float) -> str:
    return f"{n / seconds / 1e6:8.1f} MB/s ({seconds:.2f} s)"


def pull(reg, env: dict, size: int, results: dict) -> None:
    """`gpusnap pull --prefetch` of what the push stored, into an empty chunk cache:
    the download, digest checks and decompression of a restore from a registry,
    and what they and the registry cost in CPU."""
    cpu0, kids0 = reg.cpu_seconds(), resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.monotonic()
    res = subprocess.run(["/usr/local/bin/gpusnap", "pull", "--prefetch", reg.ref("bench/push:v1"),
                          "--plain-http", "--json"], capture_output=True, text=True, env=env)
    s = time.monotonic() - t
    if res.returncode:
        print(f"pull failed: {res.stdout[-500:]}{res.stderr[-1500:]}")
        return
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    own = kids.ru_utime + kids.ru_stime - kids0.ru_utime - kids0.ru_stime
    results["pull"] = size / s
    results["pull-registry-cpu-s"] = reg.cpu_seconds() - cpu0
    results["pull-gpusnap-cpu-s"] = own
    print(f"gpusnap pull: {rate(size, s)}, registry CPU {reg.cpu_seconds() - cpu0:.1f} s, "
          f"gpusnap CPU {own:.1f} s", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=4)
    ap.add_argument("--workdir", default="/dev/shm")
    ap.add_argument("--out", default="bench-ingest.json")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="gpusnap-ingest-", dir=args.workdir))
    results: dict = {"cores": os.cpu_count(), "gib": args.gib, "workdir": args.workdir}
    reg = None
    try:
        size = int(args.gib * (1 << 30))
        t = time.monotonic()
        pages = make_checkpoint(work / "ckpt", size)
        print(f"data: {size / 1e9:.2f} GB bf16 normals in {time.monotonic() - t:.1f} s, "
              f"{os.cpu_count()} cores", flush=True)
        params = chunk_params(size, 1)

        t = time.monotonic()
        with open(pages, "rb") as f:
            chunks = list(chunker.split(f, params, size))
        results["split"] = size / (time.monotonic() - t)
        print(f"split ({len(chunks)} chunks, avg {size // len(chunks) >> 10} KiB): "
              f"{rate(size, time.monotonic() - t)}", flush=True)

        t = time.monotonic()
        for c in chunks:
            hashlib.sha256(c).digest()
        results["sha256"] = size / (time.monotonic() - t)
        print(f"sha256: {rate(size, time.monotonic() - t)}", flush=True)

        import zstandard
        blobs = []
        for level in (1, 3):
            z = zstandard.ZstdCompressor(level=level)
            t = time.monotonic()
            out = [z.compress(c) for c in chunks]
            s = time.monotonic() - t
            results[f"zstd-{level}"] = size / s
            results[f"zstd-{level}-ratio"] = sum(map(len, out)) / size
            print(f"zstd-{level}: {rate(size, s)}, compressed to "
                  f"{sum(map(len, out)) / size:.3f}", flush=True)
            blobs = out
        del chunks

        reg = make_registry(work / "registry")
        os.environ["GPUSNAP_POLICY"] = str(permissive_policy(work))
        opts = RegistryOptions(plain_http=True)
        for n in (1, 4, 8, 16):
            client = RegistryClient(reference.parse(reg.ref(f"bench/put{n}:v1")), opts, push=True)
            salt = f"{n}".encode()  # new blobs for every round: nothing deduplicated
            bodies = [b + salt for b in blobs]
            cpu0 = reg.cpu_seconds()
            t = time.monotonic()
            with ThreadPoolExecutor(n) as pool:
                list(pool.map(lambda b: client.put_blob(
                    "sha256:" + hashlib.sha256(b).hexdigest(), b), bodies))
            s = time.monotonic() - t
            results[f"put{n}"] = size / s
            results[f"put{n}-registry-cpu-s"] = reg.cpu_seconds() - cpu0
            print(f"put x{n:<2}: {rate(size, s)}, registry CPU "
                  f"{reg.cpu_seconds() - cpu0:.1f} s", flush=True)
            del bodies
        del blobs

        env = {**os.environ, "GPUSNAP_CACHE_DIR": str(work / "cache")}
        cpu0 = reg.cpu_seconds()
        t = time.monotonic()
        res = subprocess.run(["/usr/local/bin/gpusnap", "push", str(work / "ckpt"),
                              reg.ref("bench/push:v1"), "--plain-http", "--json"],
                             capture_output=True, text=True, env=env)
        s = time.monotonic() - t
        if res.returncode:
            print(f"push failed: {res.stdout[-500:]}{res.stderr[-1500:]}")
        else:
            results["push"] = size / s
            results["push-registry-cpu-s"] = reg.cpu_seconds() - cpu0
            print(f"gpusnap push: {rate(size, s)}, registry CPU {reg.cpu_seconds() - cpu0:.1f} s",
                  flush=True)
            shutil.rmtree(work / "cache", ignore_errors=True)
            pull(reg, env, size, results)
        shutil.rmtree(work / "cache", ignore_errors=True)

        if shutil.which("oras"):
            cpu0 = reg.cpu_seconds()
            t = time.monotonic()
            subprocess.run(["oras", "push", "--plain-http", reg.ref("bench/oras:v1"),
                            "pages-1.img:application/octet-stream"], cwd=pages.parent,
                           capture_output=True, check=True)
            s = time.monotonic() - t
            results["oras"] = size / s
            results["oras-registry-cpu-s"] = reg.cpu_seconds() - cpu0
            print(f"oras push: {rate(size, s)}, registry CPU {reg.cpu_seconds() - cpu0:.1f} s",
                  flush=True)
    finally:
        if reg:
            reg.stop()
        shutil.rmtree(work, ignore_errors=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
