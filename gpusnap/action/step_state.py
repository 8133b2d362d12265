"""Where one CRIU step leaves what a later step of the same CRIU reads: files
in the state folder's actions/, keyed by CRIU's pid (the action script starts
afresh at every step). A pid names one CRIU only: packaging/bin/criu-action
clears what a dead CRIU of the same pid left at a new one's first step
(``<pid>-born``: its start time).
"""

from __future__ import annotations

from pathlib import Path

from gpusnap import journal


def folder() -> Path:
    return journal.state_subdir("actions")


def ahead(criu_pid: int) -> Path:
    """pre-dump's memory read ahead of CRIU, for post-dump."""
    return folder() / f"{criu_pid}-ahead.json"


def fill(criu_pid: int) -> Path:
    """pre-restore's page fill plan, for post-restore."""
    return folder() / f"{criu_pid}-fill.json"


def restore(criu_pid: int) -> Path:
    """pre-restore's files kept for later, for post-resume."""
    return folder() / f"{criu_pid}-restore.json"
