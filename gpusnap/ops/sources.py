"""What a push reads: one source object per kind of SOURCE.

`gpusnap push SOURCE REF` takes an exported archive, a checkpoint directory,
a Podman container (checkpointed first: podman_source.py) or a containerd
container or checkpoint image (containerd_registry.py); ``open_source`` gives
each as a PushSource, the one thing the generic push (push.py) reads. The
engines' modules import from here, never from push.py, so data flows one way:
engine -> PushSource -> push.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable, Iterator

from gpusnap.errors import GpusnapError
from gpusnap.runtime import podman


@dataclass
class PushSource:
    kind: str  # archive, directory, container, containerd-container, containerd-image
    path: Path
    estimated_bytes: int  # decides the chunk scale
    known_bytes: int | None = None  # for a progress bar, where it is known
    container: str | None = None  # checkpointed by this push
    # A container's export as it is written (the checkpoint runs beside the push).
    follow: Callable[[], BinaryIO] | None = None
    # Waits for that checkpoint and raises its error: called before the manifest
    # is put, so a checkpoint that failed late is never published.
    finish: Callable[[], None] = lambda: None
    # Podman's bundle dir of that container, while Podman writes into it: files
    # it copies into the export are chunked there first (prefetch.py).
    userdata: Path | None = None
    writer_done: Callable[[], bool] = lambda: True
    # The push's folder in RAM that CRIU's pages go to, where pre-dump leaves
    # the memory it read ahead of CRIU (criu/dump_ahead.py) with a note once read.
    pages_aside: Path | None = None


def dir_size(root: Path) -> int:
    """Bytes of the regular files under ``root``: a directory source's size."""
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and not p.is_symlink())


def find_container(source: str) -> podman.Container | None:
    """The Podman container SOURCE names (None: a file, a directory or containerd's);
    one that names nothing is refused here, before any registry is asked."""
    if source.startswith("containerd://") or Path(source).is_dir() or Path(source).is_file():
        return None
    container = podman.find(source)
    if container is None:
        raise GpusnapError(f"{source}: no such file, directory or container",
                           "pass an exported archive, a checkpoint directory or a running "
                           "container's name (`podman ps`)")
    return container


@contextmanager
def open_source(source: str, leave_running: bool,
                on_checkpoint: Callable[[str], None] | None = None,
                stream: bool = True, containerd_address: str | None = None,
                container: podman.Container | None = None,
                on_checkpointed: Callable[[dict], None] | None = None
                ) -> Iterator[PushSource]:
    """SOURCE as a file stream. A container is checkpointed into a staged plain
    tar; with ``stream`` the push reads that tar while Podman still writes it
    (upload overlaps the dump), else once it is complete. ``on_checkpointed``:
    called once a container's checkpoint succeeded (see push())."""
    if source.startswith("containerd://"):  # a containerd container or checkpoint image
        from gpusnap.ops import containerd_registry

        with containerd_registry.push_source(source, leave_running, on_checkpoint,
                                             containerd_address) as src:
            yield src
        return
    path = Path(source)
    if path.is_dir():
        size = dir_size(path)
        yield PushSource("directory", path, size, size)
        return
    if path.is_file():
        yield PushSource("archive", path, path.stat().st_size * 4)  # zstd -1 of memory: ~2-4x
        return
    from gpusnap.ops import podman_source  # CRIU/GPU code, only when needed

    with podman_source.checkpointed(source, leave_running, on_checkpoint, stream,
                                    container or find_container(source),
                                    on_checkpointed) as src:
        yield src


def cause(exc: BaseException) -> str:
    """What stopped a push, in the words of its error (Ctrl-C: "interrupted")."""
    return "interrupted" if isinstance(exc, KeyboardInterrupt) else getattr(exc, "message",
                                                                            str(exc))


def kept_error(exc: BaseException, container: str, kept: str, again: str,
               back: str) -> GpusnapError:
    """A push that failed after its checkpoint stopped ``container``: what
    failed, where the checkpoint is kept, and the two ways on (engine's words)."""
    return GpusnapError(f"{cause(exc)}; {container} is checkpointed and stopped, its checkpoint is "
                        f"kept {kept}",
                        f"{again} tries again (chunks already sent are skipped); {back} brings "
                        "it back here",
                        exit_code=130 if isinstance(exc, KeyboardInterrupt) else 1)


