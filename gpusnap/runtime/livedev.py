"""Give a running container other device nodes: the nodes in its /dev and the
cgroup rule that lets it open them, both undoable (the live half of `gpusnap move`).

runc made the container's /dev a tmpfs and mknod'ed the spec's devices in it;
nothing in the runtime changes them afterwards, so gpusnap does it from a
child that joins the container's mount namespace.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import select
import signal
import stat
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterator, NoReturn, Sequence

from gpusnap.errors import GpusnapError
from gpusnap.gpu.nodes import DeviceRemap
from gpusnap.oci.spec.cgroup import remap_cgroup_rules
from gpusnap.oci.spec.devices import remap_devices
from gpusnap.runtime.devcgroup import DeviceAccess, Rule, container_rules, device_cgroup
from gpusnap.waits import Bound

_CLONE_NEWNS = 0x00020000


def _in_mount_ns(pid: int, action: Callable[[], bytes | None], doing: str = "change") -> bytes:
    """Run ``action()`` in a child that has joined ``pid``'s mount namespace; what
    it returns comes back.

    The parent runs libcuda's threads by now (the GPU was quiesced): the child
    calls setns resolved before the fork, not dlopen, whose lock another thread
    may have held at the fork, and the parent waits for it within DEVICES."""
    setns = ctypes.CDLL(None, use_errno=True).setns
    ns = os.open(f"/proc/{pid}/ns/mnt", os.O_RDONLY)
    r, w = os.pipe()
    with ctrl_c_held():
        child = os.fork()
        if child == 0:
            _child(ns, r, w, setns, action)
        os.close(w)
        os.close(ns)
        try:
            said, status = _reap(child, r, Bound.of("DEVICES"))
        finally:
            os.close(r)
    if status != 0:
        raise GpusnapError(f"cannot {doing} the container's device nodes ({said.decode().strip()})")
    return said


def _child(ns: int, r: int, w: int, setns, action: Callable[[], bytes | None]) -> NoReturn:
    """The forked child: single-threaded, as setns(CLONE_NEWNS) requires."""
    try:
        # Ctrl-C reaches the terminal's whole process group: ignored, so that a
        # change of the nodes is never cut mid-way (the parent waits for it)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGQUIT, signal.SIG_IGN)
        os.close(r)
        if setns(ns, _CLONE_NEWNS) != 0:
            raise OSError(ctypes.get_errno(), "setns")
        said = action()
        if isinstance(said, bytes):
            os.write(w, said)
    except OSError as exc:
        os.write(w, f"{exc.filename or ''}: {exc.strerror}".encode())
        os._exit(1)
    except BaseException:  # never unwind the parent's stack in the child
        os._exit(1)
    os._exit(0)


@contextlib.contextmanager
def ctrl_c_held() -> Iterator[None]:
    """A Ctrl-C inside is held, then delivered: the node-changing child finishes
    its change (an undo begun meanwhile would race it), and an undo finishes.
    (A handler, not a signal mask: the parent's other threads, libcuda's, would
    take a masked signal for it. Only the main thread may set one; another
    thread never gets a Ctrl-C.)"""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    before = signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)
    if held and callable(before):
        before(signal.SIGINT, None)  # Python's own handler raises KeyboardInterrupt
    elif held and before == signal.SIG_DFL:
        raise KeyboardInterrupt


def _reap(child: int, r: int, bound: Bound) -> tuple[bytes, int]:
    """(what the child wrote to ``r``, its wait status), within ``bound``: past
    it the child is killed."""
    deadline = time.monotonic() + bound.seconds
    said: list[bytes] = []
    status: int | None = None
    while status is None:
        status = _reap_step(child, r, deadline, bound, said)
    return b"".join(said), status


def _reap_step(child: int, r: int, deadline: float, bound: Bound, said: list[bytes]) -> int | None:
    """One wait for the child: its wait status once it has exited, else None."""
    ready, _, _ = select.select([r], [], [], max(0.0, deadline - time.monotonic()))
    if not ready:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
        raise bound.expired("the child changing the container's device nodes",
                            "the move stops and is undone; the container's "
                            "/dev/nvidia* nodes may be half-changed (`podman exec "
                            "CTR ls -l /dev` shows them)")
    chunk = os.read(r, 4096)
    if chunk:
        said.append(chunk)
        return None
    return os.waitpid(child, 0)[1]  # the pipe closed: it has exited (or is exiting)


_TMP = ".gpusnap"  # a node being made, renamed over its path once complete


@dataclass(frozen=True)
class Node:
    """A character device node as a container's /dev has it, or is to have it."""

    path: str
    major: int
    minor: int
    mode: int  # permission bits
    uid: int
    gid: int

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Node":
        return cls(str(d["path"]), *(int(d[k]) for k in ("major", "minor", "mode", "uid", "gid")))


