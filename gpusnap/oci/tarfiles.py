"""Checkpoint files as a stream of (entry, data): read from a Podman export archive
or a checkpoint directory, and written back as an archive Podman imports.

Both directions stream: one member's data at a time, never a whole file.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import tarfile
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, Iterable, Iterator

from gpusnap import MANIFEST_NAME
from gpusnap.errors import GpusnapError
from gpusnap.oci.bundle import FileEntry
from gpusnap.partial import DISK_FULL, disk_full, partial_path
from gpusnap.private import open_private
from gpusnap.tarstream import DamagedStream, TarStream

if TYPE_CHECKING:  # the sink is handed in: runtime/ sits above oci/
    from gpusnap.runtime.stream import PipeSink

_TYPES = {tarfile.REGTYPE: "file", tarfile.AREGTYPE: "file", tarfile.DIRTYPE: "dir",
          tarfile.SYMTYPE: "symlink", tarfile.LNKTYPE: "link"}
_TAR_TYPES = {"file": tarfile.REGTYPE, "dir": tarfile.DIRTYPE, "symlink": tarfile.SYMTYPE,
              "link": tarfile.LNKTYPE}
# PAX records tarfile writes itself from TarInfo fields.
_PAX_OWN = {"path", "linkpath", "size", "mtime", "uid", "gid", "uname", "gname", "atime", "ctime"}
# What `podman container checkpoint --export` puts in an archive (and our GPU manifest):
# a Podman userdata directory holds sockets, logs and the shm mount besides.
EXPORT_NAMES = {"checkpoint", "artifacts", "ctr.log", "config.dump", "spec.dump",
                "network.status", "stats-dump", "bind.mounts", "devshm-checkpoint.tar",
                "rootfs-diff.tar", "deleted.files", "volumes", "pod.options", MANIFEST_NAME}


def _norm(name: str) -> str:
    name = name[2:] if name.startswith("./") else name
    return name.rstrip("/")


def entry_from_tarinfo(info: tarfile.TarInfo) -> FileEntry | None:
    kind = _TYPES.get(info.type)
    if kind is None:
        return None  # devices, FIFOs: Podman's exports have none
    pax = {k: v for k, v in info.pax_headers.items() if k not in _PAX_OWN}
    return FileEntry(path=_norm(info.name), type=kind, mode=info.mode, uid=info.uid,
                     gid=info.gid, uname=info.uname, gname=info.gname, mtime=int(info.mtime),
                     size=info.size if kind == "file" else 0,
                     linkname=info.linkname, pax=pax)


@contextmanager
def archive_entries(path: Path, source: BinaryIO | None = None
                    ) -> Iterator[Iterator[tuple[FileEntry, BinaryIO | None]]]:
    """Yield an iterator of (entry, data stream or None) over an archive, in order.

    Each data stream must be read before the next entry is taken. ``source``:
    the plain tar's bytes, when they do not come from ``path`` itself.
    """
    try:
        stream = TarStream(path, source)
    except OSError as exc:
        raise GpusnapError(f"cannot read {path}: {exc.strerror}") from None
    except DamagedStream as exc:
        raise GpusnapError(f"{path} is not a valid zstd archive ({exc})",
                           "the file is damaged or truncated") from None
    except tarfile.TarError as exc:
        raise GpusnapError(f"{path} is not a readable checkpoint archive ({exc})",
                           "pass a file made by `podman container checkpoint --export`") from None

    def members() -> Iterator[tuple[FileEntry, BinaryIO | None]]:
        for info in stream.tar:
            entry = entry_from_tarinfo(info)
            if entry is None or not entry.path:
                continue
            yield entry, stream.data(info) if entry.type == "file" else None

    ok = False
    try:
        yield members()
        ok = True
    except (tarfile.TarError, EOFError) as exc:
        raise GpusnapError(f"{path} is not a readable checkpoint archive ({exc})",
                           "pass a file made by `podman container checkpoint --export`") from None
    finally:
        complaint = stream.close(read_to_end=ok)
    if complaint:
        raise GpusnapError(f"{path} is not a valid zstd archive ({complaint})",
                           "the file is damaged or truncated")


def _is_podman_userdata(root: Path) -> bool:
    return (root / "checkpoint").is_dir() and (root / "config.dump").is_file()


def directory_entries(root: Path) -> Iterator[tuple[FileEntry, BinaryIO | None]]:
    """Files of a checkpoint directory, sorted; for a Podman userdata directory
    only what an export would hold."""
    podman = _is_podman_userdata(root)
    first = [MANIFEST_NAME] if (root / MANIFEST_NAME).is_file() else []

    def walk(rel: str) -> Iterator[str]:
        for name in sorted(os.listdir(root / rel) if rel else os.listdir(root)):
            sub = f"{rel}/{name}" if rel else name
            if not rel and (name in first or (podman and name not in EXPORT_NAMES)):
                continue
            yield sub
            if (root / sub).is_dir() and not (root / sub).is_symlink():
                yield from walk(sub)

    for rel in first + list(walk("")):
        full = root / rel
        st = full.lstat()
        common = dict(path=rel, mode=stat.S_IMODE(st.st_mode), uid=st.st_uid, gid=st.st_gid,
                      mtime=int(st.st_mtime))
        if stat.S_ISREG(st.st_mode):
            with open(full, "rb") as f:
                yield FileEntry(type="file", size=st.st_size, **common), f
        elif stat.S_ISDIR(st.st_mode):
            yield FileEntry(type="dir", **common), None
        elif stat.S_ISLNK(st.st_mode):
            yield FileEntry(type="symlink", linkname=os.readlink(full), **common), None


def tarinfo(entry: FileEntry) -> tarfile.TarInfo:
    info = tarfile.TarInfo(entry.path + ("/" if entry.type == "dir" else ""))
    info.type = _TAR_TYPES[entry.type]
    info.mode, info.uid, info.gid = entry.mode, entry.uid, entry.gid
    info.uname, info.gname, info.mtime = entry.uname, entry.gname, entry.mtime
    info.size = entry.size if entry.type == "file" else 0
    info.linkname = entry.linkname
    info.pax_headers = dict(entry.pax)
    return info


def sized(entry: FileEntry, data: Iterable[bytes]) -> Iterator[bytes]:
    """The pieces of a pulled file, checked to add up to the size its entry says."""
    n = 0
    for piece in data:
        n += len(piece)
        if n > entry.size:
            break
        yield piece
    if n != entry.size:
        raise GpusnapError(f"{entry.path}: its chunks hold {n} bytes, the file list says "
                           f"{entry.size}", "the checkpoint in the registry is damaged")


class ReaderStopped(GpusnapError):
    """The archive's reader (Podman's import) stopped: the download stops too."""


class _TarWriter:
    """A tar stream of FileEntries and their chunks; subclasses say where it goes.
    ``pages``: where the caller writes CRIU's memory pages beside the tar, which
    then holds a symlink to each (ops/pull.write_files, pages/pages_aside.py)."""

    written = 0
    pages: Path | None = None

    def _put(self, data: bytes) -> None:
        raise NotImplementedError

    def _write(self, data: bytes) -> None:
        self._put(data)
        self.written += len(data)

    def add(self, entry: FileEntry, data: Iterable[bytes]) -> None:
        self._write(tarinfo(entry).tobuf(format=tarfile.PAX_FORMAT))
        if entry.type != "file":
            return
        for piece in sized(entry, data):
            self._write(piece)
        self._write(b"\0" * (-entry.size % tarfile.BLOCKSIZE))

    def _write_end(self) -> None:
        end = b"\0" * (2 * tarfile.BLOCKSIZE)
        self._write(end + b"\0" * (-(self.written + len(end)) % tarfile.RECORDSIZE))


class PipeWriter(_TarWriter):
    """The tar into a streamed import's pipe (stream.import_piped)."""

    def __init__(self, sink: PipeSink, pages: Path | None = None) -> None:
        self.sink, self.pages = sink, pages

    def _put(self, data: bytes) -> None:
        try:
            self.sink.write(data)
        except (OSError, ValueError):  # the pump closed the pipe (Podman stopped), or we did
            raise ReaderStopped("the download was stopped: the restore failed") from None

    def commit(self) -> None:
        self.sink.done()
        try:
            self._write_end()
        except ReaderStopped:
            pass  # Podman stops reading at the end marker: it had every member
        self.sink.close()

    def abort(self) -> None:
        self.sink.close()


