"""CRIU's pages files written ahead on a target, so that a restore writes only what differs.

A restore of REF writes each big ``pages-N.img`` from chunks (the cache first)
before CRIU can read it: a large share of a pre-copy's stop, and of a
warm-cache replica's (docs/benchmarks.md), though the bytes are on the host
already. `gpusnap pull --prefetch REF` therefore
leaves the pages files of REF written out in a *prepared* folder (RAM where
pages/memory.py allows, else beside Podman's storage), with their chunk
lists in ``index.json``; a later restore compares its own chunk lists with it:

- the same file (a replica of REF): a hard link, nothing written; the
  prepared file stays for the next replica;
- at least half the bytes found in it, at the same offset or at another (the
  final round of a pre-copy: most of an inference job's pages file lies where
  round 1's had, or shifted by an early change, docs/benchmarks.md): the
  prepared folder is claimed (renamed, so one
  restore has it) and becomes CRIU's *parent* images folder: the final
  round's pagemap is rewritten so that pages round 1 holds at the same
  address are read from there, and only the rest is written
  (pages/parent_pages.py). Where that cannot be (a folder prepared without
  pagemaps, addresses that moved), chunks found elsewhere are moved within
  the file (page_patch.py), each file resized and only the rest fetched in
  place; never a file a replica's restore linked before the claim (that
  restore may still read it): written anew. The folder is gone afterwards;
- otherwise the file is written anew, as without a prepared folder.

Every way out of a failed claim or link (another restore took it, memory
pressure evicted it) falls back to writing anew. Prepared folders in RAM give
way, oldest first, to a push or restore that needs the memory (ram_dir).
Sealed (encrypted) checkpoints are not prepared: their chunks are opened in
the pulling process only.
"""

from __future__ import annotations

import errno
import fnmatch
import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from gpusnap import journal
from gpusnap.criu import pagemap
from gpusnap.pages import pages_aside
from gpusnap.oci import segments
from gpusnap.oci.bundle import Bundle, FileEntry
from gpusnap.pages import kept_pages, parent_pages
from gpusnap.pages.page_patch import Runs, bytes_held, layout, patch_in_place, plan_patch
from gpusnap.pages import memory
from gpusnap.runtime.storage import PULL_PREFIX, storage_root

PREFIX = "gpusnap-prepared-"
INDEX = "index.json"
PARENT_ENV = "GPUSNAP_PAGES_PARENT"  # =0: patch the prepared file instead (benchmarks compare)
NEAR = 0.5  # share of the bytes a patch must find in the prepared file to beat writing anew

def big_pages(bundle: Bundle) -> list[FileEntry]:
    """The pages files a restore writes beside Podman's import (ops/pull.write_files)."""
    return [f for f in bundle.files if f.type == "file" and pages_aside.is_pages(f.path)
            and segments.worth_fetching(f.size)]


def pagemaps(bundle: Bundle) -> list[FileEntry]:
    """The tasks' pagemap images: kept in a prepared folder, so that a later
    round's restore can read it as CRIU's parent (pages/parent_pages.py)."""
    return [f for f in bundle.files if f.type == "file" and f.path.startswith("checkpoint/")
            and fnmatch.fnmatch(f.path.rpartition("/")[2], pages_aside.PAGEMAP_PATTERN)]


def roots(graph_root: Path | None = None) -> list[Path]:
    """Where prepared folders may lie: the RAM roots, and beside Podman's
    storage (``graph_root`` where the caller knows it, else Podman is asked)."""
    root = graph_root or storage_root()
    return [r for r in (*memory.roots(), root.parent if root else None) if r and r.is_dir()]


def folders(where: list[Path] | None = None) -> list[Path]:
    """Complete prepared folders (their index written last), oldest first."""
    found = []
    for root in where if where is not None else roots():
        try:
            found += [p for p in root.glob(PREFIX + "*") if (p / INDEX).is_file()]
        except OSError:
            continue
    return sorted(found, key=lambda p: memory.mtime(p / INDEX))


