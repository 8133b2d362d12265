"""Is a process's cgroup frozen? (CRIU and runc freeze it while dumping.)"""

from __future__ import annotations

from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def is_frozen(pid: int, root: Path = CGROUP_ROOT) -> bool:
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return False
    for line in lines:
        hier, controllers, path = line.split(":", 2)
        path = path.lstrip("/")
        if "freezer" in controllers.split(","):
            state = root / "freezer" / path / "freezer.state"
            if state.exists() and state.read_text().strip() != "THAWED":
                return True
        elif hier == "0":
            for base in (root / path, root / "unified" / path):
                events = base / "cgroup.events"
                if events.exists():
                    return "frozen 1" in events.read_text()
    return False
