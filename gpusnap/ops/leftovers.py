"""Files an interrupted export or import leaves behind, found for `gpusnap doctor`.

A killed CLI cannot tidy up: the export's hidden `.NAME.partial` and the FIFO
directories stay. They are never mistaken for a checkpoint (no archive has the
export's name), but they take space; doctor lists them and --fix removes them.
A killed push or `restore REF` leaves its staging directory (`.gpusnap-push-*`,
`.gpusnap-pull-*`) the same way. One thing is not litter: what a killed
`push CTR`/`migrate` staged is all that is left of the container it stopped
(its folder is marked so before the dump); `kept()` names it and nothing removes it. Nor is the folder of a
background upload whose process still runs (ops/uploads.py): it may rest
between reads longer than a foreground push does. A pre-copy's round-1 pages
kept in RAM (pages/kept_pages.py) are listed once older than their bound.
"""

from __future__ import annotations

import json
import contextlib
import os
import shutil
import tempfile
import time
from pathlib import Path

from gpusnap import journal
from gpusnap.oci.segments import FETCH_PREFIX, SCRATCH_ROOTS
from gpusnap.ops import uploads
from gpusnap.ops.push_source import ONLY_COPY, push_again_words
from gpusnap.pages import kept_pages, memory, pages_aside
from gpusnap.runtime.fifo_pump import referenced
from gpusnap.runtime.kept_checkpoint import KEPT_NAME
from gpusnap.runtime.storage import PULL_PREFIX, PUSH_PREFIX, TRASH_PREFIX, storage_root
from gpusnap.partial import partial_path
from gpusnap.runtime.stream import FIFO_DIR_PREFIX, FIFO_NAME


STAGING_PREFIXES = (PUSH_PREFIX, PULL_PREFIX, TRASH_PREFIX)
# A live push or pull holds a file in its staging directory open, except for a
# moment between steps (checks before the export; after the download, before
# Podman names the archive): one untouched this long is not in use.
STAGING_IDLE_S = 10


def _staging_roots() -> set[Path]:
    root = storage_root()
    return {d for d in (root.parent if root else None, Path("/var/tmp"), *memory.roots())
            if d and d.is_dir()}


def staging_folders() -> list[Path]:
    """Every push, pull and trash staging folder there is now, live or not."""
    return [work for d in sorted(_staging_roots())
            for work in sorted(w for prefix in STAGING_PREFIXES for w in d.glob(prefix + "*"))]


def _busy(work: Path) -> bool:
    """A process names ``work`` on its command line or has a file in it open."""
    if referenced(str(work)):
        return True
    inside = str(work) + "/"
    for fd_dir in Path("/proc").glob("[0-9]*/fd"):
        try:
            for fd in os.scandir(fd_dir):
                if os.readlink(fd.path).startswith(inside):
                    return True
        except OSError:
            continue
    return False


def kept() -> list[dict]:
    """What a killed push left that is all there is of a container it stopped:
    {container, export, again, back, folder, holds}. Its folder's mark says so
    (ops/push_source); a journal line, for a folder from before marks (kept
    while the journal has it)."""
    found, seen = [], set()
    live = uploads.live_work_dirs()

    def add(work: Path, export: Path, entry: dict) -> None:
        if work in seen or work in live or not export.exists() or _busy(work):
            return
        seen.add(work)
        again = entry.get("again", f"`{push_again_words(str(export))}`")
        found.append({"container": entry.get("container"), "export": str(export),
                      "again": again, "folder": str(work), "holds": entry.get("holds") or [],
                      "back": entry.get("back") or f"`gpusnap restore {export}` (once "
                      "the container of that name is removed)"})

    for work in staging_folders():
        if not work.name.startswith(PUSH_PREFIX):
            continue
        try:
            mark = json.loads((work / ONLY_COPY).read_text())
        except (OSError, ValueError):
            continue
        if isinstance(mark, dict) and mark.get("export"):
            add(work, Path(mark["export"]), mark)
    for event in journal.read(500):
        export = Path(event.get("export") or "")
        if event.get("event") == "checkpointed" and not event.get("leave_running") and \
                export.parent.name.startswith(PUSH_PREFIX) and export.is_file():
            add(export.parent, export, event)
    return found


def linked_from_checkpoints() -> set[Path]:
    """Staging folders holding the pages of a container's local checkpoint (a
    push killed after its dump: pages/pages_aside.py), or of one a failed
    restore kept (runtime/kept_checkpoint.py): the only copy, kept."""
    root = storage_root()
    if root is None:
        return set()
    found = set()
    for userdata in root.glob("*-containers/*/userdata"):
        for link in [*userdata.glob(f"checkpoint/{pages_aside.PATTERN}"),
                     *userdata.glob(f"{KEPT_NAME}/checkpoint/{pages_aside.PATTERN}")]:
            if link.is_symlink():
                # a relative link (pre-restore's, across filesystems) was made in
                # userdata/checkpoint, also for the kept copy of that folder
                target = os.path.normpath(userdata / "checkpoint" / os.readlink(link))
                folder = pages_aside.staging_folder(target)
                if folder is not None:
                    found.add(folder)
        for parent in (userdata / "checkpoint" / pages_aside.PARENT,
                       userdata / KEPT_NAME / "checkpoint" / pages_aside.PARENT):
            # a final round's pages its pagemap leaves to round 1's folder: a link
            # made in userdata/checkpoint (the kept copy's too) between real paths
            with contextlib.suppress(OSError):  # gone meanwhile
                target = userdata / "checkpoint" / os.readlink(parent)
                found.add(Path(os.path.realpath(target)))
    return found


def find() -> list[Path]:
    """Partial archives and unused FIFO dirs near recent exports and in the temp dir."""
    dirs = {Path(tempfile.gettempdir())}
    partials = set()
    for event in journal.read(500):
        if event.get("event") == "export-started" and event.get("export"):
            export = Path(event["export"])
            dirs.add(export.parent)
            partials.add(partial_path(export))
    found = [p for p in sorted(partials) if p.is_file()]
    for d in sorted(dirs):
        for work in d.glob(FIFO_DIR_PREFIX + "*"):
            if work.is_dir() and not referenced(str(work / FIFO_NAME)):
                found.append(work)
    keep = {Path(f) for k in kept() for f in [k["folder"], *k["holds"]]} | \
        linked_from_checkpoints() | uploads.live_work_dirs()
    scratch = [w for root in SCRATCH_ROOTS for w in sorted(root.glob(FETCH_PREFIX + "*"))]
    for work in staging_folders() + scratch:  # a killed pull's fetch scratch, in RAM
        try:
            idle = time.time() - work.stat().st_mtime >= STAGING_IDLE_S
        except OSError:
            continue
        if idle and work.is_dir() and work not in keep and not _busy(work):
            found.append(work)
    found += kept_pages.stale()  # a pre-copy's round 1 whose final round never came
    # A partial still being written belongs to a live export: leave it.
    return [p for p in found if not (p.suffix == ".partial" and referenced(str(p)))]


def remove(paths: list[Path]) -> list[str]:
    removed = []
    for p in paths:
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
        removed.append(str(p))
    return removed
