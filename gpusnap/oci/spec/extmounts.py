"""CRIU's external-mount map must still fit the rewritten spec.

At restore runc tells CRIU, for every bind mount, "external mount <destination>
is host <source>", and for every linux.devices entry "external mount <path> is
host <path>" (the container path, used as the host path). Each mount the
checkpoint image recorded with an external key (ext_key in mountpoints-*.img)
must be named that way again, or CRIU stops with "no external mount". Devices
only appear there when they were bind-mounted (containers in a user
namespace); then runc binds the host node at the container's path, so moving
such a device needs container paths equal to host paths.
"""

from __future__ import annotations

from typing import Collection

from gpusnap.gpu.nodes import DeviceRemap
from gpusnap.oci.spec.errors import SpecError
from gpusnap.oci.spec.mounts import is_bind


def provided_keys(spec: dict) -> tuple[set[str], list[str]]:
    """(keys runc will pass, destinations under which any key is passed: cgroup v1 binds)."""
    keys = {m["destination"] for m in spec.get("mounts") or [] if is_bind(m)}
    linux = spec.get("linux") or {}
    keys |= {d["path"] for d in linux.get("devices") or []}
    if linux.get("maskedPaths"):
        keys.add("/dev/null")  # runc masks files with /dev/null binds
    prefixes = [m["destination"] for m in spec.get("mounts") or [] if m.get("type") == "cgroup"]
    return keys, prefixes


def check_external_mounts(spec: dict, ext_keys: Collection[str], remap: DeviceRemap) -> list[str]:
    """One line per external mount the restore would miss or bind to the wrong host node."""
    keys, prefixes = provided_keys(spec)
    errors = []
    for key in sorted(ext_keys):
        if key in keys or any(key.startswith(p.rstrip("/") + "/") for p in prefixes):
            continue
        errors.append(f"the checkpoint has an external mount at {key} but the rewritten spec has "
                      "no bind mount or device there (CRIU would stop: no external mount for it)")
    for d in (spec.get("linux") or {}).get("devices") or []:
        if d["path"] not in ext_keys or d.get("type") == "p":
            continue
        change = next((n for n in remap.nodes if n.new == (d["major"], d["minor"])), None)
        if change is not None and change.new_path != d["path"]:
            errors.append(f"{d['path']} was bind-mounted into the container (user namespace), and "
                          f"runc restores it from the host's {d['path']}, not from {change.new_path} "
                          "where the new GPU is")
    return errors


class ExternalMounts:
    """A modifier that changes nothing and refuses a spec CRIU could not restore."""

    def __init__(self, ext_keys: Collection[str]) -> None:
        self.ext_keys = frozenset(ext_keys)

    def __call__(self, spec: dict, remap: DeviceRemap) -> dict:
        errors = check_external_mounts(spec, self.ext_keys, remap)
        if errors:
            raise SpecError("spec: " + "; ".join(errors))
        return spec
