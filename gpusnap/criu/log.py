"""CRIU's dump and restore logs."""

from __future__ import annotations

from pathlib import Path


def first_error(log: Path) -> str | None:
    """CRIU's first error line in a dump/restore log (the later ones are fallout)."""
    try:
        with open(log, errors="replace") as f:
            for line in f:
                if line.startswith("Error (") and "RLIMIT_NOFILE" not in line:
                    return line.strip()
    except OSError:
        pass
    return None
