"""gpu/cuda.CudaDriver's cuInit has a bound (waits.Bound DRIVER): a wedged driver
never answers it, and doctor, restore's check and the driver calls would wait
with it. Past the bound one line says so; later calls fail at once; the CLI
then leaves without libcuda's exit handlers, which would wait on it too."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from gpusnap.gpu import cuda
from gpusnap.waits import WaitExpired


class _Lib:
    """libcuda with a cuInit that returns when ``go`` is set."""

    def __init__(self) -> None:
        self.go = threading.Event()
        self.calls = 0

    def cuInit(self, flags: int) -> int:
        self.calls += 1
        self.go.wait(30)
        return cuda.CUDA_SUCCESS

    def cuCheckpointProcessGetState(self, pid, state) -> int:
        return cuda.CUDA_SUCCESS


def _driver(lib: _Lib) -> cuda.CudaDriver:
    driver = object.__new__(cuda.CudaDriver)
    driver._lib = lib
    driver._init_lock = threading.Lock()
    driver._initialised = False
    driver._init_call = None
    return driver


def test_a_cuinit_that_does_not_answer_ends_at_its_bound_and_later_calls_at_once(monkeypatch):
    monkeypatch.setenv("GPUSNAP_WAIT_DRIVER", "0.3")
    monkeypatch.setattr(cuda, "_HUNG", [])
    lib = _Lib()
    driver = _driver(lib)
    started = time.monotonic()
    with pytest.raises(WaitExpired) as err:
        driver.state(1)
    assert 0.3 <= time.monotonic() - started < 5
    assert err.value.message.startswith("the NVIDIA driver's cuInit: no answer within")
    assert "wedged" in err.value.hint and cuda.init_hung()
    started = time.monotonic()
    with pytest.raises(WaitExpired):
        driver.state(1)  # the same cuInit, still in flight: not waited for again
    assert time.monotonic() - started < 0.2 and lib.calls == 1
    lib.go.set()  # the driver answers after all
    deadline = time.monotonic() + 10
    while cuda.init_hung() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert driver.state(1) == cuda.ProcessState.RUNNING and lib.calls == 1


def test_a_healthy_cuinit_is_called_once():
    lib = _Lib()
    lib.go.set()
    driver = _driver(lib)
    driver.init()
    driver.state(1)
    assert lib.calls == 1


HUNG_CLI = """
import sys, threading
from gpusnap.gpu import cuda
stuck = threading.Thread(target=threading.Event().wait)  # not a daemon: exit would join it
stuck.start()
cuda._HUNG.append(stuck)
sys.argv = ["gpusnap", "--version"]
from gpusnap.cli.main import main
main()
"""


def test_the_cli_leaves_while_a_cuinit_hangs():
    res = subprocess.run([sys.executable, "-c", HUNG_CLI], capture_output=True, text=True,
                         timeout=20)
    assert res.returncode == 0 and res.stdout.strip(), (res.returncode, res.stderr)
