"""A checkpoint's files written out as a directory (the reverse of tarfiles.directory_entries).

For checkpoints a runtime takes as a directory (containerd's, see
gpusnap.ops.containerd_registry): no tar is staged and unpacked again. Owners,
modes and times are kept as the file list gives them (CRIU images are
root-owned); every path must stay inside the directory, through no symlink,
whatever the file list says.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable

from gpusnap.errors import GpusnapError
from gpusnap.oci.bundle import FileEntry
from gpusnap.oci.tarfiles import sized


class DirectoryWriter:
    """Files into ROOT (made here, 0700); directories get their modes and times at commit()."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(mode=0o700)
        self._real = root.resolve()
        self._dirs: list[tuple[Path, FileEntry]] = []
        self._root_is_root = os.geteuid() == 0

    def _path(self, rel: str) -> Path:
        parts = rel.split("/")
        if not rel or rel.startswith("/") or any(p in ("", ".", "..") for p in parts):
            raise GpusnapError(f"the file list names {rel!r}, a path outside the checkpoint",
                               "the checkpoint in the registry is damaged or forged; nothing was restored")
        path = self.root.joinpath(*parts)
        if path.parent.resolve() != self._real.joinpath(*parts[:-1]):
            raise GpusnapError(f"the file list puts {rel!r} behind a symlink",
                               "the checkpoint in the registry is damaged or forged; nothing was restored")
        return path

    def _owner(self, path: Path, entry: FileEntry) -> None:
        if self._root_is_root:
            os.lchown(path, entry.uid, entry.gid)

    def add(self, entry: FileEntry, data: Iterable[bytes]) -> None:
        path = self._path(entry.path)
        try:
            if entry.type == "dir":
                path.mkdir(mode=0o700, exist_ok=True)
                self._owner(path, entry)
                self._dirs.append((path, entry))
            elif entry.type == "file":
                self._file(path, entry, data)
            elif entry.type == "symlink":
                os.symlink(entry.linkname, path)
                self._owner(path, entry)
            elif entry.type == "link":
                os.link(self._path(entry.linkname), path, follow_symlinks=False)
        except OSError as exc:
            raise GpusnapError(f"writing {path} failed: {exc.strerror}",
                               f"free space in {self.root.parent} (or fix what the error says); "
                               "nothing was restored") from None

    def _file(self, path: Path, entry: FileEntry, data: Iterable[bytes]) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as f:
            for piece in sized(entry, data):
                f.write(piece)
            if self._root_is_root:
                os.fchown(f.fileno(), entry.uid, entry.gid)
            os.fchmod(f.fileno(), entry.mode)
        os.utime(path, (entry.mtime, entry.mtime))

    def commit(self) -> None:
        """Modes and times of the directories, deepest first (writing into them changed their times)."""
        for path, entry in reversed(self._dirs):
            os.chmod(path, entry.mode)
            os.utime(path, (entry.mtime, entry.mtime))

    def abort(self) -> None:
        """Nothing to undo here: the caller removes the staging directory it gave."""
