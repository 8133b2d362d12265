"""A blob download that stalls is cut off.

The socket's timeout bounds each recv: a registry that sends nothing is given
up on after REGISTRY. One that sends a byte now and then resets that timeout
every time, and a blob read from it never ends. curl answers the same with
--speed-limit/--speed-time; here each MiB of a blob must arrive within the
REGISTRY bound, or its connection is shut down. That wakes the read blocked
on it, which then fails as a dropped connection does, and the download is
tried again as such a one is.
"""

from __future__ import annotations

import socket
import threading
import time

from gpusnap.waits import raise_words

PIECE = 1 << 20  # what must arrive within the bound: the downloader's read size


class Watch:
    """One download's deadline, pushed on by each PIECE that arrives."""

    def __init__(self, dog: Watchdog, resp) -> None:
        self._dog, self._raw, self._sock = dog, getattr(resp, "raw", None), socket_of(resp)
        self.deadline = time.monotonic() + dog.seconds
        self.stalled = False
        self._since = 0  # bytes since the deadline last moved: chunked bodies come in bits

    def progress(self, n: int) -> None:
        self._since += n
        if self._since >= PIECE:
            self._since = 0
            self.deadline = time.monotonic() + self._dog.seconds

    def cut(self) -> None:
        # http.client closes its response before urllib3 gives the connection
        # back to the pool: a closed one may be another request's socket by now
        if self._raw is not None and self._raw.isclosed():
            return
        self.stalled = True
        try:
            # socket's own shutdown, not SSLSocket's, which unwraps the TLS
            # layer under a read in progress: that read then fails as a cut one
            socket.socket.shutdown(self._sock, socket.SHUT_RDWR)
        except OSError:  # closed meanwhile: the read has ended anyway
            pass

    def close(self) -> None:
        self._dog.forget(self)


class Watchdog:
    """One thread for a client's downloads, running while any is watched."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._watches: set[Watch] = set()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def watch(self, resp) -> Watch:
        """A Watch of the streamed response ``resp``; it is never cut where its
        socket cannot be found (another urllib3) or no thread can start: each
        recv is still bounded."""
        w = Watch(self, resp)
        if w._sock is None:
            return w
        with self._lock:
            if self._thread is None:
                thread = threading.Thread(target=self._run, name="registry-stalls", daemon=True)
                try:
                    thread.start()
                except RuntimeError:
                    return w
                self._thread = thread
            self._watches.add(w)
        return w

    def forget(self, w: Watch) -> None:
        with self._lock:
            self._watches.discard(w)

    def _run(self) -> None:
        tick = min(1.0, self.seconds / 4)
        while True:
            time.sleep(tick)
            now = time.monotonic()
            with self._lock:
                if not self._watches:
                    self._thread = None
                    return
                late = [w for w in self._watches if w.deadline < now]
                self._watches.difference_update(late)
                for w in late:  # under the lock, so never after its download forgot it
                    w.cut()


def socket_of(resp) -> socket.socket | None:
    """The socket a streamed requests response reads from: the body's file
    (http.client's, over a SocketIO) holds it once urllib3's connection has
    handed it on; else the connection's (older urllib3)."""
    raw = getattr(resp, "raw", None)
    body = getattr(getattr(getattr(raw, "_fp", None), "fp", None), "raw", None)
    conn = getattr(raw, "connection", None) or getattr(raw, "_connection", None)
    for sock in (getattr(body, "_sock", None), getattr(conn, "sock", None)):
        if isinstance(sock, socket.socket):
            return sock
    return None


def words(registry: str, digest: str, tries: int, seconds: float) -> tuple[str, str]:
    """The line and the hint for a blob cut off on every try."""
    return (f"registry {registry} sent blob {digest[:19]} at under 1 MiB in {seconds:.0f} s "
            f"(after {tries} tries)",
            "check the link to the registry; on a link that slow raise the bound "
            f"({raise_words('REGISTRY')})")
