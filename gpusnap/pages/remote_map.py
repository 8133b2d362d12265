"""A file mapped into another process's memory in place of pages it would be written.

A restored CUDA process gets back the driver's staging (its GPU memory, in host
memory) from the pages file, where the driver reads it once, at its restore,
and then unmaps it. Writing it there first (page_fill.py) is the one step of a
replica's restore that grows with its size; driver 580 restores as fast from
the pages file mapped private over those addresses, with nothing written
(bench/staging_map.py), but in a replica's restore it restored 1.0-1.6x
slower from a mapping of a fresh pages file than from written staging, and
3-4x from one linked from a prepared folder (docs/benchmarks.md): opt-in,
page-fill.json's map_staging. A private mapping never changes the file: a page the process
writes becomes its own copy; one it has not written still shows the file's
later changes (let_go copies what the driver's restore leaves mapped).

mmap(2) maps only into the caller, so the process makes the calls itself
(remote_syscall.py), and it needs the file open: the path means nothing in a
container's mount namespace, so the descriptor is passed, as CRIU's compel
passes its own to a parasite: a socket pair made in the process, one end
taken here (pidfd_getfd), the file sent over it (SCM_RIGHTS) and received in
the process. The call buffers lie in the first page of the last run, which
that run's mapping then replaces: nothing of the process's is written over.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import socket
import struct
import time
from collections.abc import Callable, Sequence

from gpusnap import journal
from gpusnap.errors import GpusnapError
from gpusnap.gpu import staging
from gpusnap.pages import fill_plan, page_fill, remote_syscall
from gpusnap.pages.page_fill import IoVec, PROT_READ, PROT_WRITE, libc

SYS_CLOSE, SYS_MMAP, SYS_MADVISE, SYS_RECVMSG, SYS_SOCKETPAIR = 3, 9, 28, 47, 53
MADV_POPULATE_WRITE = 23
SYS_PIDFD_GETFD = 438
AF_UNIX, SOCK_DGRAM, SOCK_CLOEXEC, MSG_CMSG_CLOEXEC = 1, 2, 0o2000000, 0x40000000
MAP_PRIVATE, MAP_FIXED = 0x02, 0x10
SOL_SOCKET, SCM_RIGHTS = 1, 1
PAGE = 4096
# where the call buffers lie in the scratch page
MSGHDR, IOVEC, BYTE, CONTROL = 0, 64, 128, 192
CONTROL_LEN = 24  # CMSG_SPACE(sizeof(int))
FileKey = tuple[int, int]  # a file's st_dev, st_ino
STOP_S = 2.0  # a process whose threads do not stop by then gets its staging written instead


class RemoteMapError(OSError):
    """The file could not be mapped; some runs may be (their bytes are the file's)."""


def _vm(pid: int, address: int, data: bytes | None, length: int = 0) -> bytes:
    """Write ``data`` at ``address`` of ``pid``, or read ``length`` bytes there."""
    c = libc()
    buf = ctypes.create_string_buffer(data if data is not None else length,
                                      len(data) if data is not None else length)
    local = IoVec(ctypes.cast(buf, ctypes.c_void_p), len(buf))
    remote = IoVec(address, len(buf))
    call = c.process_vm_writev if data is not None else c.process_vm_readv
    done = call(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
    if done != len(buf):
        err = ctypes.get_errno()
        raise RemoteMapError(err or errno.EFAULT, f"process {pid}'s memory at {address:#x}: "
                                                  f"{os.strerror(err) if err else 'short'}")
    return buf.raw


def _ok(ret: int, what: str) -> int:
    if ret < 0:
        raise RemoteMapError(-ret, f"{what}: {os.strerror(-ret)}")
    return ret


def _taken(pid: int, fd: int) -> int:
    """A copy here of the process's descriptor ``fd`` (pidfd_getfd(2))."""
    pidfd = os.pidfd_open(pid)
    try:
        c = ctypes.CDLL(None, use_errno=True)
        got = c.syscall(ctypes.c_long(SYS_PIDFD_GETFD), ctypes.c_int(pidfd), ctypes.c_int(fd),
                        ctypes.c_uint(0))
        return _ok(got if got >= 0 else -ctypes.get_errno(),
                   f"pidfd_getfd of process {pid}'s descriptor {fd}")
    finally:
        os.close(pidfd)


def _received(pid: int, call: Callable[..., int], scratch: int, end: int) -> int:
    """recvmsg(2) on the process's end ``end`` of the pair: the descriptor sent."""
    iov = struct.pack("QQ", scratch + BYTE, 1)
    msghdr = struct.pack("QIIQQQQi4x", 0, 0, 0, scratch + IOVEC, 1, scratch + CONTROL,
                         CONTROL_LEN, 0)
    _vm(pid, scratch, msghdr.ljust(IOVEC, b"\0") + iov.ljust(CONTROL - IOVEC, b"\0")
        + bytes(CONTROL_LEN))
    _ok(call(SYS_RECVMSG, end, scratch + MSGHDR, MSG_CMSG_CLOEXEC), f"recvmsg in process {pid}")
    length, level, kind, fd = struct.unpack("QiiI", _vm(pid, scratch + CONTROL, None, 20))
    if (level, kind) != (SOL_SOCKET, SCM_RIGHTS) or length < 20:
        raise RemoteMapError(errno.EPROTO, f"process {pid} received no descriptor")
    return fd


def map_file(pid: int, path: str, runs: Sequence[tuple[int, int, int]]) -> None:
    """Map ``path`` private over ``pid``'s memory: each run (address, length,
    offset in the file), page-aligned. RemoteMapError where it could not be
    done (runs mapped before it hold the file's bytes; the others hold what
    they did, but for the first page of the last run, the call buffers)."""
    if not runs:
        return
    scratch = runs[-1][0]
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        with remote_syscall.calls(pid, STOP_S) as call:
            _vm(pid, scratch, bytes(8))
            _ok(call(SYS_SOCKETPAIR, AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0, scratch),
                f"socketpair in process {pid}")
            ends = struct.unpack("ii", _vm(pid, scratch, None, 8))
            theirs = -1
            try:
                ours = _taken(pid, ends[0])
                with socket.socket(fileno=ours) as sock:
                    socket.send_fds(sock, [b"f"], [fd])
                theirs = _received(pid, call, scratch, ends[1])
                for address, length, offset in runs:
                    got = call(SYS_MMAP, address, length, PROT_READ | PROT_WRITE,
                               MAP_PRIVATE | MAP_FIXED, theirs, offset)
                    if got != address:
                        _ok(got if got < 0 else -errno.EFAULT,
                            f"mmap of {path} at {address:#x} in process {pid}")
            finally:  # each closed whatever another close met: an fd left open pins the file
                for end in (*ends, theirs):
                    if end >= 0:
                        with contextlib.suppress(remote_syscall.RemoteSyscallError):
                            call(SYS_CLOSE, end)
    except remote_syscall.RemoteSyscallError as exc:
        raise RemoteMapError(exc.errno or errno.EIO, str(exc)) from None
    finally:
        os.close(fd)


def put_back(held: dict[int, staging.Runs], init_pid: int, by: str) -> dict[int, set[FileKey]]:
    """The driver's staging post-restore left out of processes (staging.held:
    pid -> runs) put in place: mapped from its pages files, or written
    (page_fill) where the process refused the mapping or the file has other
    links (a prepared folder's: the driver restored 3-4x slower from a mapping
    of such a file than from written staging, docs/benchmarks.md); each
    process released once its staging is in place. Journaled
    as ``pages-mapped``; GpusnapError names the processes left held (the
    driver is not asked to restore them). Returns each process's files
    mapped (device, inode), for let_go."""
    started = time.monotonic()
    files: dict[int, set[FileKey]] = {}
    done: dict = {"bytes": 0, "mapped": [], "written": [], "why": None, "failed": {}}
    for pid, runs in held.items():
        try:
            if not runs:
                raise OSError(errno.ENOENT, "its staging record cannot be read")
            # each file once (a file gone: nothing to map or write)
            stats = {p: os.stat(p) for p in dict.fromkeys(p for _, _, p, _ in runs)}
            mapped = _mapped_or_written(pid, runs, stats, done)
            done["mapped" if mapped else "written"].append(pid)
            if mapped:
                files[pid] = {(st.st_dev, st.st_ino) for st in stats.values()}
        except (OSError, ValueError) as exc:
            done["failed"][pid] = str(exc)
            continue
        done["bytes"] += sum(n for _, n, _, _ in runs)
        staging.release(pid)
    journal.record("pages-mapped", init_pid=init_pid, by=by,
                   seconds=round(time.monotonic() - started, 3), **done)
    if done["failed"]:
        raise GpusnapError("the driver's copy of the GPU memory could not be put back into "
                           "restored process(es) " + "; ".join(
                               f"{pid}: {why}" for pid, why in done["failed"].items()),
                           "restore the checkpoint again")
    return files


def let_go(files: dict[int, set[FileKey]], init_pid: int, by: str) -> None:
    """After the driver's restore: whatever of put_back's files a process still
    maps (the driver unmaps its staging; memory the application allocated while
    the driver checkpointed is recorded as staging too) made the process's own,
    every page copied (MADV_POPULATE_WRITE on a private mapping), so that no
    later change of the file (a kept folder, patched once unlinked) shows
    through; the range stays a mapping of the file (a later dump of the
    process meets a host file). Journaled as ``staging-left-mapped`` where
    any was, with the error of a process that refused."""
    for pid, keys in files.items():
        try:
            left = _left_mapped(pid, keys)
        except OSError:
            continue  # the process is gone: nothing maps the file
        if not left:
            continue
        error = None
        try:
            with remote_syscall.calls(pid, STOP_S) as call:
                for address, length in left:
                    ret = call(SYS_MADVISE, address, length, MADV_POPULATE_WRITE)
                    if ret < 0 and error is None:
                        error = f"madvise at {address:#x}: {os.strerror(-ret)}"
        except OSError as exc:  # it would not stop within STOP_S, or went away
            error = str(exc)
        journal.record("staging-left-mapped", init_pid=init_pid, pid=pid, by=by,
                       bytes=sum(n for _, n in left), copied=error is None, error=error)


def _key(path: str) -> FileKey:
    st = os.stat(path)
    return st.st_dev, st.st_ino


def _left_mapped(pid: int, keys: set[FileKey]) -> list[tuple[int, int]]:
    """``pid``'s ranges (address, length) still mapped from one of the files:
    told by stat of /proc/PID/map_files (maps' device number is the
    filesystem's, which btrfs's stat does not report)."""
    inodes = {ino for _, ino in keys}
    out = []
    with open(f"/proc/{pid}/maps") as maps:
        for line in maps:
            span, _, _, _, inode, *_ = line.split() + [""]
            if int(inode or 0) not in inodes:
                continue
            with contextlib.suppress(OSError):  # unmapped meanwhile
                if _key(f"/proc/{pid}/map_files/{span}") in keys:
                    start, end = (int(x, 16) for x in span.split("-"))
                    out.append((start, end - start))
    return out


def _mapped_or_written(pid: int, runs: staging.Runs, stats: dict[str, os.stat_result],
                       done: dict) -> bool:
    """True where every file was mapped, False where the runs were written."""
    try:
        for path, st in stats.items():
            if st.st_nlink != 1:
                raise RemoteMapError(errno.EMLINK, f"{path} has other links")
            map_file(pid, path, [(a, n, o) for a, n, p, o in runs if p == path])
        return True
    except OSError as exc:  # RemoteMapError and the file's own: the bytes are written instead
        done["why"] = done["why"] or str(exc)
    page_fill.fill(pid, [page_fill.Run(*r) for r in runs],
                   fill_plan.settings().threads or page_fill.default_threads())
    return False
