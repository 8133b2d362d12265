"""CRIU's dump and restore logs."""

from __future__ import annotations

import re
from pathlib import Path

# "(00.123456) Error (criu/mount.c:...): ..." from CRIU itself, "(00.27)  1: Error
# (...)" from a task it restores (its pid first); children it runs (ip,
# iptables-restore, action scripts) write theirs without the time.
_ERROR = re.compile(r"^(?:\(\s*[\d.]+\)\s*)?(?:\d+:\s*)?(Error \(.*)$")
# gpusnap's action script says in its own words why it failed a step (the agent
# gone, a step past its bound): that line, not CRIU's "exited, status=1" after it.
_OURS = re.compile(r"^gpusnap: (.*)$")

# What a user can do about the errors CRIU words for its own developers.
_EXPLAINED = (
    ("No mapping for", "a mount the checkpoint holds has no counterpart here{cgroup}"),
    ('execvp("ip"', "CRIU saves and restores the container's network namespace with ip(8): "
                    "install iproute2"),
    ('execvp("iptables-restore"', "CRIU locks the container's network with iptables-restore: "
                                  "install iptables (or set another network-lock in "
                                  "/etc/criu/runc.conf)"),
)


def _error(line: str) -> re.Match | None:
    """CRIU's error on this line, but the RLIMIT_NOFILE one every unprivileged-rlimit
    host logs and CRIU goes on from."""
    m = _ERROR.match(line.strip())
    return m if m and "RLIMIT_NOFILE" not in line else None


def first_error(log: Path) -> str | None:
    """CRIU's first error line in a dump/restore log (the later ones are fallout),
    with what it means where gpusnap knows."""
    try:
        with open(log, errors="replace") as f:
            for line in f:
                m = _error(line) or _OURS.match(line.strip())
                if m:
                    return _explained(m.group(1))
    except OSError:
        pass
    return None


def _explained(line: str) -> str:
    for needle, meaning in _EXPLAINED:
        if needle in line:
            return f"{line} ({meaning.format(cgroup=_cgroup_note())})"
    return line


def _cgroup_note() -> str:
    """A v1 host's container mounts each cgroup controller, which a v2-only host has not."""
    try:
        mounts = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return ""
    unified = any(f[1:3] == ["/sys/fs/cgroup", "cgroup2"] for f in (ln.split() for ln in mounts))
    return (": a checkpoint from a cgroup v1 host does not restore on this cgroup v2 host; "
            "restore it on a host with cgroup v1, or checkpoint again on a v2 host") if unified else ""


def ended_early(log: Path) -> bool:
    """A log CRIU wrote that ends with neither an error nor its closing line: CRIU
    was killed (or died) in the middle of its work."""
    try:
        with open(log, errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return False
    return bool(lines) and not any(map(_error, lines)) \
        and "finished successfully" not in lines[-1]


# compel gives up on a task that stayed in D after its freeze and its interrupt.
_UNSEIZABLE = re.compile(r"Unseizable non-zombie (\d+) found, state D")
# How often a dump that met seize_blocked is taken again in all: a race of
# milliseconds, so a third miss is not chance.
SEIZE_TRIES = 3


def seize_blocked(log: Path) -> int | None:
    """The task CRIU could not seize because it stayed uninterruptible through
    the freeze: most often one waiting in vfork() for its child to exec, the
    child frozen before it could (busybox 1.38's sh and posix_spawn run
    commands so). A race of a few milliseconds, failed after CRIU's 10 s."""
    try:
        with open(log, errors="replace") as f:
            for line in f:
                m = _UNSEIZABLE.search(line)
                if m:
                    return int(m.group(1))
    except OSError:
        pass
    return None


def unseizable_words(pid: int, container: str | None = None) -> str:
    """What a checkpoint that met seize_blocked says, wherever it is said (the
    shim's answer, gpusnap's line): UNSEIZABLE_MARK is what callers look for."""
    of = f" of {container}" if container else ""
    return (f"CRIU could not seize process {pid}{of}: it stayed uninterruptible through the "
            "freeze, as a shell waiting in vfork() for its child's exec does (busybox 1.38's "
            "sh, posix_spawn); nothing was dumped")


UNSEIZABLE_MARK = "CRIU could not seize process"
