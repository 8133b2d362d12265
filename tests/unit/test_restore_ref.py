"""ops/restore_ref.py's edges that need no registry or Podman."""

from __future__ import annotations

import time

import pytest

from gpusnap.errors import GpusnapError
from gpusnap.gpu.inventory import Inventory
from gpusnap.oci.registry_options import RegistryOptions
from gpusnap.ops import restore_ref


def test_a_restore_refused_before_its_plan_lets_nvmls_read_end_first(monkeypatch):
    """NVML is read in a thread beside the registry; a restore refused before
    the plan asks for it still waits for that read (bounded), so the process
    never exits with the driver's library mid-call."""
    ended = []

    def slow_read() -> Inventory:
        time.sleep(0.3)
        ended.append(True)
        return Inventory(error="no NVIDIA driver")

    def unreachable(*_a, **_k):
        raise GpusnapError("cannot reach 127.0.0.1:1", "check the address")

    monkeypatch.setattr(restore_ref, "read_inventory", slow_read)
    monkeypatch.setattr(restore_ref, "open_remote", unreachable)
    with pytest.raises(GpusnapError, match="cannot reach"):
        restore_ref.restore("127.0.0.1:1/a/b:v1", None, False, False, RegistryOptions(),
                            facts=lambda: None, use_cache=False)
    assert ended == [True]
