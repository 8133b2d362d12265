"""oci/unreachable.py: a registry that cannot be reached is named with a reason
a user can act on, from the texts requests gives for a dead or cut link (these
are the texts requests 2.32 / urllib3 2 give), not its exception's class name;
a proxy that fails is named as the proxy."""

from __future__ import annotations

import pytest

from gpusnap.oci.unreachable import socket_why

POOL = "HTTPConnectionPool(host='10.77.0.2', port=41115): Max retries exceeded with url: /v2/ "


@pytest.mark.parametrize("text, why", [
    (POOL + "(Caused by NewConnectionError('<urllib3.connection.HTTPConnection object at 0x7f>: "
            "Failed to establish a new connection: [Errno 101] Network is unreachable'))",
     "network unreachable"),
    (POOL + "(Caused by NewConnectionError('...: Failed to establish a new connection: "
            "[Errno 113] No route to host'))", "no route to host"),
    ("('Connection aborted.', TimeoutError(110, 'Connection timed out'))",
     "no answer within 120 s"),  # an upload's send timed out in the kernel
    ("HTTPSConnectionPool(host='r', port=443): Max retries exceeded (Caused by ProxyError("
     "'Unable to connect to proxy', ConnectTimeoutError(<...>, 'Connection to proxy timed out. "
     "(connect timeout=10)')))", "no connection within 10 s"),
    ("('Connection aborted.', ConnectionResetError(104, 'Connection reset by peer'))",
     "connection reset"),
    ("('Connection aborted.', RemoteDisconnected('Remote end closed connection without "
     "response'))", "connection cut"),
    ("('Connection aborted.', BrokenPipeError(32, 'Broken pipe'))", "connection cut"),
])
def test_a_dead_or_cut_link_is_named_for_what_happened(text, why):
    assert socket_why(text, 120.0) == why


def test_an_unknown_text_is_left_to_the_caller():
    assert socket_why("something else", 120.0) is None


def test_a_proxy_that_fails_is_named_as_the_proxy():
    requests = pytest.importorskip("requests")
    from gpusnap.oci.reference import parse
    from gpusnap.oci.registry import RegistryClient
    from gpusnap.oci.registry_options import RegistryOptions
    client = RegistryClient(parse("127.0.0.1:5000/a/b:v1"), RegistryOptions(plain_http=True))
    err = client._unreachable(requests.exceptions.ProxyError(
        "HTTPConnectionPool(host='proxy', port=3128): Max retries exceeded (Caused by "
        "ProxyError('Unable to connect to proxy', ConnectTimeoutError(None, 'Connection to "
        "proxy timed out. (connect timeout=10)')))"))
    assert err.message == ("cannot reach registry 127.0.0.1:5000 through the proxy: "
                           "no connection within 10 s")
    assert "HTTPS_PROXY" in err.hint


def test_an_answer_cut_short_is_not_called_unreachable():
    # The registry was reached and answered; the body ended before its length
    # (urllib3's IncompleteRead, as requests gives it when streaming).
    requests = pytest.importorskip("requests")
    from gpusnap.oci.reference import parse
    from gpusnap.oci.registry import RegistryClient
    from gpusnap.oci.registry_options import RegistryOptions
    client = RegistryClient(parse("127.0.0.1:5000/a/b:v1"), RegistryOptions(plain_http=True))
    err = client._unreachable(requests.exceptions.ChunkedEncodingError(
        "('Connection broken: IncompleteRead(1048576 bytes read, 3145728 more expected)', "
        "IncompleteRead(1048576 bytes read, 3145728 more expected))"))
    assert err.message.startswith("registry 127.0.0.1:5000 cut its answer short (after ")
    assert "cannot reach" not in err.message and err.hint.startswith("run the command again")


@pytest.mark.parametrize("status, hint", [(404, "HOST:PORT"), (502, "failed on its side")])
def test_a_web_server_or_a_failing_registry_at_v2_says_what_to_do(status, hint):
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from gpusnap.errors import GpusnapError
    from gpusnap.oci.reference import parse
    from gpusnap.oci.registry import RegistryClient
    from gpusnap.oci.registry_options import RegistryOptions

    class Answer(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(status)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass
    server = ThreadingHTTPServer(("127.0.0.1", 0), Answer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        client = RegistryClient(parse(f"127.0.0.1:{server.server_port}/a/b:v1"),
                                RegistryOptions(plain_http=True, retries=1))
        with pytest.raises(GpusnapError) as err:
            client.ping()
        assert err.value.hint and hint in err.value.hint  # none at all before
    finally:
        server.shutdown()
