"""Mount the rootfs containerd's snapshotter describes onto BUNDLE/rootfs.

fstab-style options are split into mount(2) flags and the filesystem's data
string (overlay's lowerdir=..., upperdir=...), as containerd's mount package does.
"""

from __future__ import annotations

import ctypes
import errno
import os

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 0x1, 0x2, 0x4, 0x8
MS_SYNCHRONOUS, MS_REMOUNT, MS_MANDLOCK, MS_DIRSYNC = 0x10, 0x20, 0x40, 0x80
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC = 0x400, 0x800, 0x1000, 0x4000
MS_PRIVATE, MS_SLAVE, MS_SHARED, MS_RELATIME, MS_STRICTATIME = 1 << 18, 1 << 19, 1 << 20, 1 << 21, 1 << 24
MNT_DETACH = 2

# option -> (clear these flags?, flag)
_FLAGS = {
    "async": (True, MS_SYNCHRONOUS), "atime": (True, MS_NOATIME), "bind": (False, MS_BIND),
    "defaults": (False, 0), "dev": (True, MS_NODEV), "diratime": (True, MS_NODIRATIME),
    "dirsync": (False, MS_DIRSYNC), "exec": (True, MS_NOEXEC), "mand": (False, MS_MANDLOCK),
    "noatime": (False, MS_NOATIME), "nodev": (False, MS_NODEV), "nodiratime": (False, MS_NODIRATIME),
    "noexec": (False, MS_NOEXEC), "nomand": (True, MS_MANDLOCK), "norelatime": (True, MS_RELATIME),
    "nostrictatime": (True, MS_STRICTATIME), "nosuid": (False, MS_NOSUID), "rbind": (False, MS_BIND | MS_REC),
    "relatime": (False, MS_RELATIME), "remount": (False, MS_REMOUNT), "ro": (False, MS_RDONLY),
    "rw": (True, MS_RDONLY), "strictatime": (False, MS_STRICTATIME), "suid": (True, MS_NOSUID),
    "sync": (False, MS_SYNCHRONOUS),
}
_PROPAGATION = {"private": MS_PRIVATE, "rprivate": MS_PRIVATE | MS_REC, "slave": MS_SLAVE,
                "rslave": MS_SLAVE | MS_REC, "shared": MS_SHARED, "rshared": MS_SHARED | MS_REC}

_libc = ctypes.CDLL(None, use_errno=True)


class MountError(OSError):
    pass


def parse_options(options: list[str]) -> tuple[int, int, str]:
    """(flags, propagation flags, data) for mount(2)."""
    flags = prop = 0
    data = []
    for opt in options:
        if opt in _FLAGS:
            clear, flag = _FLAGS[opt]
            flags = flags & ~flag if clear else flags | flag
        elif opt in _PROPAGATION:
            prop |= _PROPAGATION[opt]
        else:
            data.append(opt)
    return flags, prop, ",".join(data)


def _mount(source: str, target: str, fstype: str, flags: int, data: str) -> None:
    if _libc.mount(source.encode(), target.encode(), fstype.encode() if fstype else None,
                   ctypes.c_ulong(flags), data.encode() if data else None) != 0:
        err = ctypes.get_errno()
        raise MountError(err, f"mount {fstype or 'bind'} {source} on {target}: {os.strerror(err)}")


def mount(fstype: str, source: str, target: str, options: list[str]) -> None:
    flags, prop, data = parse_options(options)
    if len(data) >= os.sysconf("SC_PAGESIZE"):
        raise MountError(errno.E2BIG, f"mount options for {target} exceed a page ({len(data)} bytes)")
    if flags & MS_BIND:
        # A bind ignores MS_RDONLY and friends until a remount.
        _mount(source, target, "", flags & (MS_BIND | MS_REC), "")
        extra = flags & ~(MS_BIND | MS_REC)
        if extra:
            _mount("", target, "", MS_REMOUNT | MS_BIND | extra, "")
    else:
        _mount(source, target, fstype, flags, data)
    if prop:
        _mount("", target, "", prop, "")


def unmount_all(target: str) -> None:
    """Unmount everything stacked on TARGET (lazily: a process may still hold it)."""
    for _ in range(64):
        if _libc.umount2(target.encode(), MNT_DETACH) != 0:
            err = ctypes.get_errno()
            if err in (errno.EINVAL, errno.ENOENT):
                return
            raise MountError(err, f"umount {target}: {os.strerror(err)}")
