"""A process's cgroup freezer: is it frozen, and thaw it. CRIU freezes the
container's cgroup while it dumps and thaws it when it ends; a CRIU that is
killed never does."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

CGROUP_ROOT = Path("/sys/fs/cgroup")


def _freezers(pid: int, root: Path) -> Iterator[Path]:
    """The freezer files of ``pid``'s cgroups: v1 freezer.state, v2 cgroup.freeze."""
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return
    for line in lines:
        hier, controllers, path = line.split(":", 2)
        path = path.lstrip("/")
        if "freezer" in controllers.split(","):
            yield root / "freezer" / path / "freezer.state"
        elif hier == "0":
            for base in (root / path, root / "unified" / path):
                if (base / "cgroup.events").exists():
                    yield base / "cgroup.freeze"
                    break


def is_frozen(pid: int, root: Path = CGROUP_ROOT) -> bool:
    for f in _freezers(pid, root):
        try:
            if f.name == "freezer.state":
                if f.read_text().strip() != "THAWED":
                    return True
            elif "frozen 1" in (f.parent / "cgroup.events").read_text():
                return True
        except OSError:
            continue
    return False


def thaw(pid: int, root: Path = CGROUP_ROOT) -> bool:
    """Thaw ``pid``'s cgroup; whether one was frozen."""
    thawed = False
    for f in _freezers(pid, root):
        try:
            if f.name == "freezer.state":
                if f.read_text().strip() != "THAWED":
                    f.write_text("THAWED")
                    thawed = True
            elif f.read_text().strip() != "0":
                f.write_text("0")
                thawed = True
        except OSError:
            continue
    return thawed
