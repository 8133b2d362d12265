"""criu/yard.py: the cgroup yard a killed CRIU leaves in the container's
userdata is unmounted before Podman's removal walks into it (G10 on H200s,
2026-11-29: `podman rm` failed on `.criu.cgyard.*/unified/io.pressure`)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from gpusnap.criu import yard


def test_the_yards_mounts_are_found_deepest_first_and_only_under_that_folder(tmp_path):
    userdata = tmp_path / "userdata"
    userdata.mkdir()
    base = os.path.realpath(userdata)
    info = "\n".join([
        f"101 30 0:50 / {base}/.criu.cgyard.K51440 rw - tmpfs none rw",
        f"102 101 0:26 / {base}/.criu.cgyard.K51440/unified rw - cgroup2 none rw",
        f"103 30 0:51 / {base}/rootfs rw - overlay overlay rw",  # not CRIU's
        f"104 30 0:52 / {base}2/.criu.cgyard.X rw - tmpfs none rw",  # another container's
        f"105 30 0:53 / {base}/with\\040space/.criu.cgyard.Y rw - tmpfs none rw",  # deeper
        "106 30 0:54 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw",
    ])
    assert yard.yard_mounts(userdata, info) == [f"{base}/.criu.cgyard.K51440/unified",
                                                 f"{base}/.criu.cgyard.K51440"]


def _mount(kind: str, where: Path) -> None:
    where.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", kind, "none", str(where)], check=True, timeout=30)


@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a tmpfs: needs root (make test runs as root)")
def test_a_left_yard_is_unmounted_and_removed(tmp_path):
    """A yard as CRIU makes it: a tmpfs, something mounted under it (a tmpfs
    here, not the host's cgroup2), and a file in it that cannot go by unlink."""
    userdata = tmp_path / "userdata"
    left = userdata / ".criu.cgyard.abc123"
    _mount("tmpfs", left)
    _mount("tmpfs", left / "unified")
    (left / "unified" / "io.pressure").write_text("")
    (userdata / "config.json").write_text("{}")
    try:
        done = yard.release(userdata)
        assert done == [os.path.realpath(left / "unified"), os.path.realpath(left)]
        assert not left.exists() and (userdata / "config.json").exists()
        assert yard.yard_mounts(userdata, Path("/proc/self/mountinfo").read_text()) == []
    finally:
        for point in (left / "unified", left):
            subprocess.run(["umount", "-l", str(point)], capture_output=True, timeout=30)


def test_nothing_left_is_nothing_done(tmp_path):
    assert yard.release(tmp_path) == []
