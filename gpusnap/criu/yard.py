"""CRIU's cgroup yard: a tmpfs with the host's cgroup hierarchies mounted under
it, made in CRIU's work dir (`.criu.cgyard.XXXXXX`, the container's userdata
for runc) by a restore and removed only at its very end. A CRIU killed late in
a restore (its post-resume step: the container's processes killed, CRIU in
their cgroup) leaves it mounted, in the host's mount namespace.

Podman's removal of that container then walks into the host's cgroup2 root
under the yard: it fails on the cgroup files ("unlinkat …/unified/io.pressure:
operation not permitted") and can rmdir any empty host cgroup on its way. So
the yard is unmounted first.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

YARD_PREFIX = ".criu.cgyard."
_MNT_DETACH = 2


def _unescaped(field: str) -> str:
    """A mountinfo path: the kernel writes space, tab, newline, backslash as \\ooo."""
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and field[i + 1:i + 4].isdigit():
            out.append(chr(int(field[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def yard_mounts(workdir: Path | str, mountinfo: str) -> list[str]:
    """The mount points of CRIU yards right under ``workdir`` and everything
    mounted below them, deepest first (the order they can be unmounted in)."""
    base = os.path.realpath(workdir) + "/" + YARD_PREFIX
    points = []
    for line in mountinfo.splitlines():
        fields = line.split()
        if len(fields) > 4:
            point = _unescaped(fields[4])
            if point.startswith(base):
                points.append(point)
    return sorted(set(points), key=lambda p: (-p.count("/"), p))


def release(workdir: Path | str, mountinfo: Path = Path("/proc/self/mountinfo")) -> list[str]:
    """Unmount (lazily: a CRIU still holding a file there keeps it) every yard a
    killed CRIU left in ``workdir``, and remove the emptied folders. Returns the
    mount points unmounted; those that would not go are left to the caller's
    removal, which then says why."""
    libc, done = None, []
    while True:  # again while some go: two mounts stacked on one point go one at a time
        try:
            points = yard_mounts(workdir, mountinfo.read_text())
        except OSError:
            points = []
        if not points:
            break
        libc = libc or ctypes.CDLL(None, use_errno=True)
        gone = [p for p in points if libc.umount2(os.fsencode(p), _MNT_DETACH) == 0]
        if not gone:
            break
        done += gone
    for yard in Path(workdir).glob(YARD_PREFIX + "*"):
        try:
            for sub in sorted(yard.iterdir(), reverse=True):
                sub.rmdir()
            yard.rmdir()
        except OSError:  # still mounted, or not CRIU's empty folders: left as it is
            continue
    return done
