"""Unit tests keep gpusnap's state (journal, RAM holds, requests) out of the
host's /run/gpusnap: a test that needs it there sets GPUSNAP_STATE_DIR itself."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _private_state_dir(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("GPUSNAP_STATE_DIR", str(tmp_path_factory.mktemp("state")))
