"""How fast a prepared pages file becomes the final round's, where its pages shifted.

    python bench/page_move.py [--gib 16] [--shift-kib 2048] [--out page_move.json]

A pre-copy's final round finds most of round 1's pages on the target, shifted
by a few pages (docs/benchmarks.md: 34 GB of 36.7 at 32 GiB on the H200 host);
moving them within the prepared file (pages/page_patch.apply_moves) took
12.8 s of the stop there. This measures the ways of doing it on a file of GIB
GiB of random bytes in gpusnap's RAM tmpfs (pages/memory.ram_root), every
chunk of 8 MiB shifted by SHIFT: apply_moves in place as shipped, and with
more threads and bigger batches; and, the alternative tried and not shipped,
a copy into a new file with copy_file_range (no buffer in the process) by
1..16 threads, punching the old file behind (on the H200 host it was slower:
4.6 GB/s with one thread, 3.1 with 8, against 5.6 in place; the new file's
pages must be allocated and zeroed first). Prints GB/s of each; --out writes
them as JSON. Root, for the tmpfs.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpusnap.pages import page_patch  # noqa: E402
from gpusnap.pages import memory  # noqa: E402

CHUNK = 8 << 20
UNIT = 64 << 20  # bytes one copy_file_range task copies
PUNCH_HOLE = 0x01 | 0x02  # FALLOC_FL_KEEP_SIZE | FALLOC_FL_PUNCH_HOLE


def make(path: Path, size: int) -> None:
    block = os.urandom(64 << 20)
    with open(path, "wb") as f:
        for off in range(0, size, len(block)):
            f.write(block[:min(len(block), size - off)])


def moves_for(size: int, shift: int) -> list[tuple[int, int, int]]:
    return [(off, off + shift, min(CHUNK, size - off)) for off in range(0, size, CHUNK)]


def in_place(path: Path, size: int, shift: int, threads: int, batch: int) -> float:
    fd = os.open(path, os.O_RDWR)
    try:
        os.ftruncate(fd, size + shift)
        start = time.monotonic()
        left = page_patch.apply_moves(fd, moves_for(size, shift), threads=threads, batch=batch)
        seconds = time.monotonic() - start
    finally:
        os.close(fd)
    assert not left, left
    return seconds


def rebuilt(path: Path, size: int, shift: int, threads: int) -> float:
    """The old file's bytes copied into a new one at their shifted offsets, in the
    kernel, ``threads`` at once in source order, the old pages punched behind."""
    new = path.with_suffix(".new")
    units = [(off, off + shift, min(UNIT, size - off)) for off in range(0, size, UNIT)]
    libc = ctypes.CDLL(None, use_errno=True)
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
    src = os.open(path, os.O_RDWR)
    dst = os.open(new, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    start = time.monotonic()
    try:
        os.ftruncate(dst, size + shift)

        def copy(unit: tuple[int, int, int]) -> None:
            s, d, n = unit
            while n:
                k = os.copy_file_range(src, dst, n, s, d)
                s, d, n = s + k, d + k, n - k

        with ThreadPoolExecutor(threads) as pool:
            for (s, _, n), task in zip(units, [pool.submit(copy, u) for u in units]):
                task.result()
                libc.fallocate(src, PUNCH_HOLE, s, n)
        seconds = time.monotonic() - start
    finally:
        os.close(src)
        os.close(dst)
    os.replace(new, path)
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=16)
    ap.add_argument("--shift-kib", type=int, default=2048)
    ap.add_argument("--out")
    a = ap.parse_args()
    size, shift = int(a.gib * (1 << 30)), a.shift_kib << 10
    folder = memory.ram_root() / f"page-move-{os.getpid()}"
    folder.mkdir(parents=True)
    path = folder / "pages-1.img"
    rows = []
    try:
        cases = [("in place", dict(threads=4, batch=32 << 20)),
                 ("in place", dict(threads=8, batch=128 << 20)),
                 *[("copy_file_range", dict(threads=t)) for t in (1, 4, 8, 16)]]
        for how, kw in cases:
            make(path, size)
            seconds = (in_place(path, size, shift, **kw) if how == "in place"
                       else rebuilt(path, size, shift, **kw))
            row = {"how": how, **kw, "seconds": round(seconds, 3),
                   "gb_s": round(size / seconds / 1e9, 2)}
            rows.append(row)
            print(json.dumps(row), flush=True)
            path.unlink()
    finally:
        for f in folder.iterdir():
            f.unlink()
        folder.rmdir()
    if a.out:
        Path(a.out).write_text(json.dumps({"gib": a.gib, "shift": shift, "root": str(folder.parent),
                                           "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
