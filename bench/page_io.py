"""CRIU's page I/O alone: dump and restore of a process holding N GiB, per place.

    python bench/page_io.py [--gib 16] [--rounds 2] [--places disk,shm,huge] [--thp 0,1]
                            [--out page_io.json]

After the driver's checkpoint a CUDA process is a CPU process whose host
memory holds its GPU memory, and CRIU moves every page of it through one
thread on each side (docs/benchmarks.md: ~1.8 GB/s into /dev/shm on the H100
host, 20 s of a 32 GiB stop, and ~3 GB/s back). This measures that step
without a GPU: a process fills GIB GiB of anonymous memory (a random MiB
repeated, no zero pages, which CRIU would skip), `criu dump` writes it into a
folder on each place, `criu restore --restore-detached` reads it back; wall
seconds of each and GB/s.

Places: disk (/var/tmp), shm (/dev/shm, the host's 4 KiB-page tmpfs), huge
(gpusnap's tmpfs with huge=always, pages/memory.py). --thp 1 madvises the
process's memory MADV_HUGEPAGE (whether the driver's buffer has huge pages is
the host's setting). Root, CRIU on PATH. Rounds run the places alternately.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpusnap.pages import memory  # noqa: E402

HOG = r"""
import mmap, os, sys, time
n = int(sys.argv[1]) << 30
m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
if sys.argv[2] == "1":
    m.madvise(mmap.MADV_HUGEPAGE)
block = os.urandom(1 << 20)
for off in range(0, n, 1 << 20):
    m[off:off + (1 << 20)] = block
print("ready", flush=True)
while True:
    time.sleep(1)
"""


def place_dir(place: str) -> Path:
    if place == "disk":
        return Path("/var/tmp")
    if place == "shm":
        return memory.RAM_ROOT
    if place == "huge":
        if not memory.mount_huge(memory.HUGE_ROOT):
            raise SystemExit("page_io: no huge-page tmpfs here (root? kernel with shmem THP?)")
        return memory.HUGE_ROOT
    raise SystemExit(f"page_io: unknown place {place!r} (disk, shm, huge)")


def smaps_kib(pid: int, key: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def one(gib: int, thp: int, place: str) -> dict:
    folder = Path(tempfile.mkdtemp(prefix="page-io-", dir=place_dir(place)))
    hog = subprocess.Popen([sys.executable, "-c", HOG, str(gib), str(thp)], stdout=subprocess.PIPE,
                           stdin=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           start_new_session=True, text=True)
    restored = None
    try:
        assert hog.stdout.readline().strip() == "ready"
        row = {"gib": gib, "thp": thp, "place": place,
               "source_anon_huge_mib": smaps_kib(hog.pid, "AnonHugePages") >> 10}
        t0 = time.monotonic()
        subprocess.run(["criu", "dump", "-t", str(hog.pid), "-D", str(folder), "--shell-job",
                        "-o", "dump.log"], check=True)
        row["dump_s"] = round(time.monotonic() - t0, 2)
        hog.wait()
        size = sum(p.stat().st_size for p in folder.glob("pages-*.img"))
        row["pages_gb"] = round(size / 1e9, 2)
        pidfile = folder / "restored.pid"
        t0 = time.monotonic()
        subprocess.run(["criu", "restore", "-D", str(folder), "--shell-job", "--restore-detached",
                        "--pidfile", str(pidfile), "-o", "restore.log"], check=True)
        row["restore_s"] = round(time.monotonic() - t0, 2)
        restored = int(pidfile.read_text())
        row["target_anon_huge_mib"] = smaps_kib(restored, "AnonHugePages") >> 10
        row["dump_gbps"] = round(size / 1e9 / row["dump_s"], 2)
        row["restore_gbps"] = round(size / 1e9 / row["restore_s"], 2)
        return row
    finally:
        for pid in (hog.pid, restored):
            if pid:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        hog.wait()
        shutil.rmtree(folder, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--places", default="disk,shm,huge")
    ap.add_argument("--thp", default="0")
    ap.add_argument("--out")
    args = ap.parse_args()
    rows = []
    for _ in range(args.rounds):
        for thp in map(int, args.thp.split(",")):
            for place in args.places.split(","):
                row = one(args.gib, thp, place)
                rows.append(row)
                print(json.dumps(row), flush=True)
    print(f"{'place':6} {'thp':>3} {'dump s':>7} {'GB/s':>5} {'restore s':>9} {'GB/s':>5}")
    for r in rows:
        print(f"{r['place']:6} {r['thp']:>3} {r['dump_s']:>7} {r['dump_gbps']:>5} "
              f"{r['restore_s']:>9} {r['restore_gbps']:>5}")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
