"""Writing N GiB of pages into a stopped process: one thread (as CRIU does) or many.

    python bench/page_fill.py [--gib 16] [--threads 1,4,8,16] [--place huge|shm|disk]
                              [--thp 0] [--rounds 2] [--out page_fill.json]

CRIU restores a process's pages on one thread (~2 GB/s on the H200 hosts,
bench/page_io.py). gpusnap/pages/page_fill.py writes them with a pool of
threads through process_vm_writev. This measures both on the same file and
the same kind of target: a process that maps GIB GiB of anonymous memory and
touches none of it (as CRIU's premapped area is before the pages come).

- ``self``: the target reads the file into its own memory with preadv, one
  thread (CRIU's way, without the rest of CRIU).
- ``fill-T``: page_fill.fill with T threads from outside the process
  (``fill-T-P``: in pieces of P MiB, else page_fill.PIECE).

Every fill row also has the filling process's peak RSS over the fill
(``peak_rss_mib``, VmHWM reset first): the pages file's pages it mapped.

Every row checks 64 random pages of the target against the file. Root (to
write another process's memory), and the memory for the file and the target.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.page_io import place_dir  # noqa: E402
from gpusnap.pages import page_fill  # noqa: E402

TARGET = r"""
import mmap, os, sys, time, ctypes
n = int(sys.argv[1]) << 30
m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
if sys.argv[2] == "1":
    m.madvise(mmap.MADV_HUGEPAGE)
print(ctypes.addressof(ctypes.c_char.from_buffer(m)), flush=True)
for line in sys.stdin:
    if line.startswith("read "):
        fd = os.open(line.split()[1], os.O_RDONLY)
        t0 = time.monotonic()
        view, done = memoryview(m), 0
        while done < n:
            done += os.preadv(fd, [view[done:done + (64 << 20)]], done)
        print(round(time.monotonic() - t0, 3), flush=True)
"""


def make_file(path: Path, gib: int) -> None:
    """GIB GiB in which every 4 KiB page differs from every other (a page
    number stamped on a random MiB): a wrong offset shows in the check."""
    block = bytearray(os.urandom(1 << 20))
    with open(path, "wb") as f:
        for mib in range(gib << 10):
            for page in range(256):
                block[page << 12:(page << 12) + 8] = ((mib << 8) + page).to_bytes(8, "little")
            f.write(block)


def check(pid: int, path: Path, gib: int, base: int) -> None:
    with open(f"/proc/{pid}/mem", "rb", buffering=0) as mem, open(path, "rb") as f:
        for _ in range(64):
            off = random.randrange(gib << 18) << 12
            mem.seek(base + off)
            f.seek(off)
            if mem.read(4096) != f.read(4096):
                raise SystemExit(f"page_fill: page at offset {off:#x} differs")


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def _reset_peak_rss() -> int:
    """VmHWM set back to the RSS now (clear_refs 5); that RSS in KiB."""
    Path("/proc/self/clear_refs").write_text("5")
    return _status_kib("VmRSS")


def _peak_rss_kib() -> int:
    return _status_kib("VmHWM")


def one(path: Path, gib: int, how: str, thp: int) -> dict:
    target = subprocess.Popen([sys.executable, "-c", TARGET, str(gib), str(thp)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    try:
        base = int(target.stdout.readline())
        t0 = time.monotonic()
        if how == "self":
            target.stdin.write(f"read {path}\n")
            target.stdin.flush()
            seconds = float(target.stdout.readline())
            peak = None
        else:
            parts = how.split("-")
            piece = int(parts[2]) << 20 if len(parts) > 2 else page_fill.PIECE
            rss0 = _reset_peak_rss()
            t0 = time.monotonic()
            page_fill.fill(target.pid, [page_fill.Run(base, gib << 30, str(path), 0)],
                           int(parts[1]), piece)
            seconds = round(time.monotonic() - t0, 3)
            peak = _peak_rss_kib() - rss0 >> 10
        check(target.pid, path, gib, base)
        return {"how": how, "gib": gib, "thp": thp, "seconds": seconds,
                "gbps": round((gib << 30) / 1e9 / seconds, 2), "peak_rss_mib": peak}
    finally:
        os.killpg(target.pid, signal.SIGKILL)
        target.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=int, default=16)
    ap.add_argument("--threads", default="1,4,8,16",
                    help="T or T-P (P: MiB a call) for each fill row")
    ap.add_argument("--place", default="huge")
    ap.add_argument("--thp", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out")
    args = ap.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="page-fill-", dir=place_dir(args.place)))
    rows = []
    try:
        path = folder / "pages.img"
        t0 = time.monotonic()
        make_file(path, args.gib)
        print(f"file: {args.gib} GiB in {time.monotonic() - t0:.1f} s", flush=True)
        hows = ["self"] + [f"fill-{t}" for t in args.threads.split(",")]
        for _ in range(args.rounds):
            for how in hows:
                row = one(path, args.gib, how, args.thp)
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
