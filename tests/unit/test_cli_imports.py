"""The GPU hosts install gpusnap offline, over a PyTorch venv without the registry,
trust and shim libraries: the CLI, the hook and the CRIU action script must load
without them (each command imports what it needs when it runs)."""

from __future__ import annotations

import subprocess
import sys

OPTIONAL = ("cryptography", "grpc", "google", "requests", "zstandard", "pyroute2")
PROBE = f"""
import builtins
real = builtins.__import__
def guarded(name, *a, **k):
    if name.split(".")[0] in {OPTIONAL!r}:
        raise ImportError("blocked for this test: " + name)
    return real(name, *a, **k)
builtins.__import__ = guarded
import importlib
import gpusnap.cli.main, gpusnap.hook.main, gpusnap.action.action, gpusnap.runtime.fifo_pump
for module in set(gpusnap.cli.main.VERBS.values()):  # each command's module, loaded as it runs
    importlib.import_module("gpusnap.cli." + module)
gpusnap.cli.main.cli(["--help"], standalone_mode=False)
"""


def test_entry_points_load_without_optional_libraries():
    res = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "gpusnap key generate" in res.stdout
