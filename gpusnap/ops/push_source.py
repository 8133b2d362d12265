"""What every push source gives the push: a PushSource, and the words of a
push that failed after its checkpoint. The engines' modules (podman_source,
containerd_registry) build on this, and sources.py picks among them, so data
flows one way: engine -> PushSource -> push.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable

from gpusnap.errors import GpusnapError
from gpusnap.private import write_private

# In a push's folder whose checkpoint stops the container: once the dump is
# done, what the folder holds is all that is left of it (ops/leftovers.kept).
ONLY_COPY = "gpusnap-only-copy.json"


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
    # the memory it read ahead of CRIU (pages/dump_ahead.py) with a note once read.
    pages_aside: Path | None = None
    # A leave-running GPU checkpoint: waits for its guardian's verdict on the GPUs
    # (ops/gpu_back.py) once the push is done, as the result's gpu_back fields.
    gpu_back: Callable[[], dict] | None = None


def dir_size(root: Path) -> int:
    """Bytes of the regular files under ``root``: a directory source's size."""
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and not p.is_symlink())


def cause(exc: BaseException) -> str:
    """What stopped a push, in the words of its error (Ctrl-C: "interrupted";
    an error not of gpusnap's, its type too: a bug's is worth reporting)."""
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted"
    return getattr(exc, "message", None) or f"{type(exc).__name__}: {exc}"


def mark_only_copy(work: Path, container: str, kept: Path, again: str | None, back: str,
                   holds: tuple[Path, ...] = ()) -> None:
    """Written before the dump that stops ``container``: `gpusnap doctor --fix`
    never removes a folder so marked, nor the folders it ``holds`` (the
    journal, which also says it, keeps only its last lines), and doctor prints
    the ways on (``again``: the push again, where the folder can be pushed)."""
    write_private(work / ONLY_COPY, json.dumps({"container": container, "export": str(kept),
                                                "again": again, "back": back,
                                                "holds": [str(h) for h in holds]}))


def push_again_words(path: str) -> str:
    """The retry where the push's reference and flags are not known."""
    return f"gpusnap push {path} REF"


class KeptError(GpusnapError):
    """A push that failed after its checkpoint stopped the container: where the
    checkpoint is kept, and the two ways on. push() fills the retry command in
    with the reference and flags it was given (``with_push``)."""

    def __init__(self, message: str, first: str | None, push_from: str, back: str,
                 exit_code: int) -> None:
        self.first, self.push_from, self.back = first, push_from, back
        super().__init__(message, self._hint(push_again_words(push_from)), exit_code)

    def _hint(self, again: str) -> str:
        return (f"{self.first}; then " if self.first else "") + \
            f"`{again}` tries again (chunks already sent are skipped); {self.back} brings it " \
            "back here"

    def with_push(self, command: str) -> "KeptError":
        self.hint = self._hint(command)
        return self


def kept_error(exc: BaseException, container: str, kept: str, push_from: str,
               back: str) -> KeptError:
    """A push that failed after its checkpoint stopped ``container``: what
    failed, where the checkpoint is kept (``push_from``: what to push again),
    and the two ways on (engine's words)."""
    first = getattr(exc, "hint", None)  # the cause's own fix (the registry's side), then ours
    return KeptError(f"{cause(exc)}; {container} is checkpointed and stopped, its checkpoint is "
                     f"kept {kept}", first, push_from, back,
                     exit_code=130 if isinstance(exc, KeyboardInterrupt) else 1)
