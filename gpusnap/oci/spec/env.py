"""process.env NVIDIA_VISIBLE_DEVICES: the GPUs nvidia-container-runtime's hooks hand over.

A running process keeps the environment it had (CRIU restores it), but the
spec's copy is what a prestart hook run at restore reads to pick GPUs.
"""

from __future__ import annotations

import copy

from gpusnap.gpu.nodes import DeviceRemap
from gpusnap.oci.spec.cdi import parse_qualified_name

VARIABLE = "NVIDIA_VISIBLE_DEVICES"


def _token(token: str, remap: DeviceRemap) -> str:
    if "=" in token:  # a CDI name, as the toolkit's CDI mode accepts
        vendor, cls, name = parse_qualified_name(token)
        new = remap.gpu_id(name) if f"{vendor}/{cls}" in remap.cdi_kinds else None
        return f"{vendor}/{cls}={new}" if new else token
    return remap.gpu_id(token) or token


def remap_visible_devices(spec: dict, remap: DeviceRemap) -> dict:
    out = copy.deepcopy(spec)
    env = (out.get("process") or {}).get("env") or []
    for i, item in enumerate(env):
        name, _, value = item.partition("=")
        if name != VARIABLE or value in ("", "all", "none", "void"):
            continue
        env[i] = f"{name}=" + ",".join(_token(t.strip(), remap) for t in value.split(","))
    return out
