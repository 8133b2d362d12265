"""A restored copy's own hostname.

Podman gives a container started without --hostname the first 12 characters
of its ID as hostname (in its UTS namespace, /etc/hostname and /etc/hosts),
and a restore under a new --name keeps the checkpoint's: every replica of one
checkpoint answered with the source container's hostname (bench/coldstart.py's
replicas, docs/benchmarks.md). A restored copy whose hostname is the one Podman
derived from the checkpointed container's ID gets the one Podman derives from
its own; a hostname the user chose (`podman run --hostname`) stays, as it does
for containers started from one spec. A process that read the hostname before
the checkpoint keeps what it read: only later reads see the new one.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

from gpusnap import journal
from gpusnap.runtime.podman import podman_binary

SHORT = 12  # Podman's hostname: the container ID's first 12 characters


def follow_new_id(name: str, old_id: str) -> str | None:
    """Give ``name`` (just restored from a checkpoint of container ``old_id``) the
    hostname Podman derives from its own ID, where it had the old one derived.
    Returns the new hostname; None where it stays (chosen by the user, the same
    container, or it could not be changed: then the journal says why)."""
    res = subprocess.run([podman_binary(), "container", "inspect", name],
                         capture_output=True, text=True)
    if res.returncode != 0 or not old_id:
        return None
    data = json.loads(res.stdout)[0]
    old, new = old_id[:SHORT], data["Id"][:SHORT]
    pid = int((data.get("State") or {}).get("Pid") or 0)
    if old == new or pid <= 0:
        return None
    try:
        if _uts(pid) != old:
            return None  # chosen by the user, or changed since: not Podman's derived one
        _uts(pid, new)
        _rewrite(data.get("HostnamePath"), old, new)
        _rewrite(data.get("HostsPath"), old, new)
    except (OSError, subprocess.SubprocessError) as exc:
        journal.record("hostname-kept", container=data["Id"], hostname=old, error=str(exc))
        return None
    return new


def _uts(pid: int, set_to: str | None = None) -> str:
    """The hostname in ``pid``'s UTS namespace (/proc/sys/kernel/hostname is per
    namespace of the reader); with ``set_to``, set it first."""
    script = 'printf %s "$1" > /proc/sys/kernel/hostname; ' if set_to is not None else ""
    out = subprocess.run(["nsenter", "--target", str(pid), "--uts", "--", "sh", "-c",
                          script + "cat /proc/sys/kernel/hostname", "sh", set_to or ""],
                         capture_output=True, text=True, timeout=10, check=True)
    return out.stdout.strip()


def _rewrite(path: str | None, old: str, new: str) -> None:
    """Podman's /etc/hostname or /etc/hosts of the container (bind-mounted from the
    host), the old hostname replaced where it stands as a word."""
    if not path or not Path(path).is_file():
        return
    text = Path(path).read_text()
    changed = re.sub(rf"(?<![\w.-]){re.escape(old)}(?![\w.-])", new, text)
    if changed != text:
        Path(path).write_text(changed)
