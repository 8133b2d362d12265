"""OCI registry transport for checkpoint bundles. Not built yet: tracked in the registry issue."""