def _age(folder: Path) -> float:
    """When a prepared folder was completed (its index), or a kept one made."""
    return memory.mtime(folder / INDEX) if (folder / INDEX).exists() else memory.mtime(folder)


def _index(folder: Path) -> dict:
    try:
        return json.loads((folder / INDEX).read_text())
    except (OSError, ValueError):
        return {}


@dataclass
class Match:
    """The prepared folder a restore reads from, and how: ``exact`` (link its
    files) or a patch (claim the folder, then write ``runs`` per file)."""
    folder: Path
    exact: bool
    layouts: dict[str, list[tuple[str, int]]]
    same_bytes: int
    # the prepared file each of the restore's files is made from: CRIU numbers
    # pages-N.img by task, and a child process more or less renumbers them
    sources: dict[str, str] = field(default_factory=dict)
    claimed: Path | None = None
    reused: int = 0
    used: list[str] = field(default_factory=list)
    failed: str | None = None  # why a file of it could not be used (written anew)
    # pages file -> its plan against the claimed folder as CRIU's parent (parent_plans)
    plans: dict[str, parent_pages.Plan] = field(default_factory=dict)

    @property
    def root(self) -> Path:
        return self.folder.parent


def best(bundle: Bundle, where: list[Path] | None = None) -> Match | None:
    """The prepared folder that spares a restore of ``bundle`` the most writing:
    one holding its very files, else the one whose files hold the most of its
    bytes, in place or to be moved (at least NEAR of them); None where none helps."""
    entries = big_pages(bundle)
    total = sum(f.size for f in entries)
    if not total:
        return None
    top: Match | None = None
    for folder in folders(where):
        layouts = {k: layout(v) for k, v in _index(folder).get("files", {}).items()}
        same = exact = 0
        sources: dict[str, str] = {}
        for f in entries:
            new = layout(f.chunks)
            twin = next((k for k, old in layouts.items() if old == new), None)
            if twin is not None:
                exact += f.size
                same += f.size
                sources[f.path] = twin
                continue
            scores = {k: plan_patch(f.chunks, old) for k, old in layouts.items()
                      if k not in sources.values()}
            pick = max(scores, key=lambda k: bytes_held(scores[k]), default=None)
            if pick is not None and bytes_held(scores[pick]):
                same += bytes_held(scores[pick])
                sources[f.path] = pick
        match = Match(folder, exact == total, layouts, same, sources=sources)
        if match.exact:
            return match
        if same >= NEAR * total and (top is None or same > top.same_bytes):
            top = match
    return top


def claim(match: Match) -> bool:
    """A patch's folder renamed to one of this restore's own (a pull folder: a
    killed restore's is found by doctor); False: another restore or an eviction
    took it first."""
    if match.exact:
        return True
    claimed = match.root / f"{PULL_PREFIX}claimed-{match.folder.name}-{os.getpid()}"
    try:
        os.rename(match.folder, claimed)
    except OSError:
        return False
    match.claimed = claimed
    return True


def use(match: Match, entry: FileEntry, path: Path) -> Runs | None:
    """``entry``'s prepared file put at ``path`` (a link, or the claimed file
    moved there and resized); the runs still to write into it in place.
    None: write it anew (no such file, or it went away)."""
    source = match.sources.get(entry.path)
    if source is None or match.plans:
        return None  # (a parent folder stays whole: CRIU reads it, nothing moves out)
    old, name = match.layouts[source], source.rpartition("/")[2]
    try:
        if match.exact:
            os.link(match.folder / name, path)
            runs: Runs = []
        elif match.claimed is not None:
            if os.stat(match.claimed / name).st_nlink != 1:
                # linked by a replica's restore before the claim: its CRIU, fill
                # or mapped staging may still read these bytes, so none move
                raise OSError(errno.EMLINK, "linked by another restore")
            os.rename(match.claimed / name, path)
            runs = patch_in_place(path, entry, old)
        else:
            return None
    except OSError as exc:
        match.failed = f"{name}: {exc.strerror or exc}"
        return None
    written = sum(c.size for _, run in runs for c in run)
    match.reused += entry.size - written
    match.used.append(entry.path)
    return runs


