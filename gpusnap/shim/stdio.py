"""A process's stdio: pipes (or a pty) between runc's child and containerd's FIFOs.

runc gets pipes, never the FIFOs themselves, as containerd's runc shim does:
CRIU records a pipe in the checkpoint and `runc restore` reconnects it to the
new pipes, while a FIFO path would not exist on the restoring side.
Output FIFOs are opened O_RDWR, so opening never blocks on a reader and a
client that goes away (ctr run -d) does not break the copy.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import socket
import struct
import tempfile
import termios
import threading
from dataclasses import dataclass
from typing import Callable

from gpusnap.shim.logbinary import BinaryLogger
from gpusnap.shim.runc import Stdio

log = logging.getLogger("gpusnap.shim")


@dataclass(frozen=True)
class Paths:
    stdin: str = ""
    stdout: str = ""
    stderr: str = ""
    terminal: bool = False


def _open_output(path: str) -> int:
    if path.startswith("file://"):
        # The container's output, at a path its owner chose (--log-uri): a log as
        # they expect it, 0644; gpusnap's own state and checkpoints are 0600.
        return os.open(path[len("file://"):], os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
    return os.open(path, os.O_RDWR | os.O_CLOEXEC)


def _copy(src: int, dst: int, on_done=None) -> None:
    try:
        while True:
            try:
                data = os.read(src, 65536)
            except OSError:  # EIO: the pty's last holder is gone
                break
            if not data:
                break
            view = memoryview(data)
            while view:
                view = view[os.write(dst, view):]
    except OSError as e:
        log.debug("stdio copy stopped: %s", e)
    finally:
        if on_done:
            on_done()


def is_binary(path: str) -> bool:
    return path.startswith("binary://")


class ProcessIO:
    """Pipes for runc's child plus the threads copying them to the FIFOs (or a binary:// logger)."""

    def __init__(self, paths: Paths, binary_logger: Callable[[str], BinaryLogger] | None = None) -> None:
        self.paths = paths
        self.logger: BinaryLogger | None = None
        self._lock = threading.Lock()
        self._stdin_w: int | None = None
        # The shim's own writer on the stdin FIFO, as containerd's shim keeps one:
        # the copy sees EOF only once CloseIO drops it and every client closed,
        # after what is still in the FIFO reached the process
        self._stdin_keep: int | None = None
        self._child_ends: list[int] = []
        self._threads: list[threading.Thread] = []
        self.stdio = Stdio()
        self._outputs: list[tuple[int, int]] = []  # (pipe read end, output fd)
        self.console: int | None = None
        self._console_out: int | None = None
        self._console_sock: socket.socket | None = None
        self._console_dir: str | None = None
        # Outputs are opened before runc runs, so a bad path fails the request
        # while nothing has started yet.
        if is_binary(paths.stdout):
            if binary_logger is None:
                raise ValueError(f"stdio {paths.stdout}: binary:// log URIs are not supported here")
            self.logger = binary_logger(paths.stdout)
        if paths.terminal:
            if self.logger is not None:
                # The console's output goes to the logger's stdout; it gets no stderr.
                self._console_out, self.logger.stdout = self.logger.stdout, None
                os.close(self.logger.stderr)
                self.logger.stderr = None
            elif paths.stdout:
                self._console_out = _open_output(paths.stdout)
            return
        if paths.stdin:
            r, w = os.pipe()
            self.stdio.stdin, self._stdin_w = r, w
            self._child_ends.append(r)
        if self.logger is not None:
            # The child writes straight into the logger's pipes: nothing to copy here.
            self.stdio.stdout, self.stdio.stderr = self.logger.stdout, self.logger.stderr
            self._child_ends += [self.logger.stdout, self.logger.stderr]
            self.logger.stdout = self.logger.stderr = None
            return
        for name in ("stdout", "stderr"):
            path = getattr(paths, name)
            if path:
                out = _open_output(path)
                r, w = os.pipe()
                setattr(self.stdio, name, w)
                self._child_ends.append(w)
                self._outputs.append((r, out))

    # --- terminal ---------------------------------------------------------------

    def console_socket(self, directory: str) -> str:
        """A socket runc sends the pty master to (--console-socket)."""
        self._console_dir = tempfile.mkdtemp(prefix="pty-", dir=directory)
        path = os.path.join(self._console_dir, "s")
        self._console_sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._console_sock.bind(path)
        self._console_sock.listen(1)
        return path

    def _receive_master(self) -> int:
        assert self._console_sock is not None
        self._console_sock.settimeout(30)
        conn, _ = self._console_sock.accept()
        with conn:
            _, fds, _, _ = socket.recv_fds(conn, 4096, 1)
        if not fds:
            raise RuntimeError("runc sent no pty master on the console socket")
        return fds[0]

    def _close_console_socket(self) -> None:
        if self._console_sock is not None:
            self._console_sock.close()
            self._console_sock = None
        if self._console_dir:
            shutil.rmtree(self._console_dir, ignore_errors=True)
            self._console_dir = None

    # --- after runc has handed the child its ends -------------------------------

    def started(self) -> None:
        """runc has run: close the child's pipe ends here and start copying."""
        for fd in self._child_ends:
            os.close(fd)
        self._child_ends = []
        if self.paths.stdin:
            self._keep_stdin_open()
        if self.paths.terminal:
            try:
                self.console = self._receive_master()
            finally:
                self._close_console_socket()
            out, self._console_out = self._console_out, None
            if out is not None:
                self._spawn(_copy, self.console, out, lambda: os.close(out))
            if self.paths.stdin:
                self._spawn(self._copy_stdin, self.console, name="stdin")
            return
        outputs, self._outputs = self._outputs, []
        for r, out in outputs:
            self._spawn(_copy, r, out, lambda r=r, out=out: (os.close(r), os.close(out)))
        if self.paths.stdin:
            self._spawn(self._copy_stdin, None, name="stdin")

    def _spawn(self, fn, *args, name: str = "stdout") -> None:
        t = threading.Thread(target=fn, args=args, daemon=True, name=name)
        t.start()
        self._threads.append(t)

    def _copy_stdin(self, console: int | None) -> None:
        # Blocks until the client opens its end; EOF from it closes the child's stdin.
        try:
            src = os.open(self.paths.stdin, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as e:
            log.debug("stdin %s: %s", self.paths.stdin, e)
            return
        self._keep_writer_only()
        try:
            dst = console if console is not None else self._stdin_w
            if dst is not None:
                _copy(src, dst)
        finally:
            os.close(src)
            if console is None:
                self.close_stdin()

    def _keep_stdin_open(self) -> None:
        try:  # O_RDWR: a FIFO's open that never waits for the other end (Linux)
            self._stdin_keep = os.open(self.paths.stdin, os.O_RDWR | os.O_CLOEXEC)
        except OSError as e:  # CloseIO then closes the process's stdin at once, as before
            log.debug("stdin %s: %s", self.paths.stdin, e)

    def _keep_writer_only(self) -> None:
        """The copy's reader is open: the shim's handle becomes a writer alone, so
        that once the copy ends a client still writing gets EPIPE, not a FIFO
        that fills and blocks it."""
        with self._lock:
            if self._stdin_keep is None:
                return
            try:
                writer = os.open(self.paths.stdin, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            except OSError as e:
                log.debug("stdin %s: %s", self.paths.stdin, e)
                return
            os.close(self._stdin_keep)
            self._stdin_keep = writer

    def close_io(self) -> None:
        """CloseIO: the client has sent all it will. The process's stdin closes
        once the copy has drained the FIFO (and no client holds it open)."""
        with self._lock:
            keep, self._stdin_keep = self._stdin_keep, None
        if keep is not None:
            os.close(keep)
        else:
            self.close_stdin()

    def close_stdin(self) -> None:
        """The process's end of stdin closed (the copy's end, or a delete)."""
        with self._lock:
            if self._stdin_w is not None:
                os.close(self._stdin_w)
                self._stdin_w = None

    def resize(self, width: int, height: int) -> None:
        if self.console is None:
            raise ValueError("process has no terminal")
        fcntl.ioctl(self.console, termios.TIOCSWINSZ, struct.pack("HHHH", height, width, 0, 0))

    def wait(self, timeout: float) -> None:
        """Wait for the output copies to drain (their FIFOs then see EOF)."""
        for t in self._threads:
            if t.name == "stdout":
                t.join(timeout)
        if self.logger is not None:
            self.logger.wait(timeout)

    def close(self) -> None:
        """Drop everything (a failed create, or delete)."""
        for fd in self._child_ends:
            os.close(fd)
        self._child_ends = []
        for r, out in self._outputs:  # never started: nothing copies them
            os.close(r)
            os.close(out)
        self._outputs = []
        if self._console_out is not None:
            os.close(self._console_out)
            self._console_out = None
        self.close_io()
        self.close_stdin()
        self._close_console_socket()
        if self.logger is not None:
            self.logger.close(grace=2.0)
            self.logger = None
        if self.console is not None:
            try:
                os.close(self.console)
            except OSError:
                pass
            self.console = None