class ArchiveWriter(_TarWriter):
    """A tar stream into ``path`` (zstd -T0 when it ends in .zst), written to
    a hidden partial file that becomes ``path`` only on commit()."""

    def __init__(self, path: Path, level: int = 1) -> None:
        self.path = path
        self.partial = partial_path(path)
        self.proc: subprocess.Popen | None = None
        if path.suffix == ".zst" and shutil.which("zstd") is None:
            raise GpusnapError("zstd is not installed; it compresses checkpoint archives",
                               "install zstd, or pull to a .tar file")
        # 0600 from the start: a checkpoint is process memory. zstd writes to its
        # stdout, this file (`-o` would make its own, 0644).
        sink = open_private(self.partial, "wb")
        if path.suffix == ".zst":
            try:
                self.proc = subprocess.Popen(["zstd", "-q", "-T0", f"-{level}", "-c"],
                                             stdin=subprocess.PIPE, stdout=sink,
                                             stderr=subprocess.PIPE)
            except BaseException:
                self.partial.unlink(missing_ok=True)
                raise
            finally:
                sink.close()  # zstd holds its own copy
            self.out = self.proc.stdin
        else:
            self.out = sink

    def _put(self, data: bytes) -> None:
        try:
            self.out.write(data)
        except OSError as exc:
            raise self._failed(self._zstd_error() or exc.strerror or str(exc)) from None

    def _failed(self, why: str) -> GpusnapError:
        if DISK_FULL in why:  # zstd: "error 70 : Write error : ... No space ..."
            why = disk_full(self.path.absolute())
        return GpusnapError(f"writing {self.path} failed: {why}",
                            "free space there or pull elsewhere (-o FILE)")

    def _zstd_error(self) -> str:
        """zstd's own words, once it has exited: a broken pipe on our side means
        it is exiting (its stdin closed), and why (a full disk) is in its stderr."""
        if self.proc is None:
            return ""
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            return ""
        return self.proc.stderr.read().decode(errors="replace").strip().removeprefix("zstd: ")

    def commit(self) -> None:
        self._write_end()
        try:
            self.out.close()
        except OSError as exc:
            raise self._failed(self._zstd_error() or exc.strerror or str(exc)) from None
        if self.proc is not None and self.proc.wait() != 0:
            raise self._failed(self._zstd_error() or "zstd failed")
        os.replace(self.partial, self.path)

    def abort(self) -> None:
        try:
            self.out.close()
        except OSError:
            pass
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
        self.partial.unlink(missing_ok=True)
