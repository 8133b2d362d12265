"""Which pages gpusnap writes into a restored process itself, and how CRIU is told to leave them.

CRIU restores memory on one thread (page_fill.py says why that matters). Before
it starts (pre-restore), ``prepare`` picks the big runs of pages that lie in
plain private memory (mm.Vma.plain_private_memory) and rewrites the images
folder so that CRIU restores everything but those runs:

    images/
      pagemap-<vpid>.img   new: every run CRIU still restores is PE_PARENT, the
                           picked runs are holes (left unmapped: zero until filled)
      pages-<new id>.img   new, empty: the new pagemaps' own pages file
      parent -> gpusnap-fill
      gpusnap-fill/        what CRIU reads those PE_PARENT runs from:
        pagemap-<vpid>.img the task's pagemap as it was (a hard link; a link to
                           its file where it was a link, pages in RAM)
        pages-<id>.img     -> ../pages-<id>.img, each pages file as it was
        parent             the folder's own parent link, when it had one
        mm-<vpid>.img      the task's mm image as it was, where the new one asks
                           for huge pages (a hard link)
        undo.json          how to put the folder back

Nothing is copied: CRIU reads what it restores from the same files, at the
same offsets, one parent link further.

Memory areas the fill writes almost whole (HUGE_SHARE of them, as the
driver's host copy of GPU memory is) also get MADV_HUGEPAGE in the task's
mm image, which CRIU's restorer applies before post-restore: the fill then
faults 2 MiB pages instead of 4 KiB ones (512 times fewer faults), and the
driver reads its copy back faster (docs/benchmarks.md). Such an area holds the same bytes either way; an
application that said MADV_NOHUGEPAGE, or a host without transparent huge
pages, keeps its areas as they were. Then, while the restored tasks wait in
CRIU's restorer with their memory in place (post-restore: CRIU fails the
restore if that step fails), page_fill writes the picked runs and ``undo``
puts the folder back as it was, so a folder restored again (Podman keeps a
checkpoint it failed to restore) is the one CRIU wrote. A restore that never
reached post-restore leaves the rewrite: the next restore's pre-restore puts
it back before anything else (action.undo_leftover_fill).

Nothing is picked (the folder is left alone) where the gain is too small
(MIN_TOTAL), where a memory area may be shared copy-on-write with another
task (the same range in two tasks: CRIU shares such pages between them), or
where the folder is not one this module can reason about (a parent that is a
folder, shmem pagemaps reading from a parent, a pagemap that is not a file,
hugetlb or plugin memory: CRIU reads those in its restorer at offsets of the
task's own pages file, which PE_PARENT runs do not advance).
"""

from __future__ import annotations

import bisect
import json
import os
import shutil
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from gpusnap.criu import mm, pagemap
from gpusnap.criu.images import ImageError
from gpusnap.gpu import staging
from gpusnap.pages import fill_plan_cache
from gpusnap.pages.page_fill import Run, merged
from gpusnap.pages.pages_aside import relative_link

FOLDER = "gpusnap-fill"
UNDO = "undo.json"
MIN_RUN = 1 << 20  # smaller runs stay with CRIU: each piece of the fill costs a call
MIN_TOTAL = 256 << 20  # below this CRIU's own copy beats starting the fill
MAX_PARENTS = 16
HUGE_SHARE = 0.9  # an area filled at least this much gets huge pages: no memory is added
HUGE_MIN = 2 << 20
THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")

