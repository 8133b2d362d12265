"""gpusnap.requests: options the CLI leaves for the CRIU action script of one checkpoint."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from gpusnap import requests


@pytest.fixture
def state_dir(tmp_path: Path, monkeypatch) -> Path:
    path = tmp_path / "state"
    monkeypatch.setenv("GPUSNAP_STATE_DIR", str(path))
    return path


def test_take_returns_what_put_left(state_dir):
    requests.put(4242, lock_timeout_ms=2500, leave_running=True)
    assert requests.take(4242) == {"lock_timeout_ms": 2500, "leave_running": True}


def test_take_removes_the_request(state_dir):
    requests.put(4242, lock_timeout_ms=1)
    requests.take(4242)
    assert requests.take(4242) == {}
    assert list((state_dir / "requests").iterdir()) == []


def test_requests_are_kept_per_init_pid(state_dir):
    requests.put(1, lock_timeout_ms=100)
    requests.put(2, lock_timeout_ms=200)
    assert requests.take(2) == {"lock_timeout_ms": 200}
    assert requests.take(1) == {"lock_timeout_ms": 100}


def test_a_second_put_replaces_the_first(state_dir):
    requests.put(7, lock_timeout_ms=100, extra="x")
    requests.put(7, lock_timeout_ms=200)
    assert requests.take(7) == {"lock_timeout_ms": 200}


def test_put_writes_a_private_file_and_no_leftover_temporary(state_dir):
    requests.put(9, lock_timeout_ms=5)
    files = list((state_dir / "requests").iterdir())
    assert [f.name for f in files] == ["9.json"]
    assert stat.S_IMODE(files[0].stat().st_mode) == 0o600
    assert stat.S_IMODE((state_dir / "requests").stat().st_mode) == 0o700


def test_take_without_a_request_is_empty(state_dir):
    assert requests.take(31337) == {}


@pytest.mark.parametrize("text", ["{broken", "[1, 2]", "42", ""], ids=["garbage", "array",
                                                                     "number", "empty"])
def test_take_of_a_damaged_request_is_empty(state_dir, text):
    requests.put(5, lock_timeout_ms=1)
    (state_dir / "requests" / "5.json").write_text(text)
    assert requests.take(5) == {}


def test_drop_forgets_a_request(state_dir):
    requests.put(6, lock_timeout_ms=1)
    requests.drop(6)
    assert requests.take(6) == {}
    requests.drop(6)  # dropping twice is fine
