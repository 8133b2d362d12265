"""CPU checkpoint benchmark (`make bench`): gpusnap against plain Podman, same run.

A demo container holds GIB GiB in /dev/shm (half random, half a repeated
pattern, so compression has work to do) and counts in /tmp/c.

  plain    podman container checkpoint --export F; podman rm;
           podman container restore --import F
  gpusnap  gpusnap checkpoint CTR --export F; podman rm; gpusnap restore F

Each variant runs --rounds times, alternating; the median is reported. The
last line is `speedup X.XX` (plain total / gpusnap total).

    python bench/checkpoint_bench.py [--gib 1] [--rounds 2] [--out bench-cpu.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

IMAGE = "localhost/gpusnap-demo:latest"
GPUSNAP = "/usr/local/bin/gpusnap"


def sh(*args: str) -> str:
    res = subprocess.run(list(args), capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(args)}: {res.stderr.strip()[-500:]}")
    return res.stdout


def start(gib: float) -> str:
    name = f"gpusnap-bench-{uuid.uuid4().hex[:8]}"
    half = max(1, int(gib * 512))
    script = (f"dd if=/dev/urandom of=/dev/shm/r bs=1M count={half} 2>/dev/null; "
              f"yes gpusnap | head -c {half}m > /dev/shm/p; "  # busybox: m, not M
              "i=0; while true; do i=$((i+1)); echo $i > /tmp/c.new; mv /tmp/c.new /tmp/c; sleep 0.05; done")
    sh("podman", "run", "-d", "--name", name, "--network", "none",
       "--shm-size", f"{int(gib * 1024) + 64}m", IMAGE, "sh", "-c", script)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if subprocess.run(["podman", "exec", name, "cat", "/tmp/c"], capture_output=True).returncode == 0:
            return name
        time.sleep(0.2)
    raise RuntimeError("the benchmark container did not start")


def counter(name: str) -> int:
    return int(sh("podman", "exec", name, "cat", "/tmp/c").strip())


def one(variant: str, gib: float, workdir: Path) -> dict:
    name = start(gib)
    archive = workdir / f"{name}.tar.zst"
    try:
        before = counter(name)
        t0 = time.monotonic()
        if variant == "plain":
            sh("podman", "container", "checkpoint", "--export", str(archive), name)
        else:
            sh(GPUSNAP, "checkpoint", name, "--export", str(archive))
        checkpoint_s = time.monotonic() - t0
        sh("podman", "rm", name)
        t0 = time.monotonic()
        if variant == "plain":
            sh("podman", "container", "restore", "--import", str(archive))
        else:
            sh(GPUSNAP, "restore", str(archive))
        restore_s = time.monotonic() - t0
        if counter(name) < before:
            raise RuntimeError(f"{variant}: the counter went back: state was lost")
        return {"variant": variant, "gib": gib, "checkpoint_s": round(checkpoint_s, 3),
                "restore_s": round(restore_s, 3), "total_s": round(checkpoint_s + restore_s, 3),
                "archive_bytes": archive.stat().st_size}
    finally:
        subprocess.run(["podman", "rm", "-f", "-t", "0", name], capture_output=True)
        archive.unlink(missing_ok=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default="bench-cpu.json")
    ap.add_argument("--workdir", default="/var/tmp/gpusnap-bench")
    args = ap.parse_args()
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    rows = []
    for _ in range(args.rounds):
        for variant in ("plain", "gpusnap"):
            row = one(variant, args.gib, workdir)
            rows.append(row)
            print(json.dumps(row), flush=True)
    med = {v: {k: statistics.median(r[k] for r in rows if r["variant"] == v)
               for k in ("checkpoint_s", "restore_s", "total_s")} for v in ("plain", "gpusnap")}
    print(f"\n{'variant':<8} {'checkpoint s':>12} {'restore s':>10} {'total s':>8}   (median of {args.rounds})")
    for v, m in med.items():
        print(f"{v:<8} {m['checkpoint_s']:>12.2f} {m['restore_s']:>10.2f} {m['total_s']:>8.2f}")
    speedup = med["plain"]["total_s"] / med["gpusnap"]["total_s"]
    Path(args.out).write_text(json.dumps({"rows": rows, "median": med, "speedup": round(speedup, 2),
                                          "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
                                         indent=2))
    print(f"speedup {speedup:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
