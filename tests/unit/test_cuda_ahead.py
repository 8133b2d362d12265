"""gpu/cuda.DriverAhead: the driver loaded on a thread while Podman or CRIU
works; a process that exits first waits for the load (libcuda's exit handlers
must not run under a cuInit in flight)."""

from __future__ import annotations

import subprocess
import sys
import time

from gpusnap.gpu import cuda


def test_on_a_host_without_the_driver_it_is_none_and_the_caller_loads_it_itself(monkeypatch):
    monkeypatch.setenv("GPUSNAP_LIBCUDA", "/nonexistent/libcuda.so.1")
    monkeypatch.setattr(cuda, "LIBCUDA_CANDIDATES", ())
    assert cuda.DriverAhead().get() is None


SLOW_LOAD = """
import sys, time
from gpusnap.gpu import cuda
class Slow:
    def __init__(self):
        time.sleep(0.6)
    def init(self):
        open(sys.argv[1], "w").write("loaded")
cuda.CudaDriver = Slow
cuda.DriverAhead()
sys.exit(3)  # a restore that failed at once
"""


def test_a_process_that_exits_first_waits_for_the_load(tmp_path):
    mark = tmp_path / "mark"
    started = time.monotonic()
    res = subprocess.run([sys.executable, "-c", SLOW_LOAD, str(mark)], timeout=60)
    assert res.returncode == 3
    assert mark.read_text() == "loaded" and time.monotonic() - started >= 0.6


def test_a_load_that_never_ends_is_waited_for_no_longer_than_its_bound(monkeypatch):
    class Stuck:  # a cuInit that does not return
        def __init__(self):
            time.sleep(60)
    monkeypatch.setattr(cuda, "CudaDriver", Stuck)
    monkeypatch.setattr(cuda.DriverAhead, "SETTLE_S", 0.3)
    started = time.monotonic()
    assert cuda.DriverAhead().get() is None
    assert time.monotonic() - started < 5
