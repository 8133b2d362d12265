"""Give a running container other device nodes: the nodes in its /dev and the
cgroup rule that lets it open them, both undoable (the live half of `gpusnap move`).

runc made the container's /dev a tmpfs and mknod'ed the spec's devices in it;
nothing in the runtime changes them afterwards, so gpusnap does it from a
child that joins the container's mount namespace.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import signal
import stat
import time
from dataclasses import dataclass, field
from typing import Callable, NoReturn

from gpusnap.errors import GpusnapError
from gpusnap.gpu.nodes import DeviceRemap, NodeChange
from gpusnap.oci.spec.cgroup import remap_cgroup_rules
from gpusnap.oci.spec.devices import remap_devices
from gpusnap.runtime.devcgroup import DeviceAccess, container_rules, device_cgroup
from gpusnap.waits import Bound

_CLONE_NEWNS = 0x00020000


def _in_mount_ns(pid: int, action: Callable[[], bytes | None]) -> bytes:
    """Run ``action()`` in a child that has joined ``pid``'s mount namespace; what
    it returns comes back.

    The parent runs libcuda's threads by now (the GPU was quiesced): the child
    calls setns resolved before the fork, not dlopen, whose lock another thread
    may have held at the fork, and the parent waits for it within DEVICES."""
    setns = ctypes.CDLL(None, use_errno=True).setns
    ns = os.open(f"/proc/{pid}/ns/mnt", os.O_RDONLY)
    r, w = os.pipe()
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
        raise GpusnapError(f"cannot change the container's device nodes ({said.decode().strip()})")
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


def _reap(child: int, r: int, bound: Bound) -> tuple[bytes, int]:
    """(what the child wrote to ``r``, its wait status), within ``bound``: past
    it the child is killed. A Ctrl-C meanwhile is raised once the child has
    exited: it finishes its change, and an undo begun meanwhile would race it."""
    deadline = time.monotonic() + bound.seconds
    said: list[bytes] = []
    interrupted: KeyboardInterrupt | None = None
    status: int | None = None
    while status is None:
        try:
            status = _reap_step(child, r, deadline, bound, said)
        except KeyboardInterrupt as exc:
            interrupted = exc
        except ChildProcessError:
            if interrupted is None:
                raise
            status = -1  # reaped just as the Ctrl-C came: it is raised below
    if interrupted is not None:
        raise interrupted
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


def _swap_nodes(pid: int, pairs: list[tuple[str, str, tuple[int, int]]]) -> None:
    """For each (old path, new path, new numbers): make the new node like the old one, drop the old."""
    def act() -> None:
        made = []
        try:
            for old, new, (major, minor) in pairs:
                st = os.stat(old, follow_symlinks=False)
                if not stat.S_ISCHR(st.st_mode):
                    raise OSError(0, "not a character device", old)
                tmp = f"{new}.gpusnap"
                with contextlib.suppress(FileNotFoundError):  # left by a move killed here
                    os.unlink(tmp)
                os.mknod(tmp, stat.S_IFCHR | stat.S_IMODE(st.st_mode), os.makedev(major, minor))
                made.append((old, tmp, new))
                os.chown(tmp, st.st_uid, st.st_gid)
        except BaseException:  # nothing swapped yet: the container's /dev as it was
            for _, tmp, _ in made:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
            raise
        for old, tmp, new in made:  # all swaps at once: a swap 0<->1 stays one
            os.unlink(old)
        for old, tmp, new in made:
            os.rename(tmp, new)
    _in_mount_ns(pid, act)


@dataclass
class LiveDevices:
    """A planned change of a running container's devices; ``apply`` then ``undo`` if needed."""

    pid: int
    remap: DeviceRemap
    access: DeviceAccess
    spec_after: dict
    nodes: tuple[NodeChange, ...] = ()  # the remap's nodes the container was given
    _applied: list[str] = field(default_factory=list)

    def apply(self) -> None:
        self.access.apply()
        self._applied.append("cgroup")
        _swap_nodes(self.pid, [(n.old_path, n.new_path, n.new) for n in self.nodes])
        self._applied.append("nodes")

    def undo(self) -> None:
        if "nodes" in self._applied:
            _swap_nodes(self.pid, [(n.new_path, n.old_path, n.old) for n in self.nodes])
        if "cgroup" in self._applied:
            self.access.undo()
        self._applied.clear()

    def close(self) -> None:
        self.access.close()


def plan_live(pid: int, spec: dict, remap: DeviceRemap) -> LiveDevices:
    """Check everything the change needs before anything changes."""
    after = remap_cgroup_rules(remap_devices(spec, remap), remap)
    cgroup, version = device_cgroup(pid)
    access = DeviceAccess(pid, cgroup, version, container_rules(spec), container_rules(after))
    # A remap names every node of a moved GPU (its DRM card and render nodes where
    # both hosts have them); a container given /dev/nvidiaN alone has only those.
    given = {d.get("path") for d in (spec.get("linux") or {}).get("devices") or []}
    return LiveDevices(pid, remap, access, after, tuple(n for n in remap.nodes if n.old_path in given))
