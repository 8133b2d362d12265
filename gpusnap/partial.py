"""Files written whole or not at all: an export, a pull, an archive are written
under a hidden partial name and renamed once complete; and the words for the
one failure every writer meets, a full disk."""

from __future__ import annotations

import os
from pathlib import Path

DISK_FULL = "No space left on device"  # strerror(ENOSPC), as zstd and Podman print it


def partial_path(dest: Path) -> Path:
    """Where ``dest`` is written until it is complete."""
    return dest.with_name(f".{dest.name}.partial")


def disk_full(dest: Path) -> str:
    return f"the disk is full ({DISK_FULL} in {dest.parent})"


FULL_BELOW = 16 << 20  # free bytes (root's reserve included) under which a write fails soon


def full_at(folder: Path) -> str:
    """disk_full's words where the filesystem of ``folder`` has (almost) no room
    left, "" where it has room or cannot be asked: for a failure whose own
    words do not say (CRIU's log ends where its writes began to fail)."""
    try:
        st = os.statvfs(folder)
    except OSError:
        return ""
    return disk_full(folder / "-") if st.f_bfree * st.f_frsize < FULL_BELOW else ""
