"""What a push reads: one source object per kind of SOURCE.

`gpusnap push SOURCE REF` takes an exported archive, a checkpoint directory,
a Podman container (checkpointed first: podman_source.py) or a containerd
container or checkpoint image (containerd_registry.py); ``open_source`` gives
each as a PushSource, the one thing the generic push (push.py) reads. The
engines' modules build on push_source.py, never on this module or push.py, so
data flows one way: engine -> PushSource -> push.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from gpusnap.errors import GpusnapError
from gpusnap.ops.container_busy import refuse_if_busy
from gpusnap.ops.push_source import PushSource, dir_size, push_again_words
from gpusnap.runtime import podman


def find_container(source: str, paths: bool = True) -> podman.Container | None:
    """The Podman container SOURCE names (None: a file, a directory or containerd's;
    without ``paths``, a container whatever files lie here: migrate's);
    one that names nothing is refused here, before any registry is asked, and so
    is one another gpusnap command is checkpointing (container_busy.py)."""
    if source.startswith("containerd://") or (paths and (Path(source).is_dir()
                                                         or Path(source).is_file())):
        return None
    refuse_if_busy(source)  # before Podman is asked: it would wait on the other's dump
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
                on_checkpointed: Callable[[dict], None] | None = None,
                pre_checkpoint: bool = False,
                push_again: Callable[[str], str] = push_again_words) -> Iterator[PushSource]:
    """SOURCE as a file stream. A container is checkpointed into a staged plain
    tar; with ``stream`` the push reads that tar while Podman still writes it
    (upload overlaps the dump), else once it is complete. ``on_checkpointed``:
    called once a container's checkpoint succeeded (see push()).
    ``pre_checkpoint``: a pre-copy's round 1 (podman_source.checkpointed); a
    Podman container left running otherwise has its checkpoint checked for
    open files that changed before the export (ops/snapshot_files.py).
    ``push_again``: this push's retry for a path, as doctor prints it.
    ``container``: SOURCE's, found already; a file or folder of its name is
    not read then."""
    if source.startswith("containerd://"):  # a containerd container or checkpoint image
        from gpusnap.ops import containerd_registry  # grpc and containerd's protos: only here

        with containerd_registry.push_source(source, leave_running, on_checkpoint,
                                             containerd_address, push_again) as src:
            yield src
        return
    path = Path(source)
    if path.is_dir() and container is None:
        size = dir_size(path)
        yield PushSource("directory", path, size, size)
        return
    if path.is_file() and container is None:
        yield PushSource("archive", path, path.stat().st_size * 4)  # zstd -1 packs memory a few times over
        return
    from gpusnap.ops import podman_source  # CRIU/GPU code, only when needed

    with podman_source.checkpointed(source, leave_running, on_checkpoint, stream,
                                    container or find_container(source),
                                    on_checkpointed, pre_checkpoint, push_again) as src:
        yield src
