"""binary:// log URIs (nerdctl's logging, `ctr run --log-uri binary://...`) under the shim.

The shim starts the logging program as containerd's runc shim does: query
keys and values as arguments, CONTAINER_ID and CONTAINER_NAMESPACE in its
environment, stdout and stderr pipes as fds 3 and 4, readiness on fd 5.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from gpusnap.ops.containerd_api import Client, start_task
from tests.conftest import DEMO_IMAGE, run
from tests.integration.shim_containerd import RUNTIME, binary_log_uri, private_containerd, remove


@pytest.fixture(scope="module")
def containerd():
    with private_containerd() as c:
        yield c


def _wait_file(path: Path, want: str, timeout: float = 10) -> str:
    deadline = time.monotonic() + timeout
    text = ""
    while time.monotonic() < deadline:
        text = path.read_text() if path.exists() else ""
        if want in text:
            return text
        time.sleep(0.05)
    raise AssertionError(f"{path}: {text!r}, wanted {want!r}")


def _loggers(directory: Path) -> list[str]:
    return run(["pgrep", "-af", str(directory / "logger.sh")]).stdout.splitlines()


def test_output_goes_to_the_logging_program(containerd, tmp_path: Path):
    c = containerd
    uri = binary_log_uri(tmp_path, "bl1")
    res = c.ctr("run", "--rm", "--log-uri", uri, "--runtime", RUNTIME, DEMO_IMAGE, "bl1",
                "sh", "-c", "echo hello; echo oops >&2; exit 4", check=False)
    assert res.returncode == 4, res.stderr
    assert _wait_file(tmp_path / "bl1.out", "hello") == "hello\n"
    assert _wait_file(tmp_path / "bl1.err", "oops") == "oops\n"
    assert (tmp_path / "bl1.env").read_text().split() == ["bl1", c.namespace, "out", str(tmp_path / "bl1")]
    deadline = time.monotonic() + 10
    while _loggers(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _loggers(tmp_path) == []  # it ended with the container's output


def test_terminal_output_goes_to_the_logging_program(containerd, tmp_path: Path):
    c = containerd
    uri = binary_log_uri(tmp_path, "bl2")
    # `nerdctl run -t -d`: terminal with stdout = stderr = the binary:// URI (ctr -t ignores --log-uri).
    c.ctr("containers", "create", "-t", "--runtime", RUNTIME, DEMO_IMAGE, "bl2",
          "sh", "-c", "tty; echo on-tty; sleep 300")
    with Client(c.address, c.namespace) as api:
        assert start_task(api, "bl2", stdout=uri, stderr=uri, terminal=True) > 0
    out = _wait_file(tmp_path / "bl2.out", "on-tty")
    assert out.startswith("/dev/pts/") and "on-tty" in out, out  # the process had a pty
    remove(c, "bl2")


def test_a_missing_logging_program_fails_the_create_in_one_line(containerd, tmp_path: Path):
    c = containerd
    res = c.ctr("run", "--rm", "--log-uri", f"binary://{tmp_path}/nope?x=1", "--runtime", RUNTIME, DEMO_IMAGE,
                "bl3", "true", check=False)
    assert res.returncode != 0
    assert f"cannot start {tmp_path}/nope" in res.stderr and "Traceback" not in res.stderr, res.stderr
    c.ctr("containers", "delete", "bl3", check=False)
