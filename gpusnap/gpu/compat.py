"""Can this host take a checkpoint's GPU state? Checked before anything is touched."""

from __future__ import annotations

from gpusnap.gpu.inventory import Inventory
from gpusnap.gpu.manifest import Manifest

MIN_CHECKPOINT_DRIVER = 570


def driver_major(version: str | None) -> int:
    try:
        return int((version or "0").split(".")[0])
    except ValueError:
        return 0


def restore_problems(manifest: Manifest | None, inventory: Inventory) -> list[str]:
    """One clear line per reason this host cannot restore the checkpoint's GPUs as they were."""
    if manifest is None or not manifest.gpus:
        return []
    if inventory.error:
        return [f"the checkpoint used {len(manifest.gpus)} NVIDIA GPU(s) but this host has none "
                f"usable ({inventory.error})"]
    problems = []
    if driver_major(inventory.driver_version) < MIN_CHECKPOINT_DRIVER:
        problems.append(f"NVIDIA driver {inventory.driver_version} cannot restore CUDA "
                        f"checkpoints: r{MIN_CHECKPOINT_DRIVER} or newer is needed")
    for gpu in manifest.gpus:
        here = inventory.by_uuid(gpu["uuid"])
        if here is None:
            problems.append(f"GPU {gpu['index']} of the checkpoint ({gpu['name']}, {gpu['uuid']}) "
                            "is not on this host")
        elif here.name != gpu["name"]:
            problems.append(f"GPU {gpu['uuid']} is a {here.name} here but was a {gpu['name']}")
    return problems