@dataclass
class Plan:
    """The runs to write into each task (by its pid in the images), the folder,
    each task's areas (start, end) that get MADV_HUGEPAGE, and the runs of the
    driver's staging that post-resume maps instead (gpu/staging.py)."""

    folder: str
    tasks: dict[int, list[Run]] = field(default_factory=dict)
    huge: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    mapped: dict[int, list[Run]] = field(default_factory=dict)
    # the pagemaps plan() read, for rewrite(): not in the JSON, each read once
    pagemaps: dict[int, pagemap.Pagemap] = field(default_factory=dict, compare=False, repr=False)
    # the new images rewrite() wrote or is to write (a kept plan's), by file name
    images: dict[str, bytes] = field(default_factory=dict, compare=False, repr=False)
    phases: dict[str, float] = field(default_factory=dict, compare=False, repr=False)  # journal
    kept: bool = field(default=False, compare=False, repr=False)  # fill_plan_cache's

    @property
    def bytes(self) -> int:
        return sum(r.length for runs in self.tasks.values() for r in runs)

    @property
    def mapped_bytes(self) -> int:
        return sum(r.length for runs in self.mapped.values() for r in runs)

    def holes(self, vpid: int) -> list[Run]:
        """Every run CRIU leaves out of the task, in address order."""
        return sorted(self.tasks.get(vpid, []) + self.mapped.get(vpid, []), key=lambda r: r.address)

    @property
    def huge_bytes(self) -> int:
        return sum(end - start for areas in self.huge.values() for start, end in areas)

    def to_json(self) -> str:
        return json.dumps({"folder": self.folder, "tasks": {
            str(vpid): [[r.address, r.length, r.path, r.offset] for r in runs]
            for vpid, runs in self.tasks.items()},
            "huge": {str(vpid): areas for vpid, areas in self.huge.items()},
            "mapped": {str(vpid): [[r.address, r.length, r.path, r.offset] for r in runs]
                       for vpid, runs in self.mapped.items()}})

    @classmethod
    def from_json(cls, text: str) -> Plan:
        data = json.loads(text)
        return cls(data["folder"], {int(v): [Run(*r) for r in runs]
                                    for v, runs in data["tasks"].items()},
                   {int(v): [(a, b) for a, b in areas]
                    for v, areas in data.get("huge", {}).items()},
                   {int(v): [Run(*r) for r in runs] for v, runs in data.get("mapped", {}).items()})


def locate(folder: Path, vpid: int, depth: int = 0, pm: pagemap.Pagemap | None = None) -> list[Run]:
    """Where the task's pages lie: address and length, the pages file and offset
    CRIU reads them from (through parent folders for PE_PARENT runs). Present
    runs that continue one another in memory and in the file come as one: CRIU
    caps an entry at 1 MiB, so a GPU process's 11 GB come as ~11,000 entries
    that make a few dozen stretches, and what follows (in the stop) handles
    stretches. ``pm``: the folder's pagemap of the task, where the caller read it."""
    pm = pm or pagemap.parse((folder / f"pagemap-{vpid}.img").read_bytes())
    pages = os.path.realpath(folder / pm.pages_file)
    parent: list[Run] | None = None
    starts: list[int] = []
    out: list[Run] = []
    pos = 0
    at = size = 0  # the stretch of present runs not yet in ``out`` (from file offset pos - size)

    def flush() -> None:
        if size:
            out.append(Run(at, size, pages, pos - size))

    for run in pm.runs:
        length = run.pages * pagemap.PAGE
        if run.present:
            if size and at + size == run.vaddr:
                size += length
            else:
                flush()
                at, size = run.vaddr, length
            pos += length
            continue
        flush()
        at = size = 0
        if run.flags & pagemap.PE_PARENT:
            if parent is None:
                if depth >= MAX_PARENTS or not (folder / "parent").is_dir():
                    raise ImageError(f"{folder}: pagemap-{vpid}.img reads from a parent it lacks")
                parent = locate(Path(os.path.realpath(folder / "parent")), vpid, depth + 1)
                starts = [r.address for r in parent]
            out += _covering(parent, starts, run.vaddr, length)
        else:
            raise ImageError(f"pagemap-{vpid}.img: a run with flags {run.flags} (lazy pages)")
    flush()
    return out


def _covering(located: list[Run], starts: list[int], start: int, length: int) -> list[Run]:
    """The parts of ``located`` (sorted, not overlapping; ``starts`` their addresses)
    that make up [start, start+length)."""
    out, at, end = [], start, start + length
    i = bisect.bisect_right(starts, start) - 1
    while at < end:
        if i < 0 or i >= len(located) or not located[i].address <= at < located[i].address + located[i].length:
            raise ImageError(f"page {at:#x} is not in the parent's pagemap")
        r = located[i]
        n = min(end, r.address + r.length) - at
        out.append(Run(at, n, r.path, r.offset + at - r.address))
        at += n
        i += 1
    return out


def _parts(located: list[Run], areas: list[tuple[int, int]]) -> list[Run]:
    """The parts of the located runs that lie inside one of ``areas`` (sorted)."""
    parts, starts = [], [a for a, _ in areas]
    for r in located:
        i = max(bisect.bisect_right(starts, r.address) - 1, 0)
        while i < len(areas) and areas[i][0] < r.address + r.length:
            lo, hi = max(r.address, areas[i][0]), min(r.address + r.length, areas[i][1])
            if hi > lo:
                parts.append(Run(lo, hi - lo, r.path, r.offset + lo - r.address))
            i += 1
    return parts


