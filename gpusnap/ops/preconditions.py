"""Checks shared by the verbs that need a running container."""

from __future__ import annotations

from gpusnap.criu import dumped
from gpusnap.errors import GpusnapError
from gpusnap.runtime import podman


def has_checkpoint(ctr: podman.Container) -> bool:
    """A complete local dump: CRIU writes inventory.img last."""
    return dumped.whole(ctr.checkpoint_dir)


def require_running(ctr: podman.Container, verb: str) -> None:
    """Refuse a stopped container; point at its checkpoint when it has one, since
    `podman start` would start it afresh and the dumped state would be lost."""
    if ctr.running:
        return
    if has_checkpoint(ctr):
        hint = (f"it holds a checkpoint: `gpusnap restore {ctr.name}` brings it back as it was "
                "(`podman start` would start it afresh)")
    else:
        hint = f"only a running container can {verb}; `podman start` it first"
    raise GpusnapError(f"container {ctr.name} is {ctr.status}, not running", hint)
