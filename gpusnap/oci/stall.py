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

PIECE = 1 << 20  # what must arrive within the bound: the downloader's read size


class Watch:
    """One download's deadline, pushed on by each piece that arrives."""

    def __init__(self, dog: Watchdog, sock: socket.socket | None) -> None:
        self._dog, self._sock = dog, sock
        self.deadline = time.monotonic() + dog.seconds
        self.stalled = False

    def progress(self) -> None:
        self.deadline = time.monotonic() + self._dog.seconds

    def cut(self) -> None:
        self.stalled = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:  # closed meanwhile: the read has ended anyway
            pass

    def close(self) -> None:
        self._dog.forget(self)

    def __enter__(self) -> Watch:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Watchdog:
    """One thread for a client's downloads, running while any is watched."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._watches: set[Watch] = set()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def watch(self, sock: socket.socket | None) -> Watch:
        """A Watch of the download reading ``sock``; none is cut where the socket
        cannot be found (another urllib3): each recv is still bounded."""
        w = Watch(self, sock)
        if sock is None:
            return w
        with self._lock:
            self._watches.add(w)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="registry-stalls",
                                                daemon=True)
                self._thread.start()
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
                for w in late:  # under the lock: never after its download has let the socket go
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
            "check the link to the registry; on a link that slow raise GPUSNAP_WAIT_REGISTRY "
            "(seconds)")
