"""GPU plan and device edits for a restore under the shim, made in place before `runc restore`.

Under Podman gpusnap rewrites the export stream; under containerd the bundle's
config.json and the CRIU image directory (unpacked by containerd for this one
restore) are local files, so they are edited where they lie, with the same
pieces: the plan (gpusnap.ops.gpu_plan.plan_here, with the container's
`io.gpusnap.gpu-map` annotation or GPUSNAP_GPU_MAP), the spec modifiers
(rewrite_spec), CRIU's /dev tmpfs tarball (rewrite_dev_tar) and the plan file
the CRIU action script keeps at pre-restore.

Everything is computed before anything is written, so a refusal changes
nothing; the originals are copied into BUNDLE/gpusnap-restore/ first, and
`undo` puts them back after a failed restore, or a failed `apply`. A backup is
never deleted while it may hold the only originals: `apply` puts an earlier
one back first, and the backup counts as whole only once its image-dir file
(written last) is there.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from gpusnap import PLAN_NAME
from gpusnap.criu.devtmpfs import DevTarError, rewrite_dev_tar
from gpusnap.criu.images import ImageError, dev_tmpfs_image, external_mount_keys
from gpusnap.errors import GpusnapError
from gpusnap.gpu import manifest as gpu_manifest
from gpusnap.gpu.gpumap import GPU_MAP_ANNOTATION
from gpusnap.gpu.nodes import DeviceRemap
from gpusnap.oci.spec import SpecError, rewrite_spec
from gpusnap.ops import gpu_plan
from gpusnap.private import open_private

log = logging.getLogger("gpusnap.shim")

# A JSON DeviceRemap (DeviceRemap.to_dict) applied to every restore this shim
# makes while the file exists, with no GPU planning: moves non-GPU device nodes,
# and is how the CPU tests drive the edits without a GPU.
DEVICE_REMAP_ENV = "GPUSNAP_SHIM_DEVICE_REMAP"
BACKUP = "gpusnap-restore"
_HINT = ("name target GPUs with the container's io.gpusnap.gpu-map annotation (or GPUSNAP_GPU_MAP "
         "in containerd's environment), or restore on a host with the checkpoint's GPUs; nothing was changed")


@dataclass(frozen=True)
class Edits:
    """What a restore changes: the new config.json, the new /dev image, the plan file."""

    spec: dict
    dev_image: Path | None
    dev_data: bytes | None
    plan: dict

    def describe(self) -> str:
        return ", ".join(f"{n.old_path} {n.old[0]}:{n.old[1]} -> {n.new_path} {n.new[0]}:{n.new[1]}"
                         for n in DeviceRemap.from_dict(self.plan["remap"]).nodes) or "no device nodes"


def gpu_map_for(spec: dict) -> str | None:
    """The container's own --gpu-map (its annotation), else the shim's environment's."""
    return (spec.get("annotations") or {}).get(GPU_MAP_ANNOTATION) or os.environ.get(gpu_plan.GPU_MAP_ENV) or None


def _forced_remap() -> DeviceRemap | None:
    path = os.environ.get(DEVICE_REMAP_ENV)
    if not path or not os.path.exists(path):
        return None
    try:
        return DeviceRemap.from_dict(json.loads(Path(path).read_text()))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise GpusnapError(f"{DEVICE_REMAP_ENV}={path}: not a device remap ({exc})") from None


def _plan(spec: dict, image_dir: Path) -> tuple[DeviceRemap, dict] | None:
    forced = _forced_remap()
    if forced is not None:
        # No GPU moves: the action script offers the driver no UUID pairs.
        return forced, {"moves": [], "uuid_pairs": [], "remap": forced.to_dict(), "overridden": []}
    manifest = gpu_manifest.read(image_dir)
    if manifest is None:
        return None  # no GPU in the checkpoint: nothing to plan
    plan = gpu_plan.plan_here(manifest, gpu_map_for(spec), refusal_hint=_HINT)
    # nvidia-uvm's major is the driver's to pick at load: another host's, or this
    # one's before a reboot, is renumbered even where every GPU stays
    plan = gpu_plan.with_host_numbers(plan, spec)
    if not plan.needs_remap and not plan.remap.nodes:
        return None  # the checkpoint's own GPUs and nodes: restored as they are
    return plan.remap, plan.to_dict()


