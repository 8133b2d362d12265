"""The OCI hook (hooks.d, stage prestart): runc runs it at create and at restore."""
