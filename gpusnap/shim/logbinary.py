"""binary:// log URIs: the container's output goes to a logging program, as containerd's runc shim does it.

nerdctl runs detached containers with stdout = stderr =
`binary:///path/to/nerdctl?_NERDCTL_INTERNAL_LOGGING=/var/lib/nerdctl/...`, and
`ctr run --log-uri binary:///...` does the same. Contract (containerd's
pkg/process NewBinaryIO): the program is started with each query key and its
first value as arguments, CONTAINER_ID and CONTAINER_NAMESPACE in its
environment, the read ends of the stdout and stderr pipes as fds 3 and 4, and
a pipe's write end as fd 5, which it closes (or writes to) when it is ready.
It ends by itself when the container's output reaches EOF.
"""

from __future__ import annotations

import fcntl
import os
import select
import signal
import urllib.parse

from gpusnap.shim.reaper import Reaper

READY_TIMEOUT = 30.0  # containerd waits forever; a logger that never signals should fail the request
_HIGH_FD = 64


class LoggerError(RuntimeError):
    pass


def logger_argv(uri: str) -> list[str]:
    u = urllib.parse.urlsplit(uri)
    if u.scheme != "binary" or not u.path:
        raise LoggerError(f"stdio {uri}: not a binary:///PATH log URI")
    argv = [u.path]
    for key, values in urllib.parse.parse_qs(u.query, keep_blank_values=True).items():
        argv += [key, values[0]]
    return argv


class BinaryLogger:
    """A running logging program; `stdout`/`stderr` are the write ends for the container."""

    def __init__(self, uri: str, container_id: str, namespace: str, reaper: Reaper) -> None:
        argv = logger_argv(uri)
        out_r, self.stdout = os.pipe()
        err_r, self.stderr = os.pipe()
        ready_r, ready_w = os.pipe()
        # Renumbered high so the spawn's dup2 onto 3, 4, 5 cannot clobber a source fd.
        high = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, _HIGH_FD) for fd in (out_r, err_r, ready_w)]
        for fd in (out_r, err_r, ready_w):
            os.close(fd)
        env = dict(os.environ, CONTAINER_ID=container_id, CONTAINER_NAMESPACE=namespace)
        try:
            self.pid, self.exited = reaper.spawn(argv, extra_fds=tuple(high), env=env)
        except OSError as e:
            for fd in (*high, ready_r, self.stdout, self.stderr):
                os.close(fd)
            raise LoggerError(f"stdio {uri}: cannot start {argv[0]}: {e.strerror}") from None
        finally:
            for fd in high:
                try:
                    os.close(fd)
                except OSError:
                    pass
        try:
            ready, _, _ = select.select([ready_r], [], [], READY_TIMEOUT)
            if not ready:
                self._stop(0)
                raise LoggerError(f"stdio {uri}: {argv[0]} did not signal ready in {READY_TIMEOUT:.0f}s")
            os.read(ready_r, 1)
        finally:
            os.close(ready_r)

    def wait(self, timeout: float) -> bool:
        """True once the program has ended (it does when the output it reads ends)."""
        try:
            self.exited.result(timeout)
            return True
        except Exception:
            return False

    def _stop(self, grace: float) -> None:
        # SIGTERM first so it can flush, as containerd does; SIGKILL after the grace time.
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
            if self.exited.done():
                return
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                return
            self.wait(wait)

    def close(self, grace: float = 12.0) -> None:
        """Drop the shim's write ends (never handed to runc), then end the program if it lingers."""
        for name in ("stdout", "stderr"):
            fd = getattr(self, name)
            if fd is not None:
                os.close(fd)
                setattr(self, name, None)
        if not self.wait(grace):
            self._stop(grace)

