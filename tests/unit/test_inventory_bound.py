"""gpu/inventory.read_inventory: NVML waits on a wedged GPU as libcuda does, so
its read is a driver call bounded by DRIVER, and never raises."""

from __future__ import annotations

import sys
import threading
import time
import types

import pytest

from gpusnap.gpu import driver_calls, inventory
from gpusnap.gpu.inventory import Inventory


class _Error(Exception):
    pass


def _fake_nvml(init) -> types.ModuleType:
    nvml = types.ModuleType("pynvml")
    nvml.NVMLError = _Error
    nvml.NVML_DEVICE_MIG_ENABLE = 1
    nvml.nvmlInit = init
    nvml.nvmlShutdown = lambda: None
    nvml.nvmlSystemGetDriverVersion = lambda: b"580.159.04"
    nvml.nvmlSystemGetCudaDriverVersion = lambda: 13000
    nvml.nvmlDeviceGetCount = lambda: 0
    return nvml


@pytest.fixture
def calls(monkeypatch):
    monkeypatch.setattr(driver_calls, "_HUNG", [])
    monkeypatch.setattr(driver_calls, "_CALLS", [])


def test_a_driver_that_answers_gives_its_inventory(monkeypatch, calls):
    monkeypatch.setitem(sys.modules, "pynvml", _fake_nvml(lambda: None))
    inv = inventory.read_inventory()
    assert inv.error is None and inv.driver_version == "580.159.04" and inv.cuda_driver_version == "13.0"


def test_an_nvml_that_never_answers_is_an_error_within_the_bound(monkeypatch, calls):
    go = threading.Event()
    asked = []
    monkeypatch.setitem(sys.modules, "pynvml", _fake_nvml(lambda: (asked.append(1), go.wait(30))))
    monkeypatch.setenv("GPUSNAP_WAIT_DRIVER", "0.3")
    try:
        started = time.monotonic()
        inv = inventory.read_inventory()
        assert time.monotonic() - started < 5
        assert inv.gpus == [] and "NVML did not answer within" in inv.error and "wedged" in inv.error
        assert inv.unanswered and Inventory.from_dict(inv.to_dict()).unanswered
        assert driver_calls.driver_busy()  # the command leaves by os._exit meanwhile
        again = inventory.read_inventory()  # not a second wait on the same wedged driver
        assert again.error == inv.error and asked == [1]
    finally:
        go.set()


def test_a_checkpoint_refuses_gpus_nvml_did_not_answer_about():
    """Else the manifest would record no GPU, and the restore would check none."""
    from gpusnap.errors import GpusnapError
    from gpusnap.gpu.quiesce import refuse_unsupported
    from gpusnap.procs import ProcessGpuUse

    procs = [ProcessGpuUse(pid=7, comm="python3", gpu_minors=[0])]
    unread = Inventory(error="NVML did not answer within 120 s: the driver or a GPU may be wedged",
                       unanswered=True)
    with pytest.raises(GpusnapError, match="cannot read the GPUs of 1 CUDA process"):
        refuse_unsupported(procs, unread)
    refuse_unsupported([], unread)  # no CUDA process: nothing to record
    refuse_unsupported(procs, Inventory(error="nvidia-ml-py is not installed"))  # as before
