"""Files an interrupted export or import leaves behind, found for `gpusnap doctor`.

A killed CLI cannot tidy up: the export's hidden `.NAME.partial` and the FIFO
directories stay. They are never mistaken for a checkpoint (no archive has the
export's name), but they take space; doctor lists them and --fix removes them.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from gpusnap import journal
from gpusnap.runtime.fifo_pump import referenced
from gpusnap.runtime.stream import FIFO_DIR_PREFIX, FIFO_NAME, partial_path


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
