"""containerd runtime v2 shim (gRPC). Not built yet: tracked in the containerd shim issue."""
