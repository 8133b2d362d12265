"""Startup cost of containerd-shim-gpusnap-v1 against containerd's runc shim.

Starts a private containerd (as tests/integration/test_shim.py does), imports
the demo image, then times `ctr run --rm IMAGE ID sh -c :` under
io.containerd.runc.v2 and io.containerd.gpusnap.v1, interleaved, and prints
medians and the ratio (goal: gpusnap within 1.5x). Also prints the Python
import costs on the shim's path (start, then the forked server).

    /opt/gpusnap/venv/bin/python bench/shim_startup.py [--runs 15] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.conftest import DEMO_IMAGE  # noqa: E402
from tests.integration.test_shim import VENV_BIN, PrivateContainerd  # noqa: E402

RUNTIMES = ("io.containerd.runc.v2", "io.containerd.gpusnap.v1")
PY = f"{VENV_BIN}/python"


def time_cmd(argv: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(argv, check=True, capture_output=True)
    return time.perf_counter() - t0


def import_costs(repeat: int = 5) -> dict[str, float]:
    """Median wall seconds of a fresh interpreter doing each step's imports."""
    steps = {
        "python -c pass": [PY, "-c", "pass"],
        "start path (gpusnap.shim.main)": [PY, "-c", "import gpusnap.shim.main"],
        "server path (grpc, protos, service)": [
            PY, "-c", "import grpc; from gpusnap.proto import load; load(); import gpusnap.shim.service"],
    }
    return {name: statistics.median(time_cmd(argv) for _ in range(repeat)) for name, argv in steps.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=15, help="timed runs per runtime (default 15)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    a = ap.parse_args()

    c = PrivateContainerd()
    times: dict[str, list[float]] = {r: [] for r in RUNTIMES}
    cold: list[float] = []
    try:
        c.start()
        c.import_demo_image()
        for i in range(a.runs + 1):
            for rt in RUNTIMES:
                t0 = time.perf_counter()
                c.ctr("run", "--rm", "--runtime", rt, DEMO_IMAGE, f"b{i}-{rt.split('.')[2]}", "sh", "-c", ":")
                if i:  # the first round warms caches (page cache, the shim's zygote)
                    times[rt].append(time.perf_counter() - t0)
        # Without the zygote every start imports grpc and the protos afresh.
        c.env["GPUSNAP_SHIM_ZYGOTE"] = "0"
        c.restart()
        for i in range(max(3, a.runs // 2)):
            t0 = time.perf_counter()
            c.ctr("run", "--rm", "--runtime", RUNTIMES[1], DEMO_IMAGE, f"cold{i}", "sh", "-c", ":")
            cold.append(time.perf_counter() - t0)
    finally:
        c.cleanup()
    med = {rt: statistics.median(v) for rt, v in times.items()}
    ratio = med[RUNTIMES[1]] / med[RUNTIMES[0]]
    result = {
        "runs": a.runs,
        "median_s": med,
        "min_s": {rt: min(v) for rt, v in times.items()},
        "ratio": ratio,
        "goal": 1.5,
        "gpusnap_cold_median_s": statistics.median(cold),
        "cold_ratio": statistics.median(cold) / med[RUNTIMES[0]],
        "imports_s": import_costs(),
    }
    if a.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"ctr run --rm IMAGE sh -c :, {a.runs} runs each, interleaved:")
        for rt in RUNTIMES:
            print(f"  {rt:28s} median {med[rt] * 1000:7.1f} ms   min {result['min_s'][rt] * 1000:7.1f} ms")
        print(f"  ratio gpusnap/runc.v2: {ratio:.2f}x (goal <= 1.5x)")
        print(f"  gpusnap without its zygote (GPUSNAP_SHIM_ZYGOTE=0): median "
              f"{result['gpusnap_cold_median_s'] * 1000:.1f} ms, {result['cold_ratio']:.2f}x")
        print("Python start-up on the shim's path (fresh interpreter, median):")
        for name, s in result["imports_s"].items():
            print(f"  {name:38s} {s * 1000:7.1f} ms")
    return 0 if ratio <= 1.5 else 1


if __name__ == "__main__":
    sys.exit(main())
