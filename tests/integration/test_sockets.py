"""A container with a TCP listener is checkpointed and restored with it.

CRIU before 4.2 asks getsockopt(SO_PASSCRED) of every socket, which Linux
6.16 refuses for TCP and UDP: on such a kernel every container with a server
socket failed to dump (an inference server's HTTP port, say). `make deps`
installs CRIU 4.2; this test fails if an older one is back on PATH."""

from __future__ import annotations

from tests.conftest import (COUNTER, DEMO_IMAGE, assert_continued, born, gpusnap_json, podman,
                            read_counter, wait_counter)

PORT = 8080


def _listening(name: str) -> bool:
    """Port 8080 in LISTEN (state 0A) in the container's network namespace
    (busybox nc listens on IPv6's any address: tcp6)."""
    lines = podman("exec", name, "cat", "/proc/net/tcp", "/proc/net/tcp6").stdout.splitlines()
    rows = [line.split() for line in lines if ":" in line]
    return any(r[1].endswith(f":{PORT:04X}") and r[3] == "0A" for r in rows)


def test_container_with_a_tcp_listener_checkpoints_and_restores(name, tmp_path):
    podman("run", "-d", "--name", name, DEMO_IMAGE, "sh", "-c",
           f"nc -l -p {PORT} </dev/null >/dev/null & {COUNTER}")
    wait_counter(name, 3)
    assert _listening(name)
    before, token = read_counter(name), born(name)
    archive = tmp_path / "ctr.tar.zst"
    gpusnap_json("checkpoint", name, "--export", str(archive))
    podman("rm", "-f", name)
    gpusnap_json("restore", str(archive))
    assert_continued(name, before, token)
    assert _listening(name), "the TCP listener did not come back"
