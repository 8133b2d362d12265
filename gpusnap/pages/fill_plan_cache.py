"""Fill plans kept by the content of the images they were made from.

Every replica of one checkpoint hands CRIU the same mm and pagemap images, and
fill_plan's parse, plan and new images of a GPU process (~12,000 pagemap
entries, thousands of memory areas) take most of pre-restore's time in CRIU's
stop. So the plan and the images rewrite() wrote are kept under a key that
hashes everything plan() and rewrite() read of the folder (each mm and pagemap
image whole, the driver's staging record, the pages files' names), the
settings and the source of the modules that plan (a gpusnap upgraded without
a reboot plans afresh): a folder with the same key gets the same plan, its
page files resolved in that folder. A folder with a ``parent`` is never kept
(its runs lie in other folders), nor is a folder nothing was planned for.

    <state>/fill-plans/<key>/
      plan.json           the plan, each task's pages file by name, each
                          image's sha256 (one cut short is never used)
      pagemap-<vpid>.img  the new images rewrite() wrote
      mm-<vpid>.img

Only ever a speed-up: what cannot be read or written here is planned afresh.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from gpusnap.gpu.staging import NAME as STAGING
from gpusnap.pages.page_fill import Run
from gpusnap.private import write_private

FOLDER = "fill-plans"  # in the state folder
PLAN = "plan.json"
KEEP = 8  # checkpoints whose replicas start here; older plans go
# what makes a plan of the images: a change to any of them is another key
PLANNING = ("gpusnap.pages.fill_plan", "gpusnap.pages.fill_plan_cache", "gpusnap.pages.page_fill",
            "gpusnap.criu.mm", "gpusnap.criu.pagemap", "gpusnap.criu.images",
            "gpusnap.proto.wire", "gpusnap.gpu.staging")


def key(folder: Path, settings: tuple) -> str | None:
    """The hash of what planning reads of ``folder`` (a real path) and of
    ``settings`` (fill_plan's parameters); None for a folder with a parent, or
    one that cannot be read (then plan() says why)."""
    try:
        return None if os.path.lexists(folder / "parent") else _hashed(folder, settings)
    except OSError:
        return None


def _hashed(folder: Path, settings: tuple) -> str:
    h = hashlib.sha256(repr(settings).encode())
    for module in PLANNING:
        h.update(Path(importlib.import_module(module).__file__ or "").read_bytes())
    for name in sorted(os.listdir(folder)):
        if not name.endswith(".img") and name != STAGING:
            continue
        path = folder / name
        if name.startswith("pages-"):
            h.update(b"P" + name.encode() + b"\0")  # rewrite() numbers its new file after them
        elif name.startswith(("mm-", "pagemap-")) or name == STAGING:
            data = path.read_bytes()
            h.update(b"L" if path.is_symlink() else b"F")
            h.update(name.encode() + b"\0" + len(data).to_bytes(8, "little") + data)
    return h.hexdigest()


def load(root: Path, name: str, folder: Path) -> tuple[dict, dict[str, bytes]] | None:
    """The plan kept under ``name`` for ``folder``: (tasks, huge, mapped as
    fill_plan.Plan takes them, with runs in ``folder``'s pages files) and the
    new images by file name; None where none is kept or it cannot be read."""
    here = root / name
    if not here.is_dir():
        return None
    try:
        data = json.loads((here / PLAN).read_text())
        pages = {int(v): os.path.realpath(folder / p) for v, p in data["pages"].items()}

        def runs(table: dict) -> dict[int, list[Run]]:
            return {int(v): [Run(a, n, pages[int(v)], off) for a, n, off in rs]
                    for v, rs in table.items()}
        plan = {"tasks": runs(data["tasks"]), "mapped": runs(data["mapped"]),
                "huge": {int(v): [(a, b) for a, b in areas] for v, areas in data["huge"].items()}}
        images = {n: (here / n).read_bytes() for n in data["images"]}
        if any(hashlib.sha256(b).hexdigest() != data["images"][n] for n, b in images.items()):
            raise ValueError("a kept image differs from its hash")
        os.utime(here)  # kept longest: the checkpoints replicas start from now
    except (OSError, ValueError, KeyError, TypeError):
        # Cut short (a crash before it reached the disk), damaged or a file gone: planned afresh,
        # and dropped, so that this plan's store can take its place.
        shutil.rmtree(here, ignore_errors=True)
        return None
    return plan, images


def store(root: Path, name: str, tasks: dict, huge: dict, mapped: dict,
          pages: dict[int, str], images: dict[str, bytes]) -> None:
    """Keep a plan (runs as fill_plan.Run, ``pages``: each task's pages file
    name) and its new images under ``name``; the oldest beyond KEEP go."""
    def table(runs: dict) -> dict:
        return {str(v): [[r.address, r.length, r.offset] for r in rs] for v, rs in runs.items()}
    try:
        root.mkdir(mode=0o700, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".new-", dir=root))
        try:
            for n, data in images.items():
                write_private(tmp / n, data)
            write_private(tmp / PLAN, json.dumps({
                "tasks": table(tasks), "mapped": table(mapped),
                "huge": {str(v): areas for v, areas in huge.items()},
                "pages": {str(v): p for v, p in pages.items()},
                "images": {n: hashlib.sha256(b).hexdigest() for n, b in images.items()}}))
            os.rename(tmp, root / name)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)  # kept already (another restore), or no room
            return
        kept = sorted(root.iterdir(), key=lambda p: p.stat().st_mtime)
        for old in [p for p in kept if not p.name.startswith(".")][:-KEEP] + \
                [p for p in kept if p.name.startswith(".") and p.stat().st_mtime < time.time() - 600]:
            shutil.rmtree(old, ignore_errors=True)  # and what a killed store left
    except OSError:
        return
