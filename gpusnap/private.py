"""Files and folders of checkpoint data and state that only root may read.

A checkpoint is a process's memory (weights, tokens, keys); state files name
containers, pids and GPU plans; the shim's socket drives containers. So every
folder gpusnap makes for them is 0700 and every file 0600, created so (the
mode is given to open/mkdir, never narrowed by a chmod afterwards, which would
leave a moment when others can open it). A folder or file an older version
left wider is narrowed when it is used again.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator
from io import IOBase
from pathlib import Path

DIR_MODE = 0o700
FILE_MODE = 0o600
_OPEN_FLAGS = {"w": os.O_TRUNC, "a": os.O_APPEND, "x": os.O_EXCL}


def _narrow(fd_or_path: int | str | os.PathLike, st: os.stat_result, mode: int) -> None:
    """Take group and other bits away from what an older version made."""
    if stat.S_IMODE(st.st_mode) & 0o077:
        if isinstance(fd_or_path, int):
            os.fchmod(fd_or_path, stat.S_IMODE(st.st_mode) & mode)
        else:
            os.chmod(fd_or_path, stat.S_IMODE(st.st_mode) & mode)


def private_dir(path: str | os.PathLike) -> Path:
    """PATH as a 0700 folder: made so (missing parents too), or narrowed if it exists."""
    path = Path(path)
    missing = []
    p = path
    while not p.exists() and p != p.parent:
        missing.append(p)
        p = p.parent
    for p in reversed(missing):
        try:
            os.mkdir(p, DIR_MODE)
        except FileExistsError:
            pass  # made meanwhile by another process
    st = os.stat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise NotADirectoryError(f"{path} is not a directory")
    _narrow(path, st, DIR_MODE)
    return path


def open_private(path: str | os.PathLike, mode: str = "wb") -> IOBase:
    """open(PATH, MODE) for writing ("w", "a" or "x", text or "b"), the file 0600
    from the moment it exists; an existing wider file is narrowed first."""
    kind = mode.replace("b", "").replace("t", "")
    if kind not in _OPEN_FLAGS:
        raise ValueError(f"open_private: mode {mode!r} does not write")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | _OPEN_FLAGS[kind], FILE_MODE)
    try:
        _narrow(fd, os.fstat(fd), FILE_MODE)
        return os.fdopen(fd, mode.replace("x", "w"))
    except BaseException:
        os.close(fd)
        raise


def write_private(path: str | os.PathLike, data: str | bytes) -> Path:
    """Write DATA to PATH, 0600, atomically (a reader sees the old file or the whole new one)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open_private(tmp, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def restrict(path: str | os.PathLike) -> None:
    """Narrow what another program (runc, CRIU) made: only for those, whose
    mode gpusnap cannot choose; its own files are made private from the start."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        return
    _narrow(path, st, DIR_MODE if stat.S_ISDIR(st.st_mode) else FILE_MODE)


def restrict_tree(root: str | os.PathLike) -> None:
    """restrict() ROOT and everything under it (symlinks are left alone)."""
    restrict(root)
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            restrict(os.path.join(dirpath, name))


@contextlib.contextmanager
def private_umask() -> Iterator[None]:
    """umask 177 for a call that creates something and takes no mode: a socket
    bound meanwhile is 0600 (connecting needs write access, so only root can).
    Process-wide: another thread creating a file meanwhile gets it narrower,
    never wider (a folder too: root still enters it)."""
    old = os.umask(0o177)
    try:
        yield
    finally:
        os.umask(old)
