"""The shim's bootstrap answer: the task API version each containerd accepts."""

from __future__ import annotations

import pytest

from gpusnap.shim.main import task_api_version


@pytest.mark.parametrize("printed, want", [
    ("containerd github.com/containerd/containerd 1.7.24~ds1 1.7.24~ds1-6+deb13u1", 2),
    ("containerd github.com/containerd/containerd/v2 2.1.9+unknown ", 3),
    ("containerd containerd.io v2.2.0 1c4457e", 3),
    ("something else entirely", 2),
])
def test_containerd_2_gets_3_and_1_7_gets_2(tmp_path, monkeypatch, printed, want):
    monkeypatch.delenv("GPUSNAP_SHIM_TASK_VERSION", raising=False)
    binary = tmp_path / "containerd"
    binary.write_text(f"#!/bin/sh\necho '{printed}'\n")
    binary.chmod(0o755)
    assert task_api_version(str(binary)) == want


def test_no_containerd_binary_answers_2_and_the_environment_overrides(tmp_path, monkeypatch):
    monkeypatch.delenv("GPUSNAP_SHIM_TASK_VERSION", raising=False)
    assert task_api_version(str(tmp_path / "missing")) == 2
    monkeypatch.setenv("GPUSNAP_SHIM_TASK_VERSION", "3")
    assert task_api_version(str(tmp_path / "missing")) == 3