def plan_edits(bundle: str | Path, image_dir: str | Path) -> Edits | None:
    """The edits restoring IMAGE_DIR into BUNDLE needs here, or None; GpusnapError (one line) when it cannot."""
    image_dir = Path(image_dir)
    config = Path(bundle) / "config.json"
    try:
        spec = json.loads(config.read_text())
        planned = _plan(spec, image_dir)
        if planned is None:
            return None
        remap, plan = planned
        new_spec = rewrite_spec(spec, remap, ext_keys=external_mount_keys(image_dir))
        dev = dev_tmpfs_image(image_dir)
        dev_data = rewrite_dev_tar(dev.read_bytes(), remap) if dev is not None else None
    except (SpecError, DevTarError, ImageError) as exc:
        raise GpusnapError(f"cannot move the container's devices: {exc}", _HINT) from None
    except (OSError, ValueError) as exc:
        raise GpusnapError(f"cannot read the restore's spec or checkpoint: {exc}") from None
    return Edits(new_spec, dev, dev_data, plan)


def _replace(path: Path, data: bytes) -> None:
    """PATH's content replaced, its mode kept (containerd's config.json is 0644 or
    so); the copy is 0600 while it is written: the spec holds the environment."""
    tmp = path.with_name(f".{path.name}.gpusnap")
    with open_private(tmp, "wb") as f:
        f.write(data)
    if path.exists():
        os.chmod(tmp, path.stat().st_mode & 0o7777)
    os.replace(tmp, path)


def apply(bundle: str | Path, image_dir: str | Path, edits: Edits) -> None:
    """Copy the originals into BUNDLE/gpusnap-restore/, then put the edited files in place."""
    bundle, image_dir = Path(bundle), Path(image_dir)
    backup = bundle / BACKUP
    undo(bundle)  # an earlier apply's backup may hold the only originals: put back, not deleted
    backup.mkdir(mode=0o700)
    shutil.copy2(bundle / "config.json", backup / "config.json")
    if edits.dev_image is not None:
        shutil.copy2(edits.dev_image, backup / edits.dev_image.name)
    _replace(backup / "image-dir", str(image_dir).encode())  # last, whole: the backup is complete
    _replace(bundle / "config.json", json.dumps(edits.spec).encode())
    if edits.dev_image is not None and edits.dev_data is not None:
        _replace(edits.dev_image, edits.dev_data)
    _replace(image_dir / PLAN_NAME, json.dumps(edits.plan).encode())
    log.info("restore of %s moves %s", bundle.name, edits.describe())


def undo_after_failure(bundle: str | Path) -> None:
    """``undo`` after a failed restore: its own failure (a full disk, the very
    case it is there for) is logged, never said in place of the restore's; the
    backup stays for the next Start's ``apply`` to put back."""
    try:
        undo(bundle)
    except OSError as exc:
        log.error("restore in %s: putting back the original spec failed: %s", bundle, exc)


def undo(bundle: str | Path) -> None:
    """Put back what `apply` changed (after a failed restore or apply); nothing when it changed nothing."""
    bundle = Path(bundle)
    backup = bundle / BACKUP
    if not (backup / "image-dir").exists():
        shutil.rmtree(backup, ignore_errors=True)  # cut short before any edit: the originals are in place
        return
    image_dir = Path((backup / "image-dir").read_text())
    for saved in backup.iterdir():
        if saved.name == "config.json":
            shutil.copy2(saved, bundle / "config.json")
        elif saved.name != "image-dir" and image_dir.is_dir():
            shutil.copy2(saved, image_dir / saved.name)
    (image_dir / PLAN_NAME).unlink(missing_ok=True)
    shutil.rmtree(backup, ignore_errors=True)
