"""Chunk a file Podman writes before its export while Podman writes it.

Podman 4 tars the container's /dev/shm into ``userdata/devshm-checkpoint.tar``
after CRIU's dump, and only then writes the export, which copies that file in
verbatim. A push that followed the export alone would sit idle through the
first write and then read every byte again from the export. Here the file is chunked
and uploaded as it grows. When the export's header for it arrives the file is
complete (Podman closed it before starting the export); if it is still the file
being read (same inode, the header's size and mtime), the early chunks stand
for the member, the export's copy is skipped while the reading goes on, and
``finish()`` checks that exactly the header's size was read. Otherwise the
member is read from the export after all: the early chunks are only wasted
uploads, never wrong data.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from gpusnap.errors import GpusnapError
from gpusnap.oci import chunker
from gpusnap.oci.bundle import FileEntry
from gpusnap.runtime.follow import GrowingFile

DEVSHM = "devshm-checkpoint.tar"  # Podman's name (libpod metadata.DevShmCheckpointTar)

Submit = Callable[[bytes], Future]


@dataclass
class _Job:
    name: str  # the member's path in the export
    path: Path  # where Podman writes it first
    estimate: Callable[[], int]  # the file's size before it is complete: picks the chunk sizes
    futures: list[Future] = field(default_factory=list)
    read: int = 0
    stat: os.stat_result | None = None  # the file as it was read
    error: BaseException | None = None
    opened: threading.Event = field(default_factory=threading.Event)  # stat is set, or never will be
    given: threading.Event = field(default_factory=threading.Event)  # size (or stop) is known
    stop: bool = False  # not wanted any more (another file, a failed push): read no further
    thread: threading.Thread | None = None


def shm_estimate(userdata: Path) -> Callable[[], int]:
    """The size of the tar Podman makes of the container's /dev/shm (userdata/shm),
    read when the tar appears (the dump is over by then): file bytes plus headers.
    Only its power of two matters (chunk sizes), so that a later push of the kept
    archive, which knows the real size, cuts the same chunks."""
    def size() -> int:
        total = 1024  # the two zero blocks that end a tar
        for root, _dirs, files in os.walk(userdata / "shm"):
            total += 512  # the directory's header
            for f in files:
                try:
                    n = os.lstat(os.path.join(root, f)).st_size
                except OSError:
                    continue
                total += 512 + (n + 511) // 512 * 512
        return total
    return size


class Prefetch:
    """One thread per early file; ``take(entry)`` is asked for each export member."""

    def __init__(self, jobs: list[_Job], submit: Submit,
                 params: Callable[[int], chunker.ChunkParams], writer_done: Callable[[], bool]) -> None:
        self._jobs = {j.name: j for j in jobs}
        self._submit, self._params, self._writer_done = submit, params, writer_done
        self._taken: list[tuple[_Job, FileEntry]] = []

    @classmethod
    def for_podman(cls, userdata: Path | None, submit: Submit,
                   params: Callable[[int], chunker.ChunkParams],
                   writer_done: Callable[[], bool]) -> "Prefetch":
        jobs = [] if userdata is None else \
            [_Job(DEVSHM, userdata / DEVSHM, shm_estimate(userdata))]
        return cls(jobs, submit, params, writer_done)

    def __enter__(self) -> "Prefetch":
        for job in self._jobs.values():
            job.thread = threading.Thread(target=self._run, args=(job,), daemon=True,
                                          name=f"gpusnap-prefetch-{job.name}")
            job.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        # Members the export never had; on a failed push, the taken ones too.
        left = list(self._jobs.values()) + ([j for j, _ in self._taken] if exc[0] else [])
        for job in left:
            job.stop = True
            job.given.set()
        for job in left:
            if job.thread:
                job.thread.join()

    def _run(self, job: _Job) -> None:
        # Ends when the export's header gave the size (the file is complete then:
        # Podman writes it before the export) or when Podman is done without it.
        raw = GrowingFile([job.path], lambda: job.given.is_set() or self._writer_done())
        try:
            if not raw.read(1):  # waits for Podman's first byte
                return
            os.lseek(raw.fileno(), 0, os.SEEK_SET)  # and reads it again with the rest
            job.stat = os.fstat(raw.fileno())
            job.opened.set()
            params = self._params(max(job.estimate(), job.stat.st_size))
            for piece in chunker.split(raw, params, None):
                if job.stop:
                    return
                job.futures.append(self._submit(piece))
                job.read += len(piece)
        except BaseException as exc:  # reported by take() or finish()
            job.error = exc
        finally:
            job.opened.set()
            raw.close()

    def take(self, entry: FileEntry) -> list[Future] | None:
        """The chunks standing for ``entry``'s data (still being added to until
        ``finish()``), or None: read it from the export."""
        job = self._jobs.pop(entry.path, None)
        if job is None:
            return None
        job.given.set()  # the file is complete: read it to its end
        job.opened.wait()
        if job.error is not None and not isinstance(job.error, Exception):
            raise job.error  # KeyboardInterrupt and the like are not a fallback
        if entry.type != "file" or job.error is not None or not _final(job, entry):
            job.stop = True
            job.thread.join()
            return None
        self._taken.append((job, entry))
        return job.futures

    @property
    def taken_bytes(self) -> int:
        """Bytes of the members that came from the early read."""
        return sum(entry.size for _, entry in self._taken)

    def finish(self) -> None:
        """Wait for the taken files' chunks; each must be the header's size."""
        for job, entry in self._taken:
            job.thread.join()
            if job.error is not None:
                raise job.error
            if job.read != entry.size:
                raise GpusnapError(f"{job.path} changed while it was read ({job.read} bytes, "
                                   f"the export says {entry.size})",
                                   "push again: the checkpoint is complete on disk")


def _final(job: _Job, entry: FileEntry) -> bool:
    """Is the file at job.path, now, the one being read, with the header's size and mtime?"""
    try:
        now = os.stat(job.path)
    except OSError:
        return False
    st = job.stat
    return (st is not None and (st.st_dev, st.st_ino) == (now.st_dev, now.st_ino)
            and now.st_size == entry.size and int(now.st_mtime) == entry.mtime)
