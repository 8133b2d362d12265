"""oci/registry.py: a registry that cannot be reached is named with a reason a
user can act on, from the texts requests gives for a dead or cut link (these
are the texts requests 2.32 / urllib3 2 give), not its exception's class name."""

from __future__ import annotations

import pytest

from gpusnap.oci.registry import _socket_why

POOL = "HTTPConnectionPool(host='10.77.0.2', port=41115): Max retries exceeded with url: /v2/ "


@pytest.mark.parametrize("text, why", [
    (POOL + "(Caused by NewConnectionError('<urllib3.connection.HTTPConnection object at 0x7f>: "
            "Failed to establish a new connection: [Errno 101] Network is unreachable'))",
     "network unreachable"),
    (POOL + "(Caused by NewConnectionError('...: Failed to establish a new connection: "
            "[Errno 113] No route to host'))", "no route to host"),
    ("('Connection aborted.', TimeoutError('timed out'))", "no answer within 120 s"),
    ("('Connection aborted.', ConnectionResetError(104, 'Connection reset by peer'))",
     "connection reset"),
    ("('Connection aborted.', RemoteDisconnected('Remote end closed connection without "
     "response'))", "connection cut"),
    ("('Connection aborted.', BrokenPipeError(32, 'Broken pipe'))", "connection cut"),
])
def test_a_dead_or_cut_link_is_named_for_what_happened(text, why):
    assert _socket_why(text, 120.0) == why


def test_an_unknown_text_is_left_to_the_caller():
    assert _socket_why("something else", 120.0) is None
