"""gpusnap: GPU-aware checkpoint/restore for containers.

Data flows one way through the package: discover (runtime/, gpu/inventory,
procs) -> plan (gpu/quiesce decides who is locked) -> act (action/action,
runtime/podman) -> record (gpu/manifest).
"""

__version__ = "0.1.0"

MANIFEST_NAME = "gpusnap-manifest.json"
"""File written into CRIU's image directory; it travels inside Podman exports."""

PLAN_NAME = "gpusnap-plan.json"
"""The GPU plan a remapping restore puts beside the manifest: the hook checks it,
the CRIU action script hands its UUID pairs to the driver."""
