"""OCI specs for the spec-modifier tests: a CDI-style NVIDIA container and a real Podman export."""

from __future__ import annotations

import json
from pathlib import Path

from gpusnap.gpu.nodes import DeviceRemap, NodeChange, PathChange

FIXTURES = Path(__file__).parent / "fixtures"
EXPORT = FIXTURES / "podman-export"
UUID_A = "GPU-aaaaaaaa-0000-0000-0000-000000000000"
UUID_B = "GPU-bbbbbbbb-0000-0000-0000-000000000000"
UUID_C = "GPU-cccccccc-0000-0000-0000-000000000000"
BDF0, BDF1, BDF2 = "0000:18:00.0", "0000:2a:00.0", "0000:3a:00.0"


def dev(path: str, major: int, minor: int) -> dict:
    return {"path": path, "type": "c", "major": major, "minor": minor, "fileMode": 8630,
            "uid": 0, "gid": 0}


def allow(major: int | None, minor: int | None, allowed: bool = True, kind: str = "c") -> dict:
    rule = {"allow": allowed, "type": kind, "access": "rwm"}
    if major is not None:
        rule["major"] = major
    if minor is not None:
        rule["minor"] = minor
    return rule


def bind(source: str, destination: str | None = None) -> dict:
    return {"destination": destination or source, "type": "bind", "source": source,
            "options": ["rbind", "nosuid", "noexec"]}


def nvidia_spec() -> dict:
    """A container given host GPUs 0 and 1, laid out as nvidia-ctk's CDI spec does."""
    return {
        "ociVersion": "1.0.2-dev",
        "process": {"args": ["python", "train.py"],
                    "env": ["PATH=/usr/bin", f"NVIDIA_VISIBLE_DEVICES=0,{UUID_B}"]},
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {"destination": "/dev", "type": "tmpfs", "source": "tmpfs", "options": ["mode=755"]},
            bind(f"/proc/driver/nvidia/gpus/{BDF0}"),
            bind(f"/proc/driver/nvidia/gpus/{BDF1}"),
            bind("/usr/lib/x86_64-linux-gnu/libcuda.so.580.159.04"),
        ],
        "annotations": {"cdi.k8s.io/nvidia-device-plugin_GPU-0": "nvidia.com/gpu=0",
                        "cdi.k8s.io/nvidia-device-plugin_GPU-1": f"nvidia.com/gpu={UUID_B}",
                        "io.podman.annotations.init": "FALSE"},
        "linux": {
            "devices": [dev("/dev/nvidiactl", 195, 255), dev("/dev/nvidia-uvm", 508, 0),
                        dev("/dev/nvidia-uvm-tools", 508, 1), dev("/dev/nvidia0", 195, 0),
                        dev("/dev/nvidia1", 195, 1), dev("/dev/dri/card1", 226, 1),
                        dev("/dev/dri/renderD128", 226, 128)],
            "resources": {"devices": [allow(None, None, False, kind=None), allow(195, 255),
                                      allow(508, None), allow(195, 0), allow(195, 1),
                                      allow(226, 1), allow(226, 128)]},
            "maskedPaths": ["/proc/acpi"],
        },
    }


def move_0_to_2(container_paths: str = "keep") -> DeviceRemap:
    """GPU 0 (UUID_A, 0000:18:00.0, card1/renderD128) -> GPU 2 (UUID_C, 0000:3a:00.0, card3/renderD130)."""
    return DeviceRemap(
        nodes=(NodeChange("/dev/nvidia0", "/dev/nvidia2", (195, 0), (195, 2)),
               NodeChange("/dev/dri/card1", "/dev/dri/card3", (226, 1), (226, 3)),
               NodeChange("/dev/dri/renderD128", "/dev/dri/renderD130", (226, 128), (226, 130))),
        paths=(PathChange(f"/proc/driver/nvidia/gpus/{BDF0}", f"/proc/driver/nvidia/gpus/{BDF2}"),
               PathChange(f"/dev/dri/by-path/pci-{BDF0}-card", f"/dev/dri/by-path/pci-{BDF2}-card")),
        ids=(("0", "2"), (UUID_A, UUID_C)),
        container_paths=container_paths)


def swap_0_1(container_paths: str = "keep") -> DeviceRemap:
    return DeviceRemap(
        nodes=(NodeChange("/dev/nvidia0", "/dev/nvidia1", (195, 0), (195, 1)),
               NodeChange("/dev/nvidia1", "/dev/nvidia0", (195, 1), (195, 0))),
        paths=(PathChange(f"/proc/driver/nvidia/gpus/{BDF0}", f"/proc/driver/nvidia/gpus/{BDF1}"),
               PathChange(f"/proc/driver/nvidia/gpus/{BDF1}", f"/proc/driver/nvidia/gpus/{BDF0}")),
        ids=(("0", "1"), ("1", "0"), (UUID_A, UUID_B), (UUID_B, UUID_A)),
        container_paths=container_paths)


def podman_spec() -> dict:
    """spec.dump of a real export (/dev/zero stands in as /dev/nvidia0, /dev/full as renderD128)."""
    return json.loads((EXPORT / "spec.dump").read_text())


def devices_of(spec: dict) -> dict[str, tuple[int, int]]:
    return {d["path"]: (d["major"], d["minor"]) for d in spec["linux"]["devices"]}
