"""Put a sealed in-memory copy of a binary over its path (matrix roots only).

runc 1.1.13+ (trixie has 1.1.15) copies itself into a memfd at every container
start and seals it; on this kernel F_ADD_SEALS(F_SEAL_WRITE) now and then
answers EBUSY while pages sendfile() wrote are still pinned, and runc init
dies: "read init-p: connection reset by peer" (2 of 40 `podman run` in the
trixie root). runc skips the copy when /proc/self/exe already is a fully
sealed memfd, the setup runc's own contrib/cmd/memfd-bind makes for 1.1 users.
This does the same once, retrying the seal until the pins are gone.

A memfd lives on the kernel's internal mount, so it cannot be bind-mounted
itself, only its /proc/PID/fd magic link; the mount reads through that link,
so the process holding it stays alive (forked off here) until the matrix's
mount namespace goes.

    python3 seal-binary.py /usr/sbin/runc
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import sys
import time

SEALS = fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE
MS_BIND = 4096


def sealed_copy(path: str, attempts: int = 100) -> int:
    fd = os.memfd_create("runc_cloned:/proc/self/exe", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    with open(path, "rb") as src:
        while chunk := src.read(1 << 20):
            os.write(fd, chunk)
    os.fchmod(fd, 0o755)
    for _ in range(attempts):
        try:
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
            return fd
        except OSError as e:
            if e.errno != errno.EBUSY:
                raise
            time.sleep(0.1)
    raise SystemExit(f"seal-binary: {path}: the memfd stayed busy; not sealed")


def bind(fd: int, path: str) -> None:
    link = os.open(f"/proc/self/fd/{fd}", os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
    target = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mount(f"/proc/self/fd/{link}".encode(), f"/proc/self/fd/{target}".encode(), None, MS_BIND, None) != 0:
        err = ctypes.get_errno()
        raise SystemExit(f"seal-binary: mount over {path}: {os.strerror(err)}")
    os.close(target)  # the link and the memfd stay open: the mount reads through them


def main(path: str) -> None:
    path = os.path.realpath(path)
    ready_r, ready_w = os.pipe()
    if os.fork():  # the caller goes on once the copy is in place
        os.close(ready_w)
        msg = os.read(ready_r, 4096).decode()
        print(msg or f"seal-binary: {path}: the holder died", file=sys.stdout if msg.startswith("ok") else sys.stderr)
        with open(path, "rb") as f:
            sealed = fcntl.fcntl(f.fileno(), fcntl.F_GET_SEALS) == SEALS
        sys.exit(0 if sealed else 1)
    os.close(ready_r)
    os.setsid()
    try:
        bind(sealed_copy(path), path)
    except BaseException as e:
        os.write(ready_w, f"seal-binary: {path}: {e}".encode())
        os._exit(1)
    devnull = os.open(os.devnull, os.O_RDWR)
    for std in (0, 1, 2):
        os.dup2(devnull, std)
    os.write(ready_w, f"ok: {path} is a sealed in-memory copy (holder pid {os.getpid()})".encode())
    os.close(ready_w)
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    main(sys.argv[1])
