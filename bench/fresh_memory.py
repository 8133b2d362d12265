"""How fast this machine backs memory it has not handed out before, by thread count.

    python bench/fresh_memory.py [--gib 32] [--threads 16,32,16,8] [--keep] [--pause S]
                                 [--dir /run/gpusnap/ram]

Writes GIB GiB into a new file in DIR (gpusnap's huge-page tmpfs, mounted when it
is not) from each thread count in turn, 8 MiB at a time, then deletes it. Where a
VM's host backs RAM on first touch, the first rounds pay for it and later ones
may reuse what the guest freed: the read-ahead of the driver's copy
(pages/dump_ahead.py) and the pull's pages (pages/prepared_pages.py) write into
such memory, so their rate is bounded by this one. No GPU needed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpusnap.pages import memory  # noqa: E402

PIECE = 8 << 20


def _meminfo_gb(key: str) -> float:
    return round(memory.meminfo().get(key, 0) / 1e9, 1)


def write_new(folder: Path, total: int, threads: int, keep: bool = False) -> float:
    """Seconds to write TOTAL bytes into a new file on THREADS threads (deleted
    after unless KEEP, so that the next round cannot reuse its memory)."""
    path = folder / f"fresh-{os.getpid()}-{time.monotonic_ns()}"
    buf = os.urandom(PIECE)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        share = -(-total // threads // PIECE) * PIECE

        def part(i: int) -> None:
            end = min(total, (i + 1) * share)
            for off in range(i * share, end, PIECE):
                piece = memoryview(buf)[:min(PIECE, end - off)]
                if os.pwrite(fd, piece, off) != len(piece):  # a full tmpfs writes short
                    raise OSError(f"{path}: short write at {off}")

        started = time.monotonic()
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(part, range(threads)))
        return time.monotonic() - started
    finally:
        os.close(fd)
        if not keep:
            path.unlink()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=32)
    ap.add_argument("--threads", default="16,32,16,8")
    ap.add_argument("--dir", default=str(memory.HUGE_ROOT))
    ap.add_argument("--keep", action="store_true",
                    help="keep each round's file until the end: every round gets memory never used")
    ap.add_argument("--pause", type=float, default=0.0, help="seconds between rounds")
    args = ap.parse_args()
    folder = Path(args.dir)
    if folder == memory.HUGE_ROOT and not memory.mount_huge(folder):
        sys.exit(f"{folder}: gpusnap's huge-page tmpfs could not be mounted "
                 "(not root, or no tmpfs with huge pages here): give --dir")
    total = int(args.gib * (1 << 30))
    for threads in (int(t) for t in args.threads.split(",")):
        free_before = _meminfo_gb("MemFree")
        seconds = write_new(folder, total, threads, args.keep)
        print(json.dumps({"threads": threads, "gib": args.gib, "seconds": round(seconds, 2),
                          "gb_s": round(total / seconds / 1e9, 2), "free_gb_before": free_before}),
              flush=True)
        if args.pause:
            time.sleep(args.pause)
    for path in folder.glob(f"fresh-{os.getpid()}-*"):
        path.unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main())
