"""containerd runtime v2 shim (gRPC): `containerd-shim-gpusnap-v1`, runc driven through its CLI."""