def report(match: Match | None) -> dict | None:
    """What a restore took from a prepared folder, for --json."""
    if match is None or not match.used:
        return None
    how = "linked" if match.exact else "parent" if match.plans else "patched"
    return {"folder": str(match.folder), "how": how, "files": len(match.used),
            "bytes_reused": match.reused}


def parent_plans(match: Match, bundle: Bundle, final: dict[str, bytes]) -> bool:
    """Plan every pages file of ``bundle`` whose task has a pagemap in the claimed
    folder against it as CRIU's parent (``final``: the bundle's pagemap images
    by path). Taken (True) where the parent then holds at least NEAR of the
    pages; else the folder is patched (page_patch.py). A folder prepared without
    pagemaps, or images that do not parse, are patched too."""
    if match.exact or match.claimed is None or os.environ.get(PARENT_ENV, "1") == "0":
        return False
    files = {f.path: f for f in big_pages(bundle)}
    plans: dict[str, parent_pages.Plan] = {}
    try:
        for path, image in final.items():
            name = path.rpartition("/")[2]
            mine = pagemap.parse(image)
            entry = files.get(f"checkpoint/{mine.pages_file}")
            if entry is None or not (match.claimed / name).is_file():
                continue
            theirs = pagemap.parse((match.claimed / name).read_bytes())
            parent_file = theirs.pages_file  # round 1's numbering may differ
            old = match.layouts.get(f"checkpoint/{parent_file}")
            if old is None or not (match.claimed / parent_file).is_file():
                continue
            plan = parent_pages.plan(entry.chunks, old, mine, theirs)
            plan.pagemap_path = path
            plans[entry.path] = plan
    except (OSError, pagemap.ImageError) as exc:
        journal.record("prepared-parent-refused", folder=str(match.folder), error=str(exc))
        return False
    total = sum(f.size for f in files.values())
    if not plans or sum(p.parent_bytes for p in plans.values()) < NEAR * total:
        return False
    match.plans = plans
    return True


def rewritten(match: Match | None, path: str) -> bytes | None:
    """The pagemap image a restore hands CRIU instead of the bundle's ``path``."""
    if match is None:
        return None
    return next((p.pagemap for p in match.plans.values() if p.pagemap_path == path), None)


