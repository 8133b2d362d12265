"""OCI registry transport for checkpoint bundles."""
