"""A ttrpc server for the shim's task service (containerd 2.x).

containerd 2.x talks gRPC to a shim through grpc.NewClient, whose channel
starts idle; its watcher (core/runtime/v2/shim.go, grpcDialContext) reads an
idle channel as a closed one and cleans the shim up as dead at once, killing
the task being created. So under containerd 2.x the shim answers
`"protocol":"ttrpc"` (the protocol of containerd's own shims) and serves the
same servicer here. The wire protocol (github.com/containerd/ttrpc,
PROTOCOL.md): frames of a 10-byte header -- length (uint32, big-endian),
stream id (uint32, odd, client-chosen), type (1 request, 2 response, 3 data),
flags -- then a ttrpc.Request or ttrpc.Response. Only unary calls: the task
service has no streams. Each request runs in a worker of its own (Wait holds
one until its process exits, or its connection closes, or its timeout_nano
passes: ttrpc has no cancel message); responses on one connection are
written under a lock.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
from google.protobuf import message_factory
from google.protobuf.descriptor import ServiceDescriptor

from gpusnap.private import private_umask
from gpusnap.proto import load

log = logging.getLogger("gpusnap.shim")

HEADER = struct.Struct(">IIBB")
REQUEST, RESPONSE = 1, 2
MAX_MESSAGE = 4 << 20  # ttrpc's messageLengthMax


class _Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


class _Context:
    """The part of grpc.ServicerContext the task service uses: abort(), is_active().
    CLOSED is set when the call's connection ends; TIMEOUT_NANO is the request's
    (the client's deadline; 0 for none)."""

    def __init__(self, closed: threading.Event, timeout_nano: int = 0) -> None:
        self.closed = closed
        self.deadline = time.monotonic() + timeout_nano / 1e9 if timeout_nano else None

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise _Aborted(code, details)

    def is_active(self) -> bool:
        """False once nobody can read the answer: its connection closed or its deadline passed."""
        return not self.closed.is_set() and (self.deadline is None or time.monotonic() < self.deadline)


class TtrpcServer:
    """Serves SERVICE's unary methods, dispatched to SERVICER, on a unix socket."""

    def __init__(self, service: ServiceDescriptor, servicer: Any, max_workers: int = 64) -> None:
        self.pb = load().ttrpc
        self.name = service.full_name
        self.methods = {m.name: (getattr(servicer, m.name),
                                 message_factory.GetMessageClass(m.input_type))
                        for m in service.methods}
        self.pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="ttrpc")
        self.sock: socket.socket | None = None
        self.closing = threading.Event()
        self.conns: list[socket.socket] = []

    def listen(self, path: str) -> bool:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            if os.path.exists(path):
                os.unlink(path)
            with private_umask():  # 0600: only containerd (root) may drive this shim
                s.bind(path)
            s.listen(16)
        except OSError as exc:
            log.error("cannot listen on %s: %s", path, exc)
            s.close()
            return False
        self.sock = s
        threading.Thread(target=self._accept, name="ttrpc-accept", daemon=True).start()
        return True

    def stop(self) -> None:
        self.closing.set()
        for s in [self.sock, *self.conns]:
            if s is not None:
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()
        self.pool.shutdown(wait=False, cancel_futures=True)

    def _accept(self) -> None:
        assert self.sock is not None
        while not self.closing.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), name="ttrpc-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        lock, closed = threading.Lock(), threading.Event()
        try:
            while True:
                head = _read(conn, HEADER.size)
                if head is None:
                    return
                length, stream, kind, _flags = HEADER.unpack(head)
                if length > MAX_MESSAGE:
                    log.error("ttrpc: a %d-byte message is over the limit; closing", length)
                    return
                body = _read(conn, length) if length else b""
                if body is None:
                    return
                if kind == REQUEST:
                    self._dispatch(conn, lock, stream, body, closed)
                # data frames belong to streams, which the task service has none of
        finally:
            closed.set()  # its calls' answers have nowhere to go: a Wait gives its worker up
            try:
                self.conns.remove(conn)
            except ValueError:
                pass
            with lock:  # never under a Wait thread's sendall
                conn.close()

    def _dispatch(self, conn: socket.socket, lock: threading.Lock, stream: int, body: bytes,
                  closed: threading.Event) -> None:
        """A Wait on a thread of its own, the rest on the pool: ttrpc sends no
        cancel, and containerd keeps its connection when a `ctr task wait` is
        stopped, so an abandoned Wait lasts until its task exits; in the pool,
        64 of them would leave State, Kill and Delete queued for good (Go's
        ttrpc server runs every call on a goroutine of its own)."""
        args = (conn, lock, stream, body, closed)
        if _method(self.pb, body) == "Wait":
            threading.Thread(target=self._call, args=args, name="ttrpc-wait", daemon=True).start()
        else:
            self.pool.submit(self._call, *args)

    def _call(self, conn: socket.socket, lock: threading.Lock, stream: int, body: bytes,
              closed: threading.Event) -> None:
        pb = self.pb
        status, payload = pb.Status(code=0), b""
        try:
            req = pb.Request.FromString(body)
            if req.service != self.name or req.method not in self.methods:
                raise _Aborted(grpc.StatusCode.UNIMPLEMENTED, f"{req.service}.{req.method} is not served")
            fn, cls = self.methods[req.method]
            payload = fn(cls.FromString(req.payload), _Context(closed, req.timeout_nano)).SerializeToString()
        except _Aborted as exc:
            status = pb.Status(code=exc.code.value[0], message=exc.message)
        except Exception as exc:  # the servicer maps its own errors; this is a last resort
            log.exception("ttrpc call failed")
            status = pb.Status(code=grpc.StatusCode.INTERNAL.value[0], message=f"{type(exc).__name__}: {exc}")
        out = pb.Response(status=status, payload=payload).SerializeToString()
        with lock:
            try:
                conn.sendall(HEADER.pack(len(out), stream, RESPONSE, 0) + out)
            except OSError:
                pass  # containerd went away; it reconnects and asks again


def _method(pb: Any, body: bytes) -> str:
    """The method a request names ("" where it does not parse: _call answers it)."""
    try:
        return pb.Request.FromString(body).method
    except Exception:  # noqa: BLE001 -- protobuf's DecodeError and the like
        return ""


def _read(conn: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        try:
            chunk = conn.recv(n - len(buf))
        except OSError:
            return None
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


class TtrpcError(RuntimeError):
    """A ttrpc call answered a non-OK status (code: grpc.StatusCode's number)."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


def call(path: str, service: str, method: str, request: Any, response_cls: type,
         timeout: float = 30.0) -> Any:
    """One unary call on the ttrpc socket PATH (a client, for tests and probes)."""
    pb = load().ttrpc
    body = pb.Request(service=service, method=method, payload=request.SerializeToString(),
                      timeout_nano=int(timeout * 1e9)).SerializeToString()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(path)
        s.sendall(HEADER.pack(len(body), 1, REQUEST, 0) + body)
        while True:
            head = _read(s, HEADER.size)
            if head is None:
                raise TtrpcError(grpc.StatusCode.UNAVAILABLE.value[0], f"{path} closed the connection")
            length, stream, kind, _ = HEADER.unpack(head)
            data = _read(s, length) if length else b""
            if data is None:
                raise TtrpcError(grpc.StatusCode.UNAVAILABLE.value[0], f"{path} closed the connection")
            if stream == 1 and kind == RESPONSE:
                break
    resp = pb.Response.FromString(data)
    if resp.status.code:
        raise TtrpcError(resp.status.code, resp.status.message)
    return response_cls.FromString(resp.payload)
