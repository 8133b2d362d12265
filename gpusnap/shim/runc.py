"""runc's command line, as the shim drives it.

Every command logs JSON to the bundle's log.json (runc's own stderr may be
the container's stderr pipe), and a failure is reported with runc's last
error line from there.
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import tempfile
import time
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field

from gpusnap.procs import process_tree
from gpusnap.shim.bundle import runc_argv
from gpusnap.shim.reaper import Reaper
from gpusnap.waits import Bound, raise_words


log = logging.getLogger("gpusnap.shim")


class RuncError(RuntimeError):
    pass


@dataclass
class Stdio:
    """The fds a runc command hands its child process as 0, 1, 2 (None: /dev/null)."""

    stdin: int | None = None
    stdout: int | None = None
    stderr: int | None = None


@dataclass
class CheckpointOpts:
    image_path: str
    work_path: str
    leave_running: bool = True
    tcp_established: bool = False
    ext_unix_sk: bool = False
    shell_job: bool = False
    file_locks: bool = False
    empty_ns: list[str] = field(default_factory=list)


def _kill_tree(pid: int) -> None:
    """SIGKILL runc and what it started (CRIU, stuck, is what holds the
    container frozen): found before runc dies, when CRIU would be re-parented."""
    for member in reversed(process_tree(pid)):
        try:
            os.kill(member, signal.SIGKILL)
        except ProcessLookupError:
            pass


class Runc:
    def __init__(self, reaper: Reaper, root: str, log_path: str, binary: str = "runc",
                 systemd_cgroup: bool = False) -> None:
        self.reaper = reaper
        self.root = root
        self.log_path = log_path
        self.binary = binary
        self.systemd_cgroup = systemd_cgroup  # containerd's SystemdCgroup: a slice:prefix:name cgroupsPath

    def _run(self, args: list[str], stdio: Stdio | None = None, want_output: bool = False) -> str:
        t0 = time.monotonic()
        argv = [*runc_argv(self.binary, self.root, self.systemd_cgroup),
                "--log", self.log_path, "--log-format", "json", *args]
        try:
            start_at = os.path.getsize(self.log_path)
        except OSError:
            start_at = 0
        out_r = out_w = None
        if stdio is None:
            # runc's stdout and stderr go to one pipe: small output, read after exit
            # would risk a full pipe, so read it while it runs.
            out_r, out_w = os.pipe()
            stdio = Stdio(None, out_w, out_w)
        try:
            pid, fut = self.reaper.spawn(argv, stdin=stdio.stdin, stdout=stdio.stdout,
                                         stderr=stdio.stderr)
        finally:
            if out_w is not None:
                os.close(out_w)
        # A checkpoint or restore of a GPU process takes minutes; a runc that
        # never ends (CRIU stuck) is killed at its bound, so the shim answers.
        bound = Bound.of("RUNC")
        deadline = time.monotonic() + bound.seconds
        timed_out = False
        output = b""
        if out_r is not None:
            chunks = []
            with os.fdopen(out_r, "rb") as f:
                while (left := deadline - time.monotonic()) > 0 and \
                        select.select([f], [], [], left)[0]:
                    chunk = f.read1(65536)
                    if not chunk:
                        break
                    chunks.append(chunk)
                if time.monotonic() >= deadline:
                    _kill_tree(pid)  # before the pipe closes: no SIGPIPE story instead
                    timed_out = True
            output = b"".join(chunks)
        try:
            ex = fut.result(timeout=max(deadline - time.monotonic(), 0.1))
        except FutureTimeout:
            _kill_tree(pid)
            ex, timed_out = fut.result(), True  # reaped at once: SIGKILL cannot be refused
        if timed_out:
            raise RuncError(f"runc {args[0]}: no answer within {bound.seconds:.0f} s "
                            f"({raise_words('RUNC')} raises the bound)")
        log.debug("runc %s: %.1f ms", args[0], (time.monotonic() - t0) * 1000)
        if ex.status != 0:
            raise RuncError(self._last_error(start_at) or output.decode(errors="replace").strip()
                            or f"runc {args[0]} exited with {ex.status}")
        return output.decode(errors="replace") if want_output else ""

    def _last_error(self, since: int) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(since)
                lines = f.read().decode(errors="replace").splitlines()
        except OSError:
            return ""
        for line in reversed(lines):
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if entry.get("level") in ("error", "fatal"):
                return str(entry.get("msg", "")).strip()
        return ""

    def create(self, cid: str, bundle: str, pid_file: str, stdio: Stdio, console_socket: str | None = None,
               no_pivot: bool = False, no_new_keyring: bool = False) -> None:
        args = ["create", "--bundle", bundle, "--pid-file", pid_file]
        if console_socket:
            args += ["--console-socket", console_socket]
        if no_pivot:
            args.append("--no-pivot")
        if no_new_keyring:
            args.append("--no-new-keyring")
        self._run([*args, cid], stdio)

    def restore(self, cid: str, bundle: str, pid_file: str, stdio: Stdio, image_path: str, work_path: str,
                console_socket: str | None = None, no_pivot: bool = False, parent_path: str = "") -> None:
        args = ["restore", "--detach", "--no-subreaper", "--bundle", bundle, "--pid-file", pid_file,
                "--image-path", image_path, "--work-path", work_path]
        if parent_path:
            args += ["--parent-path", parent_path]
        if console_socket:
            args += ["--console-socket", console_socket]
        if no_pivot:
            args.append("--no-pivot")
        self._run([*args, cid], stdio)

    def exec(self, cid: str, process_json: str, pid_file: str, stdio: Stdio,
             console_socket: str | None = None) -> None:
        args = ["exec", "--detach", "--process", process_json, "--pid-file", pid_file]
        if console_socket:
            args += ["--console-socket", console_socket]
        self._run([*args, cid], stdio)

    def start(self, cid: str) -> None:
        self._run(["start", cid])

    def kill(self, cid: str, sig: int, all_procs: bool = False) -> None:
        self._run(["kill", *(["--all"] if all_procs else []), cid, str(sig)])

    def pause(self, cid: str) -> None:
        self._run(["pause", cid])

    def resume(self, cid: str) -> None:
        self._run(["resume", cid])

    def delete(self, cid: str, force: bool = False) -> None:
        self._run(["delete", *(["--force"] if force else []), cid])

    def state(self, cid: str) -> dict:
        return json.loads(self._run(["state", cid], want_output=True))

    def ps(self, cid: str) -> list[int]:
        return [int(p) for p in json.loads(self._run(["ps", "--format", "json", cid], want_output=True) or "[]")]

    def stats(self, cid: str) -> dict:
        """One reading of the container's cgroup (runc's types.Stats, as JSON): runc finds the
        cgroup itself, v1, v2 or systemd's, so the shim never looks for its path."""
        out = self._run(["events", "--stats", cid], want_output=True)
        for line in out.splitlines():  # stdout and stderr share the pipe: skip a stray line
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if isinstance(event, dict) and event.get("type") == "stats" and isinstance(event.get("data"), dict):
                return event["data"]
        raise RuncError(f"runc events --stats {cid}: no stats in its output: {out.strip()[:200]!r}")

    def update(self, cid: str, resources_json: bytes) -> None:
        with tempfile.NamedTemporaryFile(prefix="runc-update-", suffix=".json") as f:
            f.write(resources_json)
            f.flush()
            self._run(["update", "--resources", f.name, cid])

    def checkpoint(self, cid: str, o: CheckpointOpts) -> None:
        args = ["checkpoint", "--image-path", o.image_path, "--work-path", o.work_path]
        for flag, on in (("--leave-running", o.leave_running), ("--tcp-established", o.tcp_established),
                         ("--ext-unix-sk", o.ext_unix_sk), ("--shell-job", o.shell_job),
                         ("--file-locks", o.file_locks)):
            if on:
                args.append(flag)
        for ns in o.empty_ns:
            args += ["--empty-ns", ns]
        self._run([*args, cid])
