"""The shim's view of a container: its init process and exec'd processes."""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gpusnap.shim.stdio import Paths, ProcessIO

if TYPE_CHECKING:
    from gpusnap.shim.oom import OomWatch


class ShimError(Exception):
    """A request the shim refuses; CODE is a grpc.StatusCode name."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def not_found(msg: str) -> ShimError:
    return ShimError("NOT_FOUND", msg)


def precondition(msg: str) -> ShimError:
    return ShimError("FAILED_PRECONDITION", msg)


@dataclass
class Proc:
    id: str  # exec id; the container id for init
    paths: Paths
    io: ProcessIO | None = None
    pid: int = 0
    status: str = "created"  # created, running, paused, stopped
    restoring: bool = False  # Start is restoring it (still "created" to containerd)
    exit_status: int = 0
    exited_at_ns: int = 0
    exited: threading.Event = field(default_factory=threading.Event)
    # Set once Start has published TaskStart (or will not): TaskExit waits for it.
    started: threading.Event = field(default_factory=threading.Event)
    # Set once TaskExit is published: init's exit waits for its execs'.
    published: threading.Event = field(default_factory=threading.Event)
    spec: bytes = b""  # exec: runtime-spec Process JSON

    def set_exited(self, status: int, at_ns: int) -> None:
        self.exit_status, self.exited_at_ns = status, at_ns
        self.status = "stopped"
        self.exited.set()

    def wait_exit(self, caller_active: Callable[[], bool], slice_s: float = 1.0) -> bool:
        """Wait for the exit while CALLER_ACTIVE(): False once the caller has gone
        (Ctrl-C, a client timeout, containerd restarting), which frees the worker
        thread: abandoned waits would otherwise use up the server's fixed pool."""
        while not self.exited.wait(slice_s):
            if not caller_active():
                return False
        return True

    def file_stem(self) -> str:
        # exec ids are the client's strings: keep them out of file names
        return "exec-" + hashlib.sha256(self.id.encode()).hexdigest()[:16]


@dataclass
class Container:
    id: str
    bundle: str
    init: Proc
    rootfs: str = ""  # where the shim mounted the rootfs ("" when containerd gave no mounts)
    checkpoint: str = ""  # CRIU image to restore from at Start
    parent_checkpoint: str = ""
    no_pivot: bool = False
    no_new_keyring: bool = False
    criu_work: str = ""
    execs: dict[str, Proc] = field(default_factory=dict)
    dumping: bool = False  # a Checkpoint runs: a Resume must wait for its end
    oom: OomWatch | None = None  # its init's memory cgroup, watched from Start to Delete

    def process(self, exec_id: str) -> Proc:
        if not exec_id:
            return self.init
        p = self.execs.get(exec_id)
        if p is None:
            raise not_found(f"process {exec_id} does not exist in {self.id}")
        return p

    def pid_file(self, p: Proc) -> str:
        return os.path.join(self.bundle, "init.pid" if p is self.init else p.file_stem() + ".pid")

    def owns_pid_namespace(self) -> bool:
        """True when the container has its own pid namespace (its processes die with init)."""
        try:
            with open(os.path.join(self.bundle, "config.json")) as f:
                spec = json.load(f)
        except (OSError, ValueError):
            return False
        for ns in (spec.get("linux") or {}).get("namespaces") or []:
            if ns.get("type") == "pid" and not ns.get("path"):
                return True
        return False


def read_pid(path: str) -> int:
    with open(path) as f:
        return int(f.read().strip())