def write_parent(match: Match, entry: FileEntry, path: Path, fetch_pool,
                 check=lambda: None, mapped: bool = False) -> int:
    """``entry``'s pages that its parent lacks, compacted into ``path``; the
    folder of ``path`` names the parent (bring_back links it for CRIU). The
    chunks that hold them go into a sparse scratch file at their own offsets
    first (worker processes, cache first). Bytes written."""
    plan = match.plans[entry.path]
    link = path.parent / pages_aside.PARENT
    if not os.path.lexists(link):
        os.symlink(match.claimed, link)
    scratch = path.with_name(f".{path.name}.scratch")
    fd = os.open(scratch, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        os.ftruncate(fd, entry.size)
    finally:
        os.close(fd)
    try:
        written = fetch_pool.patch_file(plan.runs, scratch, check, mapped)
        parent_pages.compact(scratch, path, plan.own)
    finally:
        scratch.unlink(missing_ok=True)
    os.chmod(path, 0o600)
    match.reused += plan.parent_bytes
    match.used.append(entry.path)
    return written


def explain(bundle: Bundle, where: list[Path] | None, match: Match | None) -> str | None:
    """Why a restore took nothing from a prepared folder (--json), None where it did:
    a prefetch that did not help should say why, not leave the user guessing."""
    if match is not None and match.used:
        return None
    if match is not None:
        return match.failed or "the prepared folder's files could not be taken (written anew)"
    total = sum(f.size for f in big_pages(bundle))
    if not total:
        return "no pages file big enough to prepare"
    found = folders(where)
    if not found:
        return "no prepared folder on this host (gpusnap pull --prefetch REF makes one)"
    shares = []
    for folder in found:
        layouts = [layout(v) for v in _index(folder).get("files", {}).values()]
        held = sum(max((bytes_held(plan_patch(f.chunks, old)) for old in layouts), default=0)
                   for f in big_pages(bundle))
        shares.append(held / total)
    return (f"{len(found)} prepared folder(s), holding at most {max(shares):.0%} of its "
            f"pages ({NEAR:.0%} needed), or taken by another restore first")


def drop_rounds(repository: str, where: list[Path] | None = None) -> list[Path]:
    """After a restore from ``repository``: the prepared folders of its
    pre-checkpoints (a pre-copy's round 1, whose final round is restored now:
    patched from them, or too changed to be) are of no further use."""
    dropped = []
    for folder in folders(where):
        index = _index(folder)
        if index.get("pre_checkpoint") and index.get("repository") == repository:
            shutil.rmtree(folder, ignore_errors=True)
            dropped.append(folder)
    return dropped


def release(match: Match | None, untouched: bool = False) -> None:
    """After the restore: a claimed folder is spent (what is left of it goes).
    ``untouched``: the restore failed before any of its files moved (the
    registry unreachable, say): it goes back under its name for the next try."""
    if match is None or match.claimed is None:
        return
    if untouched:
        try:
            os.rename(match.claimed, match.folder)
            match.claimed = None
            return
        except OSError:
            pass  # its name taken again meanwhile: spent after all
    shutil.rmtree(match.claimed, ignore_errors=True)


def evict_for(size: int, held_too: int = 0) -> Path | None:
    """memory.ram_dir, after dropping prepared folders and a pre-copy's kept
    pages (kept_pages.py) in RAM, oldest first, for as long as they stand in
    its way (a push or restore needs the memory more than pages kept for a
    round that may never come)."""
    ram = memory.ram_dir(size, held_too)
    if ram is not None or os.environ.get(memory.ENV) == "0":
        return ram
    in_ram = [r for r in memory.roots() if r.is_dir()]
    evictable = sorted(folders(in_ram) + kept_pages.folders(tuple(in_ram)), key=_age)
    short = memory.shortfall(size, held_too)
    if short is None or short > sum(memory.folder_bytes(f) for f in evictable):
        return None  # dropping them all would not make the room (others' holds, say): all kept
    for folder in evictable:
        freed = memory.folder_bytes(folder)
        shutil.rmtree(folder, ignore_errors=True)
        journal.record("prepared-evicted", folder=str(folder), bytes=freed)
        ram = memory.ram_dir(size, held_too)
        if ram is not None:
            return ram
    return None


def prepare(bundle: Bundle, digest: str, fetch_pool, where: Path | None = None, *,
            repository: str = "", pre_checkpoint: bool = False,
            pagemaps: dict[str, bytes] | None = None) -> dict | None:
    """Write ``bundle``'s big pages files into a prepared folder with their chunk
    lists (``fetch_pool``: a segments.FetchPool; its chunks are in the cache by
    now). ``where``: the root (default: RAM if the host can hold the files and
    the process restored from them, else beside Podman's storage if it has the
    room, else nothing is prepared). Idempotent; a killed run leaves a pull
    folder doctor removes."""
    entries = big_pages(bundle)
    size = sum(f.size for f in entries)
    if not entries:
        return None
    name = PREFIX + digest.partition(":")[2][:16]
    for folder in folders():
        if folder.name == name:
            os.utime(folder / INDEX)  # recently wanted: evicted last
            return {"folder": str(folder), "bytes": size, "in_ram": memory.in_ram(folder),
                    "seconds": 0.0}
    root = where or evict_for(size, held_too=size) or _beside_storage(size)
    if root is None:
        return None
    start = time.monotonic()
    work = root / f"{PULL_PREFIX}{name}-{os.getpid()}"
    work.mkdir(mode=0o700)
    memory.hold_folder(work)
    try:
        mapped = memory.in_ram(work)
        for f in entries:
            fetch_pool.write_file(f.chunks, pages_aside.path_in(work, f), mapped=mapped)
        kept = {pages_aside.path_in(work, f).name for f in entries}
        for path, image in (pagemaps or {}).items():
            # only a task whose pages are here: CRIU would find no pages file for another
            if _pages_file(image) in kept:
                (work / path.rpartition("/")[2]).write_bytes(image)
        (work / INDEX).write_text(json.dumps({
            "digest": digest, "created": time.time(), "repository": repository,
            "pre_checkpoint": pre_checkpoint,
            "files": {f.path: [[c.digest, c.size] for c in f.chunks] for f in entries}}))
        if not mapped:
            _sync(work)  # on the disk before its name says it is whole (a crash: holes read as zeros)
        os.rename(work, root / name)
        if not mapped:
            _sync(root, files=False)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return {"folder": str(root / name), "bytes": size, "in_ram": memory.in_ram(root),
            "seconds": round(time.monotonic() - start, 3)}


def _sync(folder: Path, files: bool = True) -> None:
    """fsync ``folder``'s regular files (``files``), then the folder itself."""
    paths = [p for p in folder.iterdir() if p.is_file() and not p.is_symlink()] if files else []
    for path in (*paths, folder):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


KEEP_ENV = "GPUSNAP_KEEP_PAGES"  # auto (default): within KEEP_SHARE of RAM; 0: never; 1: if it fits
KEEP_SHARE = 4  # kept pages, all prepared folders in RAM together, stay under 1/KEEP_SHARE of it


def keep(bundle: Bundle, digest: str, folder: Path, *, repository: str = "",
         info: dict[str, int] | None = None) -> dict | None:
    """After a restore that wrote ``bundle``'s pages files anew into ``folder``
    (RAM): the folder kept as the prepared folder of ``digest`` (its files
    named, sized and indexed as prepare() would), so that the next replica on
    this host links them instead of writing them again from the cache
    (seconds of its stop: docs/benchmarks.md). Only while all prepared folders in RAM stay
    under a quarter of it and the host could still restore one more
    (memory.ram_dir); they give way to pushes and restores like a prefetch's.
    None: not kept (the caller discards the folder)."""
    mode = os.environ.get(KEEP_ENV, "auto")
    entries = big_pages(bundle)
    if mode == "0" or not entries or not memory.in_ram(folder):
        return None
    paths = {f.path: pages_aside.path_in(folder, f) for f in entries}
    if any(not paths[f.path].is_file() or paths[f.path].stat().st_size != f.size
           for f in entries):
        return None  # not whole: linked or patched from elsewhere, or cut short
    size = sum(f.size for f in entries)
    name = PREFIX + digest.partition(":")[2][:16]
    info = memory.meminfo() if info is None else info
    held = sum(memory.folder_bytes(f) for f in folders([r for r in memory.roots() if r.is_dir()]))
    if mode != "1" and (held + size) * KEEP_SHARE > info.get("MemTotal", 0):
        return None
    if memory.ram_dir(size, info=info, root=folder.parent, hold=False) is None:  # the pages are in it already
        return None
    for other in folder.iterdir():  # only the pages files a replica links
        if other in paths.values():
            continue
        if other.is_dir() and not other.is_symlink():
            shutil.rmtree(other)
        else:
            other.unlink()
    (folder / INDEX).write_text(json.dumps({
        "digest": digest, "created": time.time(), "repository": repository,
        "pre_checkpoint": False, "kept_by_restore": True,
        "files": {f.path: [[c.digest, c.size] for c in f.chunks] for f in entries}}))
    try:
        os.rename(folder, folder.parent / name)  # fails where a replica beside kept its own
    except OSError:
        return None
    kept = folder.parent / name
    journal.record("pages-kept", folder=str(kept), bytes=size)
    return {"folder": str(kept), "bytes": size, "in_ram": True}


def _pages_file(image: bytes) -> str | None:
    try:
        return pagemap.parse(image).pages_file
    except pagemap.ImageError:
        return None


def _beside_storage(size: int) -> Path | None:
    root = storage_root()
    near = root.parent if root else None
    if near is not None and near.is_dir() and shutil.disk_usage(near).free >= 2 * size:
        return near  # twice: the restore's own copies need the room too
    return None
