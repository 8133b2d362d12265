"""A warm parent for shim servers: grpc and the protos imported once, one fork per task.

Importing grpc, protobuf and the generated modules is most of a fresh
interpreter's start; containerd waits for that on every task start (`ctr run`).
The first `start` launches this process; later ones send it a request on a
root-only socket and it forks a server that listens almost at once. It never
creates a grpc object itself (forking after grpc core starts is unsafe), runs
single-threaded, exits after IDLE_EXIT seconds without requests, and refuses
(so `start` falls back to a cold fork) when the shim's code on disk changed
since it started, or its socket is gone. One per socket directory (a lock
file). GPUSNAP_SHIM_ZYGOTE=0 turns it off.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import socket
import struct
import sys
import time
from pathlib import Path

from gpusnap.private import private_umask, write_private

IDLE_EXIT = 600.0
_CHECK_EVERY = 5.0  # seconds between checks that the socket is still ours
NAME = "zygote.sock"
_PKG = Path(__file__).resolve().parent.parent


def enabled() -> bool:
    return os.environ.get("GPUSNAP_SHIM_ZYGOTE", "1") != "0"


def code_stamp() -> str:
    """Changes when any file the shim server runs from changes."""
    newest = 0
    for pattern in ("__init__.py", "private.py", "shim/*.py", "proto/*.py", "proto/src/gpusnap_pb/*.proto"):
        for f in _PKG.glob(pattern):
            newest = max(newest, f.stat().st_mtime_ns)
    return f"{sys.executable}:{newest}"


def request(socket_dir: str, req: dict, timeout: float = 60.0) -> bool:
    """Ask a running zygote for a server; True once it listens, False to fall back."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect(os.path.join(socket_dir, NAME))
        s.sendall(json.dumps(req).encode() + b"\n")
        return s.recv(1) == b"1"
    except OSError:
        return False
    finally:
        s.close()


def launch(socket_dir: str) -> None:
    """Start a zygote in the background, detached from containerd's pipes."""
    null = os.devnull
    os.posix_spawn(sys.executable, [sys.executable, "-m", "gpusnap.shim.zygote", socket_dir], dict(os.environ),
                   file_actions=[(os.POSIX_SPAWN_OPEN, 0, null, os.O_RDONLY, 0),
                                 (os.POSIX_SPAWN_OPEN, 1, null, os.O_WRONLY, 0),
                                 (os.POSIX_SPAWN_OPEN, 2, null, os.O_WRONLY, 0)],
                   setsid=True)


def _serve_child(conn: socket.socket, listener: socket.socket, req: dict) -> None:
    """In the forked grandchild: become the task's shim server."""
    from gpusnap.shim.server import serve  # start-up: `SHIM start` imports this module

    code = 1
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        listener.close()
        os.setsid()
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        ready = os.dup(conn.fileno())
        conn.close()
        code = serve(req["namespace"], req["address"], req["socket"], ready, bool(req.get("debug")), "zygote",
                     req.get("protocol", "grpc"))
    finally:
        os._exit(code)


def _gone(path: str, ino: int) -> bool:
    try:
        return os.stat(path).st_ino != ino
    except OSError:
        return True


def _peer_uid(conn: socket.socket) -> int:
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1]


def main(socket_dir: str) -> int:
    # One zygote per directory: the lock lives as long as this process.
    lock = os.open(os.path.join(socket_dir, "zygote.lock"), os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return 0
    # SIGTERM runs the finally below (socket and info file removed); forks reset it.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    # Imported here, before any request, so that each fork starts warm (not at the
    # top: `SHIM start` imports this module, and must stay light).
    import grpc  # noqa: F401

    import gpusnap.shim.server  # noqa: F401
    import gpusnap.shim.service  # noqa: F401
    from gpusnap.proto import load

    load()
    stamp = code_stamp()
    path = os.path.join(socket_dir, NAME)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with private_umask():  # 0600: only root asks for servers
        listener.bind(path)
    listener.listen(16)
    listener.settimeout(_CHECK_EVERY)
    ino = os.stat(path).st_ino
    info = os.path.join(socket_dir, "zygote.json")
    write_private(info, json.dumps({"pid": os.getpid(), "stamp": stamp}))
    try:
        idle_until = time.monotonic() + IDLE_EXIT
        while True:
            try:
                conn, _ = listener.accept()
            except socket.timeout:
                if time.monotonic() > idle_until or _gone(path, ino):
                    return 0  # idle, or our directory was removed (a test's private one)
                continue
            idle_until = time.monotonic() + IDLE_EXIT
            with conn:
                conn.settimeout(10)
                try:
                    req = json.loads(conn.makefile("rb").readline())
                except (OSError, ValueError):
                    continue
                if _peer_uid(conn) != os.getuid():
                    continue
                if req.get("stamp") != stamp:
                    return 0  # code changed on disk: let a fresh zygote take over
                pid = os.fork()
                if pid == 0:
                    os.close(lock)
                    if os.fork() == 0:
                        _serve_child(conn, listener, req)
                    os._exit(0)
                os.waitpid(pid, 0)  # the server is a grandchild: nobody needs to reap it here
    finally:
        listener.close()
        try:
            if os.stat(path).st_ino == ino:
                os.unlink(path)
                os.unlink(info)
        except OSError:
            pass


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
