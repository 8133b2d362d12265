"""Give a running container other device nodes: the nodes in its /dev and the
cgroup rule that lets it open them, both undoable (the live half of `gpusnap move`).

runc made the container's /dev a tmpfs and mknod'ed the spec's devices in it;
nothing in the runtime changes them afterwards, so gpusnap does it from a
child that joins the container's mount namespace.
"""

from __future__ import annotations

import ctypes
import os
import stat
from dataclasses import dataclass, field

from gpusnap.errors import GpusnapError
from gpusnap.gpu.nodes import DeviceRemap
from gpusnap.oci.spec.cgroup import remap_cgroup_rules
from gpusnap.oci.spec.devices import remap_devices
from gpusnap.runtime.devcgroup import DeviceAccess, container_rules, device_cgroup

_CLONE_NEWNS = 0x00020000


def _in_mount_ns(pid: int, action) -> None:
    """Run ``action()`` in a child that has joined ``pid``'s mount namespace."""
    ns = os.open(f"/proc/{pid}/ns/mnt", os.O_RDONLY)
    r, w = os.pipe()
    child = os.fork()
    if child == 0:  # single-threaded here, as setns(CLONE_NEWNS) requires
        os.close(r)
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.setns(ns, _CLONE_NEWNS) != 0:
                raise OSError(ctypes.get_errno(), "setns")
            action()
        except OSError as exc:
            os.write(w, f"{exc.filename or ''}: {exc.strerror}".encode())
            os._exit(1)
        os._exit(0)
    os.close(w)
    os.close(ns)
    err = b""
    while chunk := os.read(r, 4096):
        err += chunk
    os.close(r)
    _, status = os.waitpid(child, 0)
    if status != 0:
        raise GpusnapError(f"cannot change the container's device nodes ({err.decode().strip()})")


def _swap_nodes(pid: int, pairs: list[tuple[str, str, tuple[int, int]]]) -> None:
    """For each (old path, new path, new numbers): make the new node like the old one, drop the old."""
    def act() -> None:
        made = []
        for old, new, (major, minor) in pairs:
            st = os.stat(old, follow_symlinks=False)
            if not stat.S_ISCHR(st.st_mode):
                raise OSError(0, "not a character device", old)
            tmp = f"{new}.gpusnap"
            os.mknod(tmp, stat.S_IFCHR | stat.S_IMODE(st.st_mode), os.makedev(major, minor))
            os.chown(tmp, st.st_uid, st.st_gid)
            made.append((old, tmp, new))
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
    _applied: list[str] = field(default_factory=list)

    def apply(self) -> None:
        self.access.apply()
        self._applied.append("cgroup")
        _swap_nodes(self.pid, [(n.old_path, n.new_path, n.new) for n in self.remap.nodes])
        self._applied.append("nodes")

    def undo(self) -> None:
        if "nodes" in self._applied:
            _swap_nodes(self.pid, [(n.new_path, n.old_path, n.old) for n in self.remap.nodes])
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
    return LiveDevices(pid, remap, access, after)
