"""Files written whole or not at all: an export, a pull, an archive are written
under a hidden partial name and renamed once complete; and the words for the
one failure every writer meets, a full disk."""

from __future__ import annotations

from pathlib import Path

DISK_FULL = "No space left on device"  # strerror(ENOSPC), as zstd and Podman print it


def partial_path(dest: Path) -> Path:
    """Where ``dest`` is written until it is complete."""
    return dest.with_name(f".{dest.name}.partial")


def disk_full(dest: Path) -> str:
    return f"the disk is full ({DISK_FULL} in {dest.parent})"
