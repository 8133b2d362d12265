"""Rewrite a checkpoint's OCI spec for other GPUs: small modifiers, composed by a list.

Each modifier is ``(spec, remap) -> spec``: it returns an edited copy, never
touches its input, and can be tested alone. ``rewrite_spec`` checks the spec
strictly before and after, applies the modifiers in order and checks that
every moved node the container could open before it can open after.
"""

from __future__ import annotations

from typing import Callable, Collection, Sequence

from gpusnap.gpu.nodes import DeviceRemap
from gpusnap.oci.spec.cdi import remap_cdi_annotations
from gpusnap.oci.spec.cgroup import remap_cgroup_rules
from gpusnap.oci.spec.devices import remap_devices
from gpusnap.oci.spec.env import remap_visible_devices
from gpusnap.oci.spec.errors import SpecError
from gpusnap.oci.spec.extmounts import ExternalMounts
from gpusnap.oci.spec.mounts import remap_mounts
from gpusnap.oci.spec.validate import device_allowed, validate_spec

Modifier = Callable[[dict, DeviceRemap], dict]

DEFAULT_MODIFIERS: tuple[Modifier, ...] = (
    remap_devices,
    remap_cgroup_rules,
    remap_mounts,
    remap_cdi_annotations,
    remap_visible_devices,
)

__all__ = ["DEFAULT_MODIFIERS", "Modifier", "SpecError", "rewrite_config_dump", "rewrite_spec"]


def _rules(spec: dict) -> list[dict]:
    return ((spec.get("linux") or {}).get("resources") or {}).get("devices") or []


def check_access(before: dict, after: dict, remap: DeviceRemap) -> None:
    """A node the cgroup rules allowed before must be allowed at its new numbers."""
    for change in remap.nodes:
        if device_allowed(_rules(before), "c", *change.old) and \
                not device_allowed(_rules(after), "c", *change.new):
            raise SpecError(f"spec: after remapping, linux.resources.devices allows "
                            f"{change.old_path} ({change.old[0]}:{change.old[1]}) but not its new "
                            f"node {change.new_path} ({change.new[0]}:{change.new[1]})")


def rewrite_spec(spec: dict, remap: DeviceRemap, modifiers: Sequence[Modifier] = DEFAULT_MODIFIERS,
                 *, ext_keys: Collection[str] | None = None) -> dict:
    """The spec for restoring onto the plan's GPUs; SpecError (spec untouched) when it cannot be.

    ``ext_keys``: the external-mount keys of the checkpoint image
    (gpusnap.criu.images.external_mount_keys); with them the result is also
    checked against what CRIU will ask runc for.
    """
    validate_spec(spec)
    out = spec
    for modify in list(modifiers) + ([ExternalMounts(ext_keys)] if ext_keys is not None else []):
        out = modify(out, remap)
    validate_spec(out)
    check_access(spec, out, remap)
    return out


def rewrite_config_dump(config: dict, remap: DeviceRemap,
                        modifiers: Sequence[Modifier] = DEFAULT_MODIFIERS) -> dict:
    """Podman's config.dump carries its own copy of the spec ("spec"): keep the two alike."""
    if not isinstance(config, dict) or not isinstance(config.get("spec"), dict):
        raise SpecError("config.dump: no 'spec' object in it")
    out = dict(config)
    out["spec"] = rewrite_spec(config["spec"], remap, modifiers)
    return out
