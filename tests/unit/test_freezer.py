"""The cgroup freezer read and thawed through a process's /proc/PID/cgroup, on
fake v1 and v2 hierarchies (the real ones: tests/integration/test_faults.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gpusnap.criu import freezer


@pytest.fixture
def fake_proc(tmp_path, monkeypatch):
    """This process's /proc/self/cgroup replaced by ``lines``."""
    real = Path.read_text

    def cgroup_of(lines: str):
        def read_text(self, *a, **kw):
            if str(self) == f"/proc/{os.getpid()}/cgroup":
                return lines
            return real(self, *a, **kw)
        monkeypatch.setattr(Path, "read_text", read_text)
    return cgroup_of


def test_v1_freezer_is_read_and_thawed(tmp_path, fake_proc):
    state = tmp_path / "freezer/libpod_parent/libpod-x/freezer.state"
    state.parent.mkdir(parents=True)
    state.write_text("FROZEN\n")
    fake_proc("6:freezer:/libpod_parent/libpod-x\n0::/libpod_parent/libpod-x\n")
    assert freezer.is_frozen(os.getpid(), tmp_path)
    assert freezer.thaw(os.getpid(), tmp_path) is True
    assert state.read_text() == "THAWED"
    assert not freezer.is_frozen(os.getpid(), tmp_path)
    assert freezer.thaw(os.getpid(), tmp_path) is False  # nothing left to thaw


def test_v2_freezer_is_read_and_thawed(tmp_path, fake_proc):
    group = tmp_path / "machine.slice/libpod-x.scope"
    group.mkdir(parents=True)
    (group / "cgroup.events").write_text("populated 1\nfrozen 1\n")
    (group / "cgroup.freeze").write_text("1\n")
    fake_proc("0::/machine.slice/libpod-x.scope\n")
    assert freezer.is_frozen(os.getpid(), tmp_path)
    assert freezer.thaw(os.getpid(), tmp_path) is True
    assert (group / "cgroup.freeze").read_text() == "0"


def test_a_process_gone_is_neither_frozen_nor_thawed(tmp_path):
    assert not freezer.is_frozen(2**22 + 7, tmp_path)
    assert freezer.thaw(2**22 + 7, tmp_path) is False
