"""A restored copy's own hostname.

Podman gives a container started without --hostname the first 12 characters
of its ID as hostname (in its UTS namespace, /etc/hostname and /etc/hosts),
and a restore under a new --name keeps the checkpoint's: every replica of one
checkpoint would answer with the source container's hostname (bench/coldstart.py's
replicas, docs/benchmarks.md). A restored copy whose hostname is the one Podman
derived from the checkpointed container's ID gets the one Podman derives from
its own; a hostname the user chose (`podman run --hostname`) stays, as it does
for containers started from one spec. A process that read the hostname before
the checkpoint keeps what it read: only later reads see the new one.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from gpusnap import journal
from gpusnap.runtime.podman import Container

SHORT = 12  # Podman's hostname: the container ID's first 12 characters


def follow_new_id(ctr: Container, old_id: str) -> str | None:
    """Give ``ctr`` (just restored from a checkpoint of container ``old_id``, as
    Podman inspects it now) the hostname Podman derives from its own ID, where it
    had the old one derived. Returns the new hostname; None where it stays (chosen
    by the user, the same container, or it could not be changed: then the journal
    says why)."""
    old, new = old_id[:SHORT], ctr.id[:SHORT]
    if not old_id or old == new or ctr.pid <= 0:
        return None
    try:
        if not _swap_uts(ctr.pid, old, new):
            return None  # chosen by the user, or changed since: not Podman's derived one
        _rewrite(ctr.hostname_path, old, new)
        _rewrite(ctr.hosts_path, old, new)
    except (OSError, subprocess.SubprocessError) as exc:
        journal.record("hostname-kept", container=ctr.id, hostname=old, error=str(exc))
        return None
    return new


def _swap_uts(pid: int, old: str, new: str) -> bool:
    """The hostname in ``pid``'s UTS namespace set to ``new`` where it is ``old``
    (/proc/sys/kernel/hostname is per namespace of the reader): one nsenter, as
    it runs between the restore and the first request a replica answers."""
    script = ('[ "$(cat /proc/sys/kernel/hostname)" = "$1" ] || exit 3; '
              'printf %s "$2" > /proc/sys/kernel/hostname')
    res = subprocess.run(["nsenter", "--target", str(pid), "--uts", "--", "sh", "-c", script,
                          "sh", old, new], capture_output=True, text=True, timeout=10)
    if res.returncode == 3:
        return False
    if res.returncode != 0:
        raise subprocess.SubprocessError(f"nsenter: {res.stderr.strip() or res.returncode}")
    return True


def _rewrite(path: str | None, old: str, new: str) -> None:
    """Podman's /etc/hostname or /etc/hosts of the container (bind-mounted from the
    host), the old hostname replaced where it stands as a word."""
    if not path or not Path(path).is_file():
        return
    text = Path(path).read_text()
    changed = re.sub(rf"(?<![\w.-]){re.escape(old)}(?![\w.-])", new, text)
    if changed != text:
        Path(path).write_text(changed)
