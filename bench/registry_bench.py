"""Registry transfer figures for a ~1 GiB checkpoint directory (run as root after `make install`).

    /opt/gpusnap/venv/bin/python bench/registry_bench.py [--mib 1024]

A demo container fills its /dev/shm (3/4 random, 1/4 zeros: incompressible
memory plus untouched pages), is checkpointed and its export extracted into a
directory. Then, against a loopback docker-registry (TLS, htpasswd):
chunking alone, first push, re-push (everything already there), pull without
and with the chunk cache. Prints one line per step, MB/s of checkpoint bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpusnap.oci import chunker  # noqa: E402
from gpusnap.ops.push import chunk_params  # noqa: E402
from tests.integration.oci_registry import PASSWORD, make_registry  # noqa: E402

IMAGE = "localhost/gpusnap-demo:latest"


def sh(*cmd: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, check=True, **kw)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def gpusnap(*args: str, registry_pid: int) -> dict:
    """Run it; add the CPU seconds it and the registry spent (both share this host's cores)."""
    before_reg = cpu_seconds(registry_pid)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    res = subprocess.run(["gpusnap", *args, "--json"], input=PASSWORD + "\n",
                         capture_output=True, text=True)
    if res.returncode != 0:
        raise SystemExit(f"gpusnap {' '.join(args)} failed: {res.stdout}{res.stderr}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = json.loads(res.stdout)
    out["cpu"] = (f"CPU: gpusnap {after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime:.1f} s, "
                  f"registry {cpu_seconds(registry_pid) - before_reg:.1f} s")
    return out


def chunk_only(root: Path) -> tuple[float, int, int]:
    total = chunks = 0
    start = time.monotonic()
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        size = path.stat().st_size
        with open(path, "rb") as f:
            for c in chunker.split(f, chunk_params(size, 1), size):
                total += len(c)
                chunks += 1
    return time.monotonic() - start, total, chunks


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=1024)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="gpusnap-regbench-", dir="/var/tmp"))
    name = f"gpusnap-regbench-{uuid.uuid4().hex[:6]}"
    reg = make_registry(work / "registry")
    flags = ["--ca-file", str(reg.ca), "--username", "gpusnap", "--password-stdin"]
    os.environ["GPUSNAP_CACHE_DIR"] = str(work / "cache")
    try:
        rnd, zero = args.mib * 3 // 4, args.mib // 4
        fill = (f"dd if=/dev/urandom of=/dev/shm/r bs=1M count={rnd} 2>/dev/null; "
                f"dd if=/dev/zero of=/dev/shm/z bs=1M count={zero} 2>/dev/null; "
                "touch /dev/shm/done; while true; do sleep 1; done")
        sh("podman", "run", "-d", "--name", name, "--network", "none",
           "--shm-size", f"{args.mib + 64}m", IMAGE, "sh", "-c", fill)
        while subprocess.run(["podman", "exec", name, "ls", "/dev/shm/done"],
                             capture_output=True).returncode != 0:
            time.sleep(0.5)
        archive = work / "ckpt.tar.zst"
        sh("gpusnap", "checkpoint", name, "--export", str(archive), "--leave-running")
        directory = work / "dir"
        directory.mkdir()
        sh("tar", "-I", "zstd", "-xf", str(archive), "-C", str(directory))
        size = sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())
        print(f"checkpoint directory: {size / 2**20:.0f} MiB, {os.cpu_count()} cores")

        def line(what: str, seconds: float, extra: str = "") -> None:
            print(f"  {what:<34} {seconds:7.2f} s  {size / seconds / 1e6:7.0f} MB/s  {extra}")

        secs, _, n = chunk_only(directory)
        line("chunking only (page cache)", secs, f"{n} chunks")
        ref = reg.ref(f"bench/ckpt:{uuid.uuid4().hex[:6]}")

        def gpusnap_(*a: str) -> dict:
            return gpusnap(*a, registry_pid=reg.proc.pid)

        first = gpusnap_("push", str(directory), ref, *flags)
        line("push, empty registry", first["seconds"],
             f"sent {first['bytes_sent'] / 2**20:.0f} MiB in {first['chunks_sent']} chunks; "
             + first["cpu"])
        again = gpusnap_("push", str(directory), ref + "-again", *flags)
        line("re-push, nothing changed", again["seconds"],
             f"sent {again['bytes_sent'] / 2**20:.2f} MiB; " + again["cpu"])
        out = work / "pulled.tar"
        cold = gpusnap_("pull", ref, "-o", str(out), "--no-cache", *flags)
        line("pull to .tar, no cache", cold["seconds"],
             f"fetched {cold['bytes_fetched'] / 2**20:.0f} MiB; " + cold["cpu"])
        gpusnap_("pull", ref, "-o", str(out), *flags)  # fills the cache
        warm = gpusnap_("pull", ref, "-o", str(out), *flags)
        line("pull to .tar, all from cache", warm["seconds"],
             f"fetched {warm['bytes_fetched'] / 2**20:.0f} MiB; " + warm["cpu"])
        zst = gpusnap_("pull", ref, "-o", str(work / "pulled.tar.zst"), "--no-cache", *flags)
        line("pull to .tar.zst, no cache", zst["seconds"], zst["cpu"])
    finally:
        subprocess.run(["podman", "rm", "-f", "-t", "0", name], capture_output=True)
        reg.stop()
        subprocess.run(["rm", "-rf", str(work)])


if __name__ == "__main__":
    main()
