"""Which pages of a process CRIU will dump, asked of the kernel the way CRIU asks it.

CRIU (4.x, on kernels with the PAGEMAP_SCAN ioctl, 6.7+) finds the pages of a
private memory area to dump with one ioctl on /proc/PID/pagemap: every page
that is present or swapped, except the shared zero page and pages that are
not anonymous (an untouched page of a private file mapping), criu/pagemap-cache.c.
``dumped`` makes the same request, so the count of bytes it gives is the
count CRIU's pages file will hold for that range (while the process does not
change its memory in between: dump_ahead.py checks after the dump).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import bisect
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from gpusnap.criu import pagemap

PAGE_IS_FILE, PAGE_IS_PRESENT, PAGE_IS_SWAPPED, PAGE_IS_PFNZERO = 1 << 2, 1 << 3, 1 << 4, 1 << 5
PAGE = 4096
REGIONS = 4096  # regions per ioctl call


class _ScanArg(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in (
        "size", "flags", "start", "end", "walk_end", "vec", "vec_len", "max_pages",
        "category_inverted", "category_mask", "category_anyof_mask", "return_mask")]


class _Region(ctypes.Structure):
    _fields_ = [("start", ctypes.c_uint64), ("end", ctypes.c_uint64),
                ("categories", ctypes.c_uint64)]


# _IOWR('f', 16, struct pm_scan_arg)
PAGEMAP_SCAN = (3 << 30) | (ctypes.sizeof(_ScanArg) << 16) | (ord("f") << 8) | 16


class ScanUnsupported(OSError):
    """The kernel has no PAGEMAP_SCAN (before 6.7): nothing can be predicted."""


@dataclass(frozen=True)
class Vma:
    start: int
    end: int
    perms: str
    name: str

    @property
    def private(self) -> bool:
        return self.perms[3:4] == "p"

    @property
    def anonymous(self) -> bool:
        return self.name == "" or self.name.startswith("[anon") or self.name in ("[heap]", "[stack]")


def vmas(pid: int, proc: Path = Path("/proc")) -> list[Vma]:
    out = []
    for line in (proc / str(pid) / "maps").read_text().splitlines():
        parts = line.split(None, 5)
        start, end = (int(v, 16) for v in parts[0].split("-"))
        out.append(Vma(start, end, parts[1], parts[5].strip() if len(parts) > 5 else ""))
    return out


def dumped_areas(found: list[Vma]) -> list[tuple[int, int]]:
    """The ranges whose pages CRIU's task dump looks at (vma_area_is_private):
    private mappings, but not the kernel's [vvar] pages or [vsyscall]. (The
    [vdso] is dumped whole whatever the pagemap says: ``whole``.)"""
    return [(v.start, v.end) for v in found
            if v.private and not v.name.startswith(("[vvar", "[vsyscall"))]


def whole(found: list[Vma]) -> list[tuple[int, int]]:
    """Dumped however much of it is present: the [vdso] (criu/mem.c), and the
    first page of the first executable mapping, where CRIU writes the code that
    brings its parasite in (get_exec_start: a private file page becomes the
    task's own copy, so CRIU dumps it)."""
    out = [(v.start, v.end) for v in found if v.name == "[vdso]"]
    first = next((v for v in found if "x" in v.perms[:3] and v.end - v.start >= PAGE
                  and not v.name.startswith("[vsyscall")), None)
    if first is not None and first.private and first.name != "[vdso]":
        out.append((first.start, first.start + PAGE))
    return sorted(out)


def dumped(pid: int, areas: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """The runs of pages in ``areas`` that CRIU would write to the pages file,
    as (start, end), in address order. ScanUnsupported without PAGEMAP_SCAN."""
    return [(a, b) for a, b, _ in scan(pid, areas)]


def scan(pid: int, areas: Iterable[tuple[int, int]], inverted: int = PAGE_IS_PFNZERO | PAGE_IS_FILE,
         returned: int = PAGE_IS_PRESENT | PAGE_IS_SWAPPED) -> list[tuple[int, int, int]]:
    """(start, end, categories) of the pages in ``areas`` the kernel reports
    present or swapped and without the ``inverted`` categories."""
    out: list[tuple[int, int, int]] = []
    regions = (_Region * REGIONS)()  # noqa: the module's REGIONS, read at each call
    fd = os.open(f"/proc/{pid}/pagemap", os.O_RDONLY)
    try:
        for start, end in sorted(areas):
            while start < end:
                arg = _ScanArg(size=ctypes.sizeof(_ScanArg), start=start, end=end,
                               vec=ctypes.addressof(regions), vec_len=REGIONS,
                               category_inverted=inverted, category_mask=inverted,
                               category_anyof_mask=PAGE_IS_PRESENT | PAGE_IS_SWAPPED,
                               return_mask=returned)
                try:
                    n = fcntl.ioctl(fd, PAGEMAP_SCAN, arg)
                except OSError as exc:
                    if exc.errno in (errno.ENOTTY, errno.EINVAL):
                        raise ScanUnsupported(exc.errno, "the kernel has no PAGEMAP_SCAN") from None
                    raise
                for r in regions[:n]:
                    # clipped to what was asked: a huge page's region can begin
                    # before ``start`` (seen on 6.18: the same 2 MiB reported twice)
                    a, b = max(r.start, start, out[-1][1] if out else 0), min(r.end, end)
                    if a >= b:
                        continue
                    if out and out[-1][1] == a and out[-1][2] == r.categories:
                        out[-1] = (out[-1][0], b, r.categories)
                    else:
                        out.append((a, b, r.categories))
                # A full vector: go on after the last region it holds (walk_end
                # may lie past pages it had no room for).
                nxt = min(arg.walk_end, regions[n - 1].end) if n == REGIONS else arg.walk_end
                start = nxt if nxt > start else end
    finally:
        os.close(fd)
    return out


def minus(ranges: Iterable[tuple[int, int]], holes: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``ranges`` without any part of ``holes``, sorted. One pass over both
    sorted (a CUDA process maps thousands of areas: pairing each with each
    would cost seconds of the stop)."""
    merged: list[tuple[int, int]] = []  # disjoint, so the one before a point is the one to look at
    for h0, h1 in sorted(holes):
        if merged and h0 <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], h1))
        elif h0 < h1:
            merged.append((h0, h1))
    holes, starts = merged, [h[0] for h in merged]
    out = []
    for start, end in sorted(ranges):
        # the holes that may overlap: from the last one starting before ``start``
        k = max(0, bisect.bisect_right(starts, start) - 1)
        while start < end and k < len(holes) and holes[k][0] < end:
            h0, h1 = holes[k]
            if h1 > start:
                if h0 > start:
                    out.append((start, h0))
                start = max(start, h1)
            k += 1
        if start < end:
            out.append((start, end))
    return sorted(out)


def _extra(pid: int, v: Vma, pm: pagemap.Pagemap, most: int = 5) -> str:
    """Runs the scan finds in ``v`` that CRIU did not dump, with every category
    the kernel gives them (a diagnostic)."""
    present = [(r.vaddr, r.vaddr + r.pages * PAGE) for r in pm.runs if r.present]
    found = scan(pid, [(v.start, v.end)], inverted=0, returned=(1 << 9) - 1)
    out = []
    for a, b, cats in found:
        for x, y in minus([(a, b)], present):
            out.append(f"{x:#x}+{(y - x) // PAGE}p cat {cats:#x}")
    return ", ".join(out[:most]) + (f" (+{len(out) - most})" if len(out) > most else "")


def disagreements(pid: int, runs: list[tuple[int, int]], pm: pagemap.Pagemap,
                  most: int = 6) -> list[str]:
    """The mappings of ``pid`` where CRIU's pagemap and a scan now (the task is
    frozen) disagree, leaving out ``runs`` (memory read out before the dump):
    what to look at when dump_ahead's prediction of the pages file missed."""
    try:
        found = vmas(pid)
        areas = minus(dumped_areas(found), runs)
        scanned = dumped(pid, areas)
    except OSError as exc:
        return [f"no scan: {exc}"]
    out = []
    for v in found:
        crius = sum(min(r.vaddr + r.pages * PAGE, v.end) - max(r.vaddr, v.start)
                    for r in pm.runs if r.present and r.vaddr < v.end
                    and r.vaddr + r.pages * PAGE > v.start)
        ours = sum(min(b, v.end) - max(a, v.start) for a, b in scanned if a < v.end and b > v.start)
        if crius != ours and not any(a <= v.start and v.end <= b for a, b in runs) \
                and v.name != "[vdso]":
            out.append(f"{v.start:#x}-{v.end:#x} {v.perms} {v.name or '(anon)'}: CRIU {crius}, "
                       f"scan {ours}; " + _extra(pid, v, pm))
            if len(out) >= most:
                break
    return out
