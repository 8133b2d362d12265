"""The driver's restore from a copy of its staging memory filled in, or mapped from a file.

    python bench/staging_map.py [--gib 8] [--rounds 2] [--threads 16]
                                [--hows fill,map,map-4k,map-4k-read,map-4k-again,fill-after-other]
                                [--out staging_map.json]

After cuCheckpointProcessCheckpoint a CUDA process holds its GPU memory in new
private anonymous memory (the staging); cuCheckpointProcessRestore reads it
back to the GPU. A restore today writes that memory from the pages file into
the restored process (pages/page_fill.py, ~0.45 s for 11 GB on an H200
host): the one part of a replica's time beyond the driver that grows with its
size. If the driver takes its staging as a private mapping of the pages file
(MAP_PRIVATE over gpusnap's huge-page tmpfs, what CRIU would set up for a
file-backed area), no byte needs writing before the driver's restore.

This asks the driver that, without CRIU: a PyTorch process fills GIB GiB on
GPU 0 and sums it; each round locks and checkpoints it, copies its staging
ranges to a file on the huge-page tmpfs, then either

- ``fill``: writes the ranges back from the file on THREADS threads, as a
  restore does, then the driver's restore; or
- ``map``: the process maps the file over its own ranges (mmap MAP_FIXED |
  MAP_PRIVATE; it runs no CUDA call meanwhile), then the driver's restore;
  ``map-4k`` with the staging 4 KiB past a 2 MiB boundary of the file (as in a
  pages file, where CRIU's own pages come first: no huge page mapping), and
  ``map-4k-read`` with that file read through another mapping first, and
  ``map-4k-again`` with the file the driver restored from in this how's round
  before, written over in place (as a replica's pages file, linked from the
  replica before it),

or ``fill-after-other``: as ``fill``, but the GPU memory the checkpoint freed is
first taken by another CUDA process (GIB GiB allocated and written) and let go
just before the driver's restore: whether a GPU whose memory was held ready
(a replica's GPU kept reserved until it starts) restores faster than one
whose memory lay free,

each after the ranges were dropped (MADV_DONTNEED: empty, as in a restored
process before its pages come), and unlocks it; the process then sums its GPU
memory again, which must equal the first sums. Printed per round: the fill or the map, the driver's restore,
whether the file is still mapped after the restore (what a later dump would
then meet), and the sums. Root, one GPU, /opt/torch's PyTorch (GPU machines).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpusnap.gpu.cuda import CudaDriver  # noqa: E402
from gpusnap.pages import dump_ahead, memory, page_fill  # noqa: E402

TORCH_PY = "/opt/torch/.venv/bin/python3"
HUGE = 2 << 20

# The CUDA process: fills its memory, answers "sums", and maps or drops its own
# ranges when asked (plain CPU work: the driver holds its CUDA calls meanwhile).
APP = r"""
import ctypes, mmap, os, sys, torch
libc = ctypes.CDLL("libc.so.6", use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                      ctypes.c_int, ctypes.c_long]
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
gib = float(sys.argv[1])
n = int(gib * (1 << 30)) // 8 // 64
blocks = [torch.arange(n, device="cuda", dtype=torch.int64) * (k + 1) % 1000003
          for k in range(64)]
def sums():
    return [int(b.sum().item()) for b in blocks]
print("ready", *sums(), flush=True)
for line in sys.stdin:
    cmd, *args = line.split()
    if cmd == "sums":
        print("sums", *sums(), flush=True)
    elif cmd == "map":
        fd = os.open(args[0], os.O_RDONLY)
        for i in range(1, len(args), 3):
            addr, length, off = map(int, args[i:i + 3])
            got = libc.mmap(addr, length, mmap.PROT_READ | mmap.PROT_WRITE,
                            mmap.MAP_PRIVATE | 0x10, fd, off)  # MAP_FIXED
            if got != addr:
                print("error mmap", ctypes.get_errno(), flush=True)
                break
        else:
            print("mapped", flush=True)
        os.close(fd)
    elif cmd == "drop":
        for i in range(0, len(args), 2):
            libc.madvise(int(args[i]), int(args[i + 1]), 4)  # MADV_DONTNEED
        print("dropped", flush=True)
"""


# The other CUDA process of fill-after-other: takes GPU memory and lets it go.
HOLDER = r"""
import sys, torch
held = None
torch.zeros(1, device="cuda")
print("ready", flush=True)
for line in sys.stdin:
    cmd, *args = line.split()
    if cmd == "hold":
        held = torch.empty(int(float(args[0]) * (1 << 30)), dtype=torch.uint8, device="cuda")
        held.fill_(1)
        torch.cuda.synchronize()
        print("held", flush=True)
    elif cmd == "free":
        held = None
        torch.cuda.empty_cache()
        torch.cuda.synchronize()
        print("freed", flush=True)