def survey(pid: int, paths: Sequence[str]) -> list[Node]:
    """The nodes at ``paths`` in ``pid``'s /dev as they are now, what an undo
    puts back; each must be a character device."""
    if not paths:
        return []

    def read() -> bytes:
        found = []
        for path in paths:
            st = os.stat(path, follow_symlinks=False)
            if not stat.S_ISCHR(st.st_mode):
                raise OSError(0, "not a character device", path)
            found.append(Node(path, os.major(st.st_rdev), os.minor(st.st_rdev),
                              stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid).to_dict())
        return json.dumps(found).encode()
    return [Node.from_dict(d) for d in json.loads(_in_mount_ns(pid, read, "read"))]


def set_nodes(pid: int, wanted: Sequence[Node], gone: Sequence[str]) -> None:
    """Make ``pid``'s /dev hold the ``wanted`` nodes and none of the ``gone``
    paths, from whatever state a change cut mid-way left there: so a change and
    its undo are the same step, which may be run again until it succeeds."""
    _in_mount_ns(pid, lambda: _make_nodes(wanted, gone))


def _make_nodes(wanted: Sequence[Node], gone: Sequence[str]) -> None:
    """In the container's mount namespace: each wanted path made its node at once
    (a path both given and taken, a swap 0<->1, is never missing), then the
    paths no longer wanted removed, with any temp a cut change left."""
    for node in wanted:
        _make_node(node)
    for path in gone:
        for stale in (path + _TMP, path):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(stale)


def _make_node(node: Node) -> None:
    tmp = node.path + _TMP
    with contextlib.suppress(FileNotFoundError):  # left by a change cut here
        os.unlink(tmp)
    os.mknod(tmp, stat.S_IFCHR | 0o600, os.makedev(node.major, node.minor))
    try:
        os.chown(tmp, node.uid, node.gid)
        os.chmod(tmp, node.mode)  # after the chown, which clears setuid bits; mknod's mode is umask'ed
        os.rename(tmp, node.path)  # atomic: the path is the old node or the new one
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _only_in(nodes: Sequence[Node], other: Sequence[Node]) -> list[str]:
    """Paths of ``nodes`` that ``other`` does not name."""
    keep = {n.path for n in other}
    return [n.path for n in nodes if n.path not in keep]


@dataclass
class LiveDevices:
    """A planned change of a running container's devices; ``apply`` then ``undo`` if needed."""

    pid: int
    access: DeviceAccess
    before: tuple[Node, ...] = ()  # the container's nodes the change replaces, as they were
    after: tuple[Node, ...] = ()  # the nodes it gets instead
    _applied: list[str] = field(default_factory=list)

    def apply(self) -> None:
        # each marked before it starts, so one cut mid-way (a Ctrl-C just after v2's
        # swap) is undone too: plan_live checked that the undo can always be made
        self._applied.append("cgroup")
        self.access.apply()
        self._applied.append("nodes")
        set_nodes(self.pid, self.after, _only_in(self.before, self.after))

    def undo(self) -> None:
        if "nodes" in self._applied:
            set_nodes(self.pid, self.before, _only_in(self.after, self.before))
        if "cgroup" in self._applied:
            self.access.undo()
        self._applied.clear()

    def close(self) -> None:
        self.access.close()

    def to_dict(self) -> dict:
        """What an undo needs, for a record that outlives this process (ops/moving.py)."""
        return {"pid": self.pid, "cgroup": str(self.access.cgroup),
                "cgroup_version": self.access.version,
                "rules_before": [asdict(r) for r in self.access.before],
                "rules_after": [asdict(r) for r in self.access.after],
                "nodes_before": [n.to_dict() for n in self.before],
                "nodes_after": [n.to_dict() for n in self.after]}

    @classmethod
    def recorded(cls, d: dict) -> "LiveDevices":
        """The change ``to_dict`` describes, as a process cut anywhere in it may
        have left it: ``undo`` puts back both the nodes and the rule."""
        rules = {k: [Rule(**r) for r in d[k]] for k in ("rules_before", "rules_after")}
        access = DeviceAccess(int(d["pid"]), Path(d["cgroup"]), int(d["cgroup_version"]),
                              rules["rules_before"], rules["rules_after"])
        return cls(access.pid, access, tuple(map(Node.from_dict, d["nodes_before"])),
                   tuple(map(Node.from_dict, d["nodes_after"])), ["cgroup", "nodes"])


def plan_live(pid: int, spec: dict, remap: DeviceRemap) -> LiveDevices:
    """Check everything the change needs before anything changes: the
    container's old nodes are read here, for an undo to put back as they were."""
    spec_after = remap_cgroup_rules(remap_devices(spec, remap), remap)
    cgroup, version = device_cgroup(pid)
    access = DeviceAccess(pid, cgroup, version, container_rules(spec), container_rules(spec_after))
    access.check()
    # A remap names every node of a moved GPU (its DRM card and render nodes where
    # both hosts have them); a container given /dev/nvidiaN alone has only those.
    given = {d.get("path") for d in (spec.get("linux") or {}).get("devices") or []}
    changes = [n for n in remap.nodes if n.old_path in given]
    before = survey(pid, [n.old_path for n in changes])
    after = tuple(replace(node, path=n.new_path, major=n.new[0], minor=n.new[1])
                  for node, n in zip(before, changes))
    return LiveDevices(pid, access, tuple(before), after)
