"""Protobuf definitions for the containerd shim. Not built yet: tracked in the shim issue."""
