"""CDI device requests in annotations (cdi.k8s.io/<key> = vendor/class=name,...).

Device plugins record the CDI devices they allocated there; names that are a
moved GPU's index or UUID are renamed to the new GPU's, in the same form.
Names and keys are checked with CDI's own rules (vendor and class: a letter
first, then letters, digits, '_', '-', '.', ending in a letter or digit;
device names may also hold ':'), with errors that say which character.
"""

from __future__ import annotations

import copy

from gpusnap.gpu.nodes import DeviceRemap
from gpusnap.oci.spec.errors import SpecError

PREFIX = "cdi.k8s.io/"
MAX_KEY_NAME = 63


def _alnum(c: str) -> bool:
    return c.isascii() and c.isalnum()


def _check_chars(text: str, allowed_inner: str, what: str, device: str) -> None:
    for c in text[1:-1]:
        if not (_alnum(c) or c in allowed_inner):
            raise SpecError(f"CDI device {device!r}: invalid character {c!r} in {what} {text!r}")
    if not _alnum(text[-1]):
        raise SpecError(f"CDI device {device!r}: {what} {text!r} should end with a letter or digit")


def parse_qualified_name(device: str) -> tuple[str, str, str]:
    """'nvidia.com/gpu=0' -> ('nvidia.com', 'gpu', '0'), or SpecError saying what is wrong."""
    kind, eq, name = device.partition("=")
    vendor, slash, cls = kind.partition("/")
    if not device or device.startswith("/"):
        raise SpecError(f"CDI device {device!r} is not qualified (vendor/class=name)")
    if not eq or not slash or not vendor:
        raise SpecError(f"CDI device {device!r} is not qualified: missing vendor")
    if not cls:
        raise SpecError(f"CDI device {device!r} is not qualified: missing class")
    if not name:
        raise SpecError(f"CDI device {device!r} is not qualified: missing device name")
    for text, what in ((vendor, "vendor"), (cls, "class")):
        if not text[0].isascii() or not text[0].isalpha():
            raise SpecError(f"CDI device {device!r}: {what} {text!r} should start with a letter")
        _check_chars(text, "_-.", what, device)
    if not _alnum(name[0]):
        raise SpecError(f"CDI device {device!r}: device name {name!r} should start with a letter "
                        "or digit")
    if len(name) > 1:
        _check_chars(name, "_-.:", "device name", device)
    return vendor, cls, name


def validate_key(key: str) -> None:
    name = key[len(PREFIX):]
    if not name:
        raise SpecError(f"CDI annotation {key!r} has an empty name")
    if len(name) > MAX_KEY_NAME:
        raise SpecError(f"CDI annotation {key!r}: name is {len(name)} characters, at most "
                        f"{MAX_KEY_NAME}")
    if not _alnum(name[0]) or not _alnum(name[-1]):
        raise SpecError(f"CDI annotation {key!r}: name should start and end with a letter or digit")
    bad = next((c for c in name if not (_alnum(c) or c in "_-.")), None)
    if bad is not None:
        raise SpecError(f"CDI annotation {key!r}: invalid character {bad!r} in name")


def remap_cdi_annotations(spec: dict, remap: DeviceRemap) -> dict:
    out = copy.deepcopy(spec)
    annotations = out.get("annotations") or {}
    for key in sorted(annotations):
        if not key.startswith(PREFIX):
            continue
        validate_key(key)
        names = []
        for device in annotations[key].split(","):
            vendor, cls, name = parse_qualified_name(device)
            new = remap.gpu_id(name) if f"{vendor}/{cls}" in remap.cdi_kinds else None
            names.append(f"{vendor}/{cls}={new}" if new else device)
        annotations[key] = ",".join(names)
    return out