def _outside(areas: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The address space but ``areas`` (sorted, not overlapping)."""
    out, at = [], 0
    for lo, hi in areas:
        if lo > at:
            out.append((at, lo))
        at = max(at, hi)
    return out + [(at, 1 << 64)]


def _clip(located: list[Run], areas: list[tuple[int, int]]) -> list[Run]:
    """The parts of the located runs that lie inside one of ``areas`` (sorted), where
    they make a stretch of MIN_RUN or more (a stretch may span pieces of several
    files: the final round's own pages and its parent's)."""
    parts = _parts(located, areas)
    out: list[Run] = []
    stretch: list[Run] = []
    for part in parts + [None]:
        if part is None or (stretch and stretch[-1].address + stretch[-1].length != part.address):
            if sum(p.length for p in stretch) >= MIN_RUN:
                out += stretch
            stretch = []
        if part is not None:
            stretch.append(part)
    return out


def _without(runs: tuple[pagemap.Run, ...], holes: list[Run]) -> tuple[pagemap.Run, ...]:
    """Each run minus the holes, as PE_PARENT runs (gpusnap-fill holds the pages)."""
    out, starts = [], [h.address for h in holes]
    for run in runs:
        at, end = run.vaddr, run.vaddr + run.pages * pagemap.PAGE
        i = max(bisect.bisect_right(starts, at) - 1, 0)
        while at < end:
            hole = holes[i] if i < len(holes) else None
            if hole is None or hole.address >= end:
                out.append(pagemap.Run(at, (end - at) // pagemap.PAGE, pagemap.PE_PARENT))
                break
            if hole.address + hole.length <= at:
                i += 1
                continue
            if hole.address > at:
                out.append(pagemap.Run(at, (hole.address - at) // pagemap.PAGE, pagemap.PE_PARENT))
            at = min(end, hole.address + hole.length)
            i += 1
    return tuple(out)


def thp_available(path: Path = THP) -> bool:
    """Whether MADV_HUGEPAGE gives this host's processes huge pages (a kernel
    without them refuses the madvise, and CRIU's restorer would fail)."""
    try:
        return "[never]" not in path.read_text()
    except OSError:
        return False


def _dense(areas: list[mm.Vma], runs: list[Run]) -> list[tuple[int, int]]:
    """The areas the runs (each inside one of them) fill to HUGE_SHARE or more,
    which have no madvise of huge pages either way yet."""
    filled: Counter[tuple[int, int]] = Counter()
    starts = [v.start for v in areas]
    for r in runs:
        v = areas[bisect.bisect_right(starts, r.address) - 1]
        filled[(v.start, v.end)] += r.length
    said = 1 << mm.MADV_HUGEPAGE | 1 << mm.MADV_NOHUGEPAGE
    return [(v.start, v.end) for v in areas
            if v.end - v.start >= HUGE_MIN and not v.madv & said
            and filled[(v.start, v.end)] >= HUGE_SHARE * (v.end - v.start)]


def plan(folder: Path, huge_pages: bool = False, map_staging: bool = False) -> Plan | None:
    """The runs worth filling in this images folder, or None (CRIU restores all);
    with ``huge_pages``, the areas they fill almost whole get huge pages; with
    ``map_staging``, the runs in the driver's staging are to be mapped instead."""
    real = Path(os.path.realpath(folder))
    parent = real / "parent"
    if parent.exists() and not parent.is_symlink():
        return None
    for shmem in real.glob("pagemap-shmem-*.img"):
        if any(not r.present for r in pagemap.parse(shmem.read_bytes()).runs):
            return None  # would read from a parent folder that gpusnap-fill replaces
    vmas = {int(p.name[3:-4]): mm.parse(p.read_bytes()) for p in real.glob("mm-*.img")
            if p.name[3:-4].isdigit()}
    if any(v.restored_in_place for areas in vmas.values() for v in areas):
        return None
    seen = Counter((v.start, v.end) for areas in vmas.values() for v in areas)
    held = staging.recorded(real) if map_staging else {}
    out = Plan(str(real))
    for vpid, areas in sorted(vmas.items()):
        if not (real / f"pagemap-{vpid}.img").is_file():
            continue
        own = sorted((v for v in areas if v.plain_private_memory and seen[(v.start, v.end)] == 1),
                     key=lambda v: v.start)
        if not own:
            continue
        out.pagemaps[vpid] = pm = pagemap.parse((real / f"pagemap-{vpid}.img").read_bytes())
        runs = merged(_clip(locate(real, vpid, pm=pm), [(v.start, v.end) for v in own]))
        mapped = _parts(runs, held[vpid]) if held.get(vpid) else []
        if mapped:  # each byte either written or mapped, none left out
            out.mapped[vpid] = mapped
            runs = _parts(runs, _outside(held[vpid]))
        if runs or mapped:
            out.tasks[vpid] = runs
            mm_image = real / f"mm-{vpid}.img"
            dense = _dense(own, runs) if huge_pages and not mm_image.is_symlink() else []
            if dense:
                out.huge[vpid] = dense
    return out if out.bytes + out.mapped_bytes >= MIN_TOTAL else None


def _link_text(folder: Path) -> str | None:
    link = folder / "parent"
    return os.readlink(link) if link.is_symlink() else None


def _symlink(target: str, path: Path) -> None:
    """``path`` -> ``target``, replacing what is there in one step."""
    tmp = path.with_name(path.name + ".gpusnap-tmp")
    tmp.unlink(missing_ok=True)
    os.symlink(target, tmp)
    os.replace(tmp, path)


def rewrite(p: Plan) -> None:
    """Lay the folder out as the module's doc shows; undo.json first, so a rewrite
    cut short anywhere is put back by ``undo``."""
    folder = Path(p.folder)
    aside = folder / FOLDER
    ids = [int(f.name[6:-4]) for f in folder.glob("pages-*.img") if f.name[6:-4].isdigit()]
    new_id = max(ids, default=0) + 1
    old_parent = _link_text(folder)
    # with a parent, every task's PE_PARENT runs must now go through gpusnap-fill
    vpids = sorted(p.tasks) if old_parent is None else \
        sorted(int(f.name[8:-4]) for f in folder.glob("pagemap-*.img") if f.name[8:-4].isdigit())
    # pages in RAM while the folder is on disk: the pagemaps are relative links (pages_aside)
    links = {str(v): os.readlink(folder / f"pagemap-{v}.img") for v in vpids
             if (folder / f"pagemap-{v}.img").is_symlink()}
    aside.mkdir(mode=0o700)
    _write_synced(aside / UNDO, json.dumps({"parent": old_parent, "pages_id": new_id,
                                            "tasks": vpids, "links": links,
                                            "mm": sorted(p.huge)}))
    for name in ids:
        os.symlink(f"../pages-{name}.img", aside / f"pages-{name}.img")
    if old_parent is not None:
        os.symlink(old_parent if os.path.isabs(old_parent) else f"../{old_parent}", aside / "parent")
    (folder / f"pages-{new_id}.img").touch()
    for vpid in vpids:
        path = folder / f"pagemap-{vpid}.img"
        if str(vpid) in links:
            os.symlink(relative_link(path, aside), aside / path.name)
        else:
            os.link(path, aside / path.name)
        new = p.images.get(path.name)
        if new is None:
            old = p.pagemaps.get(vpid) or pagemap.parse(path.read_bytes())
            new = p.images[path.name] = pagemap.serialize(
                pagemap.Pagemap(new_id, _without(old.runs, p.holes(vpid))))
        tmp = path.with_name(path.name + ".gpusnap-tmp")
        tmp.write_bytes(new)
        os.replace(tmp, path)
    for vpid, areas in sorted(p.huge.items()):
        path = folder / f"mm-{vpid}.img"
        new = p.images.get(path.name)
        if new is None:
            new = p.images[path.name] = mm.with_advice(path.read_bytes(), areas, mm.MADV_HUGEPAGE)
        os.link(path, aside / path.name)
        tmp = path.with_name(path.name + ".gpusnap-tmp")
        tmp.write_bytes(new)
        os.replace(tmp, path)
    _symlink(FOLDER, folder / "parent")


def _write_synced(path: Path, text: str) -> None:
    """On the disk before anything it describes changes (a crash must not leave
    the original pagemaps in gpusnap-fill with nothing saying where they go)."""
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def undo(folder: Path) -> bool:
    """Put a rewritten folder back as CRIU wrote it; False where there was nothing to undo."""
    folder = Path(os.path.realpath(folder))
    aside = folder / FOLDER
    if not aside.is_dir():
        return False
    try:
        state = json.loads((aside / UNDO).read_text())
    except (OSError, ValueError):
        if any(aside.glob("pagemap-*.img")):  # the originals, with nothing saying where to
            raise OSError(f"{aside / UNDO} is unreadable and {aside} holds CRIU's pagemaps") from None
        state = None  # cut short before anything outside gpusnap-fill changed
    if state is not None:
        links = state.get("links", {})
        for vpid in state["tasks"]:
            kept = aside / f"pagemap-{vpid}.img"
            if str(vpid) in links:
                _symlink(links[str(vpid)], folder / kept.name)
            elif kept.exists():
                os.replace(kept, folder / kept.name)
        for vpid in state.get("mm", []):
            kept = aside / f"mm-{vpid}.img"
            if kept.exists():
                os.replace(kept, folder / kept.name)
        if state["parent"] is None:
            if _link_text(folder) == FOLDER:
                (folder / "parent").unlink()
        else:
            _symlink(state["parent"], folder / "parent")
        (folder / f"pages-{state['pages_id']}.img").unlink(missing_ok=True)
    shutil.rmtree(aside)
    for tmp in folder.glob("*.gpusnap-tmp"):
        tmp.unlink()
    return True


def prepare(folder: Path, keep: Callable[[Plan], None], huge_pages: bool = False,
            map_staging: bool = False, cache: Path | None = None) -> Plan | None:
    """Undo a leftover rewrite, plan, and rewrite where there is something to fill.
    ``keep`` stores the plan for post-restore before the folder changes (a rewrite
    whose plan is lost would restore zeros); any failure puts the folder back
    and leaves the restore to CRIU alone. ``cache``: where plans are kept for
    the next restore of the same images (fill_plan_cache.py), else None."""
    started = time.monotonic()
    undo(folder)
    real = Path(os.path.realpath(folder))
    settings = (huge_pages, map_staging, MIN_RUN, MIN_TOTAL, HUGE_SHARE, HUGE_MIN)
    name = fill_plan_cache.key(real, settings) if cache is not None else None
    kept_plan = fill_plan_cache.load(cache, name, real) if name else None
    p = Plan(str(real), **kept_plan[0], images=kept_plan[1], kept=True) if kept_plan \
        else plan(folder, huge_pages, map_staging)
    if p is None:
        return None
    planned = time.monotonic()
    keep(p)
    kept = time.monotonic()
    try:
        rewrite(p)
    except BaseException:
        undo(folder)
        raise
    p.phases = {"plan": round(planned - started, 3), "keep": round(kept - planned, 3),
                "rewrite": round(time.monotonic() - kept, 3)}
    if name and not p.kept:  # after CRIU's stop would be better, but no later step reads images
        fill_plan_cache.store(cache, name, p.tasks, p.huge, p.mapped,
                              {v: p.pagemaps[v].pages_file for v in p.tasks}, p.images)
    return p


@dataclass(frozen=True)
class Settings:
    """/etc/gpusnap/page-fill.json: {"enabled": false} leaves every page to CRIU
    (benchmarks compare); "threads" overrides page_fill.default_threads();
    {"huge_pages": false} leaves every area's madvise as the application had it;
    {"agent": false} runs each later CRIU step in a Python of its own, without
    action/agent.py; {"read_ahead": false} leaves the file pages CRIU copies on
    write to its faults (file_pages.py); {"map_staging": true} maps the
    driver's staging from the pages file instead of writing it (gpu/staging.py;
    off: the driver restored from it 1.0-4x slower in a replica's restore,
    docs/benchmarks.md). Benchmarks compare."""

    enabled: bool = True
    threads: int = 0
    huge_pages: bool = True
    agent: bool = True
    read_ahead: bool = True
    map_staging: bool = False


SETTINGS = Path("/etc/gpusnap/page-fill.json")


def settings(path: Path | None = None) -> Settings:
    path = path or SETTINGS
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return Settings()
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: {exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("enabled", True), bool) \
            or not isinstance(data.get("threads", 0), int) or data.get("threads", 0) < 0 \
            or not isinstance(data.get("huge_pages", True), bool) \
            or not all(isinstance(data.get(k, True), bool)
                       for k in ("agent", "read_ahead", "map_staging")):
        raise ValueError(f'{path}: expected {{"enabled": true|false, "threads": N, '
                         f'"huge_pages": true|false, "agent": true|false, '
                         f'"read_ahead": true|false, "map_staging": true|false}}')
    return Settings(data.get("enabled", True), data.get("threads", 0),
                    data.get("huge_pages", True), data.get("agent", True),
                    data.get("read_ahead", True), data.get("map_staging", False))
