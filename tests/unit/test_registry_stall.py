"""oci/stall.py: a registry that trickles a blob (a byte now and then, each
within the socket's timeout) is cut off within the REGISTRY bound per MiB,
and the user reads that it was slow, not that it was unreachable; one that
sends at a fair pace is not cut."""

from __future__ import annotations

import hashlib
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from gpusnap.oci.reference import parse
from gpusnap.oci.registry import RegistryClient, TransientError
from gpusnap.oci.registry_options import RegistryOptions

BLOB = bytes(range(256)) * (6 << 12)  # 6 MiB
DIGEST = "sha256:" + hashlib.sha256(BLOB).hexdigest()


def _server(pace_s: float, piece: int, body: str = "length"):
    """A registry answering every blob GET with BLOB, ``piece`` bytes every
    ``pace_s``; its end told by Content-Length, by chunks, or by the close."""
    gets: list[float] = []

    class Trickle(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1" if body == "chunked" else "HTTP/1.0"

        def do_GET(self) -> None:
            gets.append(time.monotonic())
            self.send_response(200)
            if body == "length":
                self.send_header("Content-Length", str(len(BLOB)))
            elif body == "chunked":
                self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            try:
                for at in range(0, len(BLOB), piece):
                    bit = BLOB[at:at + piece]
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(bit), bit) if body == "chunked"
                                     else bit)
                    self.wfile.flush()
                    time.sleep(pace_s)
                if body == "chunked":
                    self.wfile.write(b"0\r\n\r\n")
            except OSError:  # the client cut it
                pass

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Trickle)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, gets


@pytest.fixture
def bound(monkeypatch):
    monkeypatch.setenv("GPUSNAP_WAIT_REGISTRY", "1")


def _client(server) -> RegistryClient:
    host, port = server.server_address
    return RegistryClient(parse(f"{host}:{port}/a/b:v1"),
                          RegistryOptions(plain_http=True, retries=2, backoff_s=0.01))


@pytest.mark.timeout(60)  # a hang here fails in a minute, not the suite's fifteen
@pytest.mark.parametrize("body", ["length", "chunked", "close"])
def test_a_registry_that_trickles_a_blob_is_cut_off_and_named_slow(bound, body):
    """Also where each bit comes as a chunk of its own (each read returns it),
    and where the body ends with the connection (a cut one ends quietly, and
    would otherwise be called damaged)."""
    server, gets = _server(pace_s=0.2, piece=64, body=body)  # never the 1 s recv timeout
    try:
        started = time.monotonic()
        with pytest.raises(TransientError) as err:
            _client(server).get_blob(DIGEST, len(BLOB))
        assert time.monotonic() - started < 10  # 2 tries of about 1 s, not 6 MiB at 320 B/s
        assert len(gets) == 2  # cut, then tried again as a dropped connection is
        assert "at under 1 MiB in 1 s (after 2 tries)" in err.value.message
        assert "GPUSNAP_WAIT_REGISTRY" in err.value.hint
    finally:
        server.shutdown()


def test_a_slow_but_steady_registry_is_not_cut(bound):
    server, gets = _server(pace_s=0.05, piece=256 << 10)  # ~5 MiB/s: each MiB within 0.25 s
    try:
        assert bytes(_client(server).get_blob(DIGEST, len(BLOB))) == BLOB
        assert len(gets) == 1
    finally:
        server.shutdown()
