"""Which engine a checkpoint is for, and the refusal of the other one.

A bundle's summary says `engine: containerd` for a containerd checkpoint
(gpusnap.archive); Podman's have none. Both restore paths ask here before
anything is downloaded, so neither imports the other's module.
"""

from __future__ import annotations

from gpusnap.errors import GpusnapError

ENGINE = "containerd"  # the summary's engine of a containerd checkpoint


def refuse_engine(summary: dict, where: str, want: str, to: str | None = None) -> None:
    """One line when a checkpoint of one engine is restored onto the other (before any download)."""
    engine = summary.get("engine") or "podman"
    if engine == want:
        return
    if engine == ENGINE:
        c = summary.get(ENGINE) or {}
        raise GpusnapError(f"{where} is a containerd checkpoint (runtime {c.get('runtime')}); "
                           "Podman cannot restore it",
                           f"restore it into containerd: `gpusnap restore {where} --to "
                           f"containerd://{c.get('namespace') or 'NAMESPACE'}/"
                           f"{(summary.get('container') or {}).get('name') or 'ID'}`; "
                           "nothing was downloaded or changed")
    raise GpusnapError(f"{where} is a Podman checkpoint; containerd cannot restore it",
                       f"restore it with Podman: `gpusnap restore {where}` without --to {to}; "
                       "nothing was downloaded or created")
