"""Container engines gpusnap drives: Podman now (CLI), containerd through shim/."""
