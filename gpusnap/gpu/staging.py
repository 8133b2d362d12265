"""The driver's staging: the host memory a checkpointed CUDA process holds its GPU memory in.

At the dump, pre-dump records where the driver's checkpoint put it in each
task (``record``: a file beside the GPU manifest, by the task's pid in the
images). At a restore that asks for it (page-fill.json's map_staging, off:
the driver restored slower from the mapping, docs/benchmarks.md),
pre-restore leaves those pages out of CRIU's restore (pages/fill_plan.py)
and post-resume maps them from the pages file (pages/remote_map.py): the
driver reads them once, at its restore, and then unmaps them.

Between post-restore and that mapping a restored process's staging is empty.
``hold`` marks such a process (by host pid and start time) with the runs
still to map; ``quiesce.resume`` refuses a marked process (a driver restore
would bring back zeros) and post-resume ``release``s it once mapped.
"""

from __future__ import annotations

import json
from pathlib import Path

from gpusnap import journal
from gpusnap.private import write_private
from gpusnap.procs import process_tree, start_time

NAME = "gpusnap-staging.json"  # in CRIU's images, beside the GPU manifest
Runs = list[tuple[int, int, str, int]]  # (address, length, pages file, offset)


def record(image_dir: str | Path, staging: dict[tuple[int, int], list[tuple[int, int]]]) -> None:
    """Each task's staging ranges (start, end), by (host pid, its pid in the images)."""
    ranges = {str(vpid): [[a, b] for a, b in r] for (_, vpid), r in sorted(staging.items()) if r}
    if ranges:
        write_private(Path(image_dir) / NAME, json.dumps({"tasks": ranges}))


def forget(image_dir: str | Path) -> None:
    """No record left from an earlier dump into the same folder."""
    (Path(image_dir) / NAME).unlink(missing_ok=True)


def recorded(folder: Path) -> dict[int, list[tuple[int, int]]]:
    """What ``record`` wrote in an images folder; {} where it did not (a CPU
    dump, CRIU's CUDA plugin, an older gpusnap). A file that cannot be read
    is no staging: its pages are then written as any others."""
    try:
        data = json.loads((folder / NAME).read_text())
        return {int(vpid): sorted((int(a), int(b)) for a, b in ranges)
                for vpid, ranges in data["tasks"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


def _folder() -> Path:
    return journal.state_subdir("staging")


def _marker(pid: int) -> Path:
    return _folder() / f"{pid}.json"


def hold(pid: int, runs: Runs) -> None:
    """Process ``pid``'s staging is empty until ``runs`` are mapped."""
    write_private(_marker(pid), json.dumps({"start": start_time(pid), "runs": runs}))


def held(pid: int) -> Runs | None:
    """The runs still to map into ``pid``, None where it has none (or the marker
    is another process's, long gone, whose pid this one took); [] where the
    marker cannot be read: still held, nothing known to map."""
    try:
        data = json.loads(_marker(pid).read_text())
        if data["start"] != start_time(pid):
            return None
        return [(int(a), int(n), str(p), int(o)) for a, n, p, o in data["runs"]]
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError):  # unreadable: held, with nothing to map
        return []


def held_in(pids: list[int]) -> dict[int, Runs]:
    """The runs still to map, of each of ``pids`` that has some."""
    return {pid: runs for pid in pids if (runs := held(pid)) is not None}


def held_under(init_pid: int) -> dict[int, Runs]:
    """``held_in`` of the container whose init is ``init_pid``: the marks are
    listed first, so a restore that mapped nothing (the default) does not walk
    the host's process table on its way to the driver."""
    marked = [int(p.stem) for p in _folder().glob("*.json") if p.stem.isdigit()]
    if not marked:
        return {}
    tree = set(process_tree(init_pid))
    return held_in([pid for pid in marked if pid in tree])


def release(pid: int) -> None:
    _marker(pid).unlink(missing_ok=True)
