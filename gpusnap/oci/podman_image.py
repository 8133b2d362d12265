"""`--format podman`: a checkpoint image as `podman container checkpoint
--create-image` makes it, so that `podman container restore IMAGE` (after a
`podman pull`) restores it with no gpusnap on the target. (`podman run IMAGE`
does not restore checkpoint images in Podman 4.3, not even Podman's own:
"no command or entrypoint provided".)

Podman 4's shape (libpod's createCheckpointImage): an image built from
scratch whose one layer holds the files of the checkpoint export (checkpoint/,
config.dump, spec.dump, ...) at its root, and the manifest annotations
`io.podman.annotations.checkpoint.*` describing the container and the host.
Podman treats an image as a checkpoint when it has the `runtime.name`
annotation, and refuses it unless that runtime is the target's default.
The layer is zstd (Podman 4 pulls zstd layers), uploaded while it is made.
"""

from __future__ import annotations

import json
import platform
import shlex
import time
from typing import TYPE_CHECKING

from gpusnap.errors import GpusnapError

if TYPE_CHECKING:
    from gpusnap.oci.registry import RegistryOptions

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
LAYER_ZSTD = "application/vnd.oci.image.layer.v1.tar+zstd"
PREFIX = "io.podman.annotations.checkpoint."
RUNTIME_NAME = PREFIX + "runtime.name"
NAME = PREFIX + "name"
_GOARCH = {"x86_64": "amd64", "aarch64": "arm64", "ppc64le": "ppc64le", "s390x": "s390x"}


def criu_number(version: str | None) -> str:
    """CRIU's version as Podman writes it (CRIU's own number): 4.1.1 -> 40101."""
    try:
        parts = [int(p) for p in (version or "").split(".")[:3]]
    except ValueError:
        return ""
    if not parts:
        return ""
    parts += [0] * (3 - len(parts))
    return str(parts[0] * 10000 + parts[1] * 100 + parts[2])


def annotations(config_dump: dict, info: dict, criu_version: str | None) -> dict[str, str]:
    """The keys `podman container checkpoint --create-image` sets, from the
    checkpoint's config.dump and the pushing host's `podman info`."""
    host = info.get("host") or {}
    runtime = host.get("ociRuntime") or {}
    dist = host.get("distribution") or {}
    notes = {
        NAME: config_dump.get("name") or "",
        PREFIX + "rawImageName": config_dump.get("rawImageName") or "",
        PREFIX + "rootfsImageID": config_dump.get("rootfsImageID") or "",
        PREFIX + "rootfsImageName": config_dump.get("rootfsImageName") or "",
        PREFIX + "podman.version": (info.get("version") or {}).get("Version") or "",
        PREFIX + "criu.version": criu_number(criu_version),
        # Podman restores only with the runtime named here: the checkpoint's own.
        RUNTIME_NAME: config_dump.get("runtime") or runtime.get("name") or "",
        PREFIX + "runtime.version": runtime.get("version") or "",
        PREFIX + "conmon.version": (host.get("conmon") or {}).get("version") or "",
        PREFIX + "host.arch": host.get("arch") or _GOARCH.get(platform.machine(), ""),
        PREFIX + "host.kernel": host.get("kernel") or platform.release(),
        PREFIX + "cgroups.version": host.get("cgroupVersion") or "",
        PREFIX + "distribution.version": dist.get("version") or "",
        PREFIX + "distribution.name": dist.get("distribution") or "",
    }
    if not notes[RUNTIME_NAME]:
        raise GpusnapError("cannot tell which OCI runtime made this checkpoint (config.dump "
                           "names none)", "push it without --format podman")
    return notes


def image_config(diff_id: str, arch: str) -> bytes:
    created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return json.dumps({
        "created": created, "architecture": arch, "os": "linux", "config": {},
        "rootfs": {"type": "layers", "diff_ids": [diff_id]},
        "history": [{"created": created, "created_by": "gpusnap push --format podman"}],
    }, separators=(",", ":")).encode()


def manifest(config_digest: str, config_size: int, layer_digest: str, layer_size: int,
             notes: dict[str, str], layer_notes: dict[str, str] | None = None) -> bytes:
    """``layer_notes``: the layer is encrypted (ocicrypt's "+encrypted" media type
    and its key annotations, gpusnap/trust/ocicrypt_layer.py)."""
    layer = {"mediaType": LAYER_ZSTD + ("+encrypted" if layer_notes else ""),
             "digest": layer_digest, "size": layer_size}
    if layer_notes:
        layer["annotations"] = layer_notes
    return json.dumps({
        "schemaVersion": 2, "mediaType": OCI_MANIFEST,
        "config": {"mediaType": OCI_CONFIG, "digest": config_digest, "size": config_size},
        "layers": [layer],
        "annotations": notes,
    }, separators=(",", ":")).encode()


def is_checkpoint_image(manifest_: dict) -> bool:
    return RUNTIME_NAME in (manifest_.get("annotations") or {})


def container_name(manifest_: dict) -> str | None:
    """The name of the container the image was made from (Podman's annotation)."""
    return (manifest_.get("annotations") or {}).get(NAME)


def restore_command(where: str, opts: RegistryOptions | None = None,
                    encrypted: bool = False, rename: str | None = None) -> str:
    """What restores a Podman checkpoint image, as printed for a user to run
    (the registry flags in Podman's words; KEY stands for the recipient's key;
    ``rename``: the --name to restore under, where the container's is taken)."""
    flags = opts.podman_flags() if opts is not None else ""
    key = " --decryption-key KEY" if encrypted else ""
    name = f" --name {shlex.quote(rename)}" if rename else ""
    return f"podman pull{flags}{key} {where} && podman container restore{name} {where}"


def summary(manifest_: dict, where: str, opts: RegistryOptions | None = None,
            rename: str | None = None) -> dict:
    """What `gpusnap inspect` can say from the manifest alone."""
    notes = manifest_.get("annotations") or {}
    layers = manifest_.get("layers") or []
    return {"source": where, "format": "podman",
            "container": {"name": notes.get(NAME), "image": notes.get(PREFIX + "rootfsImageName"),
                          "id": None},
            "runtime": notes.get(RUNTIME_NAME),
            "criu_version": notes.get(PREFIX + "criu.version"),
            "podman_version": notes.get(PREFIX + "podman.version"),
            "host": {"arch": notes.get(PREFIX + "host.arch"),
                     "kernel": notes.get(PREFIX + "host.kernel")},
            "stored_bytes": sum(int(layer.get("size", 0)) for layer in layers),
            "annotations": notes,
            "restore": restore_command(where, opts, rename=rename)}