"""


def _ask(app: subprocess.Popen, line: str, answer: str) -> list[str]:
    app.stdin.write(line + "\n")
    app.stdin.flush()
    got = app.stdout.readline().split()
    if not got or got[0] != answer:
        raise SystemExit(f"the CUDA process answered {got} to {line[:40]!r}")
    return got[1:]


def _copy_out(pid: int, runs: list[tuple[int, int]], path: Path,
              shift: int = 0) -> list[tuple[int, int, int]]:
    """The ranges' bytes into ``path`` at 2 MiB-aligned offsets plus ``shift``:
    (addr, length, offset). An existing file is written over in place (its
    page cache pages stay: what an earlier restore did to them stays too)."""
    placed, off = [], shift
    mode = "r+b" if path.exists() else "wb"
    with open(f"/proc/{pid}/mem", "rb", buffering=0) as mem, open(path, mode) as out:
        for start, end in runs:
            out.seek(off)
            for at in range(start, end, 64 << 20):
                mem.seek(at)
                out.write(mem.read(min(64 << 20, end - at)))
            placed.append((start, end - start, off))
            off += (end - start + HUGE - 1) // HUGE * HUGE
    return placed


def _read_through_a_mapping(path: Path) -> None:
    """Every page of ``path`` read through a private mapping here, then unmapped:
    as a replica's pages file the replica before it had mapped."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        with mmap.mmap(f.fileno(), size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ) as m:
            sum(m[i] for i in range(0, size, 4096))


def _still_mapped(pid: int, path: Path) -> int:
    return sum(1 for line in Path(f"/proc/{pid}/maps").read_text().splitlines()
               if line.endswith(str(path)))


def one_round(driver: CudaDriver, app: subprocess.Popen, how: str, folder: Path,
              threads: int, before: list[tuple[int, int]], first: list[str],
              holder: subprocess.Popen | None = None, gib: float = 0) -> dict:
    pid = app.pid
    t = time.monotonic()
    driver.lock(pid, 10_000)
    driver.checkpoint(pid)
    checkpoint_s = time.monotonic() - t
    if how == "fill-after-other":  # the memory the checkpoint freed, taken by another
        _ask(holder, f"hold {gib}", "held")
    runs = dump_ahead.staging(pid, before)
    path = folder / f"staging-{how}.bin"
    again = path.exists()
    # map-4k: the staging 4 KiB past a 2 MiB boundary of the file, as in a pages
    # file (CRIU's own pages come before it); -read: the file read through another
    # mapping first, as a replica's linked pages file is
    placed = _copy_out(pid, runs, path, 4096 if how.startswith("map-4k") else 0)
    if how.endswith("-read"):
        _read_through_a_mapping(path)
    # -again: the file of this how's round before, which the driver restored from
    # through a mapping (as a replica's pages file linked from the one before)
    # both start where a restored process does: the ranges mapped, nothing in them
    _ask(app, "drop " + " ".join(f"{a} {n}" for a, n, _ in placed), "dropped")
    t = time.monotonic()
    if how.startswith("map"):
        _ask(app, "map " + str(path) + " " + " ".join(f"{a} {n} {o}" for a, n, o in placed),
             "mapped")
    else:
        page_fill.fill(pid, [page_fill.Run(a, n, str(path), o) for a, n, o in placed], threads)
    prepare_s = time.monotonic() - t
    freed_s = None
    if how == "fill-after-other":  # let go just before the driver's restore
        t = time.monotonic()
        _ask(holder, "free", "freed")
        freed_s = round(time.monotonic() - t, 3)
    t = time.monotonic()
    driver.restore(pid)
    restore_s = time.monotonic() - t
    driver.unlock(pid)
    mapped_after = _still_mapped(pid, path)
    equal = _ask(app, "sums", "sums") == first
    if not how.endswith("-again"):
        path.unlink()
    row = {"how": how, "file_restored_from_before": how.endswith("-again") and again,
           "staging_bytes": sum(n for _, n, _ in placed), "ranges": len(placed),
           "checkpoint_s": round(checkpoint_s, 3), "fill_or_map_s": round(prepare_s, 3),
           "driver_restore_s": round(restore_s, 3), "other_let_go_s": freed_s,
           "beyond_plus_driver_s": round(prepare_s + restore_s, 3),
           "file_mapped_after_restore": mapped_after, "sums_equal": equal}
    print(json.dumps(row), flush=True)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=page_fill.default_threads())
    ap.add_argument("--hows", default="fill,map,map-4k,map-4k-read",
                    help="fill, map (2 MiB-aligned), map-4k (4 KiB past it), map-4k-read, "
                         "map-4k-again, fill-after-other")
    ap.add_argument("--out")
    args = ap.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="staging-", dir=memory.HUGE_ROOT)) \
        if memory.mount_huge(memory.HUGE_ROOT) else Path(tempfile.mkdtemp(dir="/dev/shm"))
    app = subprocess.Popen([TORCH_PY, "-c", APP, str(args.gib)], stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, text=True)
    holder = subprocess.Popen([TORCH_PY, "-c", HOLDER], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True) \
        if "fill-after-other" in args.hows else None
    rows = []
    try:
        if holder is not None and holder.stdout.readline().split() != ["ready"]:
            raise SystemExit("the other CUDA process did not start")
        first = app.stdout.readline().split()
        if not first or first[0] != "ready":
            raise SystemExit(f"the CUDA process did not start: {first}")
        before = dump_ahead.mapped(app.pid)
        driver = CudaDriver()
        for _ in range(args.rounds):
            for how in args.hows.split(","):
                rows.append(one_round(driver, app, how, folder, args.threads, before, first[1:],
                                      holder, args.gib))
    finally:
        for proc in (app, holder):
            if proc is not None:
                proc.kill()
                proc.wait(timeout=60)  # a CUDA process's exit: the driver frees its memory
        for f in folder.iterdir():
            f.unlink()
        folder.rmdir()
    if args.out:
        Path(args.out).write_text(json.dumps({"gib": args.gib, "rows": rows}, indent=1))
    ok = all(r["sums_equal"] for r in rows)
    print("all sums equal" if ok else "SUMS DIFFER")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
