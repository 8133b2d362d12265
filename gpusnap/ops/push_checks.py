"""What a push refuses before it checkpoints or reads anything: the
reference as a target, the keys (a wrong key or passphrase), the registry's
credentials. ``preflight`` asks them alone, for --detach's foreground."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gpusnap.errors import GpusnapError
from gpusnap.oci import reference
from gpusnap.oci.registry import RegistryClient, RegistryOptions
from gpusnap.trust.options import TrustOptions

if TYPE_CHECKING:  # cryptography: imported when a push loads its keys
    from gpusnap.trust.remote import PushTrust

FORMATS = ("gpusnap", "podman")


def _target(source: str, ref_text: str, image_format: str) -> reference.Reference:
    """REF as a push target, refused before anything is read or checkpointed."""
    ref = reference.parse(ref_text)
    if ref.digest:
        raise GpusnapError(f"{ref_text}: push to a tag, not a digest",
                           "the digest is known only once the checkpoint is pushed")
    if image_format not in FORMATS:
        raise GpusnapError(f"unknown format {image_format!r}", f"pass one of {', '.join(FORMATS)}")
    if image_format == "podman" and source.startswith("containerd://"):
        raise GpusnapError("--format podman makes images Podman restores, not containerd",
                           "push containerd checkpoints in gpusnap's format (the default)")
    return ref


def target_and_keys(source: str, ref_text: str, trust: TrustOptions | None,
                    image_format: str) -> tuple[reference.Reference, PushTrust]:
    """REF as a target and the push's keys: a wrong key or passphrase fails
    before a container is checkpointed."""
    from gpusnap.trust.remote import PushTrust  # cryptography: imported only when pushing

    return (_target(source, ref_text, image_format),
            PushTrust.load(trust, chunked=image_format == "gpusnap"))


def preflight(source: str, ref_text: str, opts: RegistryOptions, trust: TrustOptions | None,
              image_format: str = "gpusnap") -> None:
    """What a push of the container ``source`` refuses before it checkpoints
    anything (the reference, the keys, the registry's credentials), asked
    alone: --detach asks it in the foreground, so that a refusal is its one
    line and leaves no failed background upload behind."""
    ref, _ = target_and_keys(source, ref_text, trust, image_format)
    client = RegistryClient(ref, opts, push=True)
    try:
        client.ping()
    finally:
        client.close()
