"""The driver's copy of GPU memory, read out of a checkpointed CUDA process on many
threads, dropped from it and written back (pages/dump_ahead.py's steps, no CRIU).

    python bench/dump_read.py [--gib 16] [--threads 16,8] [--pieces 8] [--rounds 2]
                              [--compare 1,4] [--drop-threads 8] [--dir /run/gpusnap/ram]

A child process holds GIB GiB of pseudo-random int32 on GPU 0; the driver locks
and checkpoints it; the mapping the checkpoint made is read into a file in DIR
(gpusnap's huge-page tmpfs is mounted there when it is not), ROUNDS times per
thread count and piece size (MiB a thread maps at a time): round 1 into a new
file, the later ones written over the file before them (as the final round of
a pre-copy writes over round 1's kept pages: pages/kept_pages.py), with
--compare each of those once more per size, comparing what it brings with what
the file holds that many MiB at a time (pages/same_pages.py: every byte is the
same here); then dropped
with a remote madvise on DROP_THREADS threads, written back, restored by
the driver, and every element compared. Needs a GPU (the H200/H100 machines:
run as root with the PyTorch Python).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpusnap.pages import page_fill  # noqa: E402

from gpusnap.pages import dump_ahead, same_pages
from gpusnap.gpu.cuda import CudaDriver  # noqa: E402
from gpusnap.pages import remote_syscall  # noqa: E402
from gpusnap.pages import memory
CHILD = r"""
import sys, torch
n = int(float(sys.argv[1]) * (1 << 30)) // 4
def make():
    g = torch.Generator(device="cuda").manual_seed(7)
    return torch.randint(-(2**31), 2**31 - 1, (n,), dtype=torch.int32, device="cuda", generator=g)
x = make()
torch.cuda.empty_cache(); torch.cuda.synchronize()
print("ready", flush=True)
for line in sys.stdin:
    y = make(); same = bool(torch.equal(x, y)); del y; torch.cuda.empty_cache()
    print("same" if same else "different", flush=True)
"""


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=16)
    ap.add_argument("--threads", default="16,8")
    ap.add_argument("--pieces", default="8", help="MiB each thread maps at a time")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--compare", default="",
                    help="MiB compared at a time (e.g. 1,4): the later rounds once more per "
                         "size, compared with the file's bytes")
    ap.add_argument("--drop-threads", type=int, default=dump_ahead.DROP_THREADS)
    ap.add_argument("--dir", default=str(memory.HUGE_ROOT))
    ap.add_argument("--python", default=sys.executable, help="a Python with PyTorch")
    args = ap.parse_args()
    folder = Path(args.dir)
    if folder == memory.HUGE_ROOT and not memory.mount_huge(folder):
        sys.exit(f"{folder}: gpusnap's huge-page tmpfs could not be mounted "
                 "(not root, or no tmpfs with huge pages here): give --dir")
    child = subprocess.Popen([args.python, "-c", CHILD, str(args.gib)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    rows: list[dict] = []
    try:
        assert child.stdout.readline().strip() == "ready"
        driver, pid = CudaDriver(), child.pid
        before = dump_ahead.mapped(pid)
        t = time.monotonic()
        driver.lock(pid, 10_000)
        driver.checkpoint(pid)
        rows.append({"step": "driver checkpoint", "s": round(time.monotonic() - t, 2)})
        runs = dump_ahead.staging(pid, before)
        size = sum(b - a for a, b in runs)
        path = folder / f"dump-read-{pid}.img"
        placed, pos = [], 0
        for a, b in runs:
            placed.append((a, b - a, pos))
            pos += b - a
        for threads in (int(n) for n in args.threads.split(",")):
            for piece in (int(n) for n in args.pieces.split(",")):
                dump_ahead.READ_PIECE = piece << 20
                path.unlink(missing_ok=True)
                for r in range(args.rounds):
                    sizes = [int(m) for m in args.compare.split(",") if m] if r else []
                    for mib in [0, *sizes]:
                        same_pages.COMPARE = (mib or 1) << 20
                        t = time.monotonic()  # round 1 into a new file, then over it
                        _, same, *_ = dump_ahead.read(pid, placed, str(path), size, threads,
                                                  donor=str(path) if r else None,
                                                  compare=mib > 0)
                        s = time.monotonic() - t
                        how = f"compared by {mib} MiB" if mib else "over it" if r else "new file"
                        rows.append({"step": f"read, {threads} thr, {piece} MiB, {how}",
                                     "s": round(s, 2), "GB/s": round(size / s / 1e9, 2),
                                     "unchanged": same})
        t = time.monotonic()
        remote_syscall.madvise_dontneed(pid, [(a, n) for a, n, _ in placed],
                                        threads=args.drop_threads)
        rows.append({"step": f"remote madvise, {args.drop_threads} threads",
                     "s": round(time.monotonic() - t, 2)})
        t = time.monotonic()
        page_fill.fill(pid, [page_fill.Run(a, n, str(path), o) for a, n, o in placed], 16)
        s = time.monotonic() - t
        rows.append({"step": "written back, 16 threads", "s": round(s, 2),
                     "GB/s": round(size / s / 1e9, 2)})
        t = time.monotonic()
        driver.restore(pid)
        driver.unlock(pid)
        rows.append({"step": "driver restore", "s": round(time.monotonic() - t, 2)})
        child.stdin.write("check\n")
        child.stdin.flush()
        verdict = child.stdout.readline().strip()
        path.unlink(missing_ok=True)
    finally:
        child.kill()
    print(json.dumps({"gib": args.gib, "bytes": size, "runs": len(runs), "rows": rows,
                      "elements": verdict}, indent=1))
    for row in rows:
        print(f"{row['step']:40s} {row['s']:7.2f} s  {row.get('GB/s', '')}")
    print(f"every element after restore: {verdict}")
    return 0 if verdict == "same" else 1


if __name__ == "__main__":
    sys.exit(main())
