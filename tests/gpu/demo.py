"""The GPU demo (tests/gpu/demo-gpu.sh): checkpoint -> export -> rm -> restore -> verify."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.gpu import harness

ARCHIVE = Path("/var/tmp/gpusnap-demo-gpu.tar.zst")


def gpusnap(*args: str) -> None:
    subprocess.run(["/usr/local/bin/gpusnap", *args], check=True)


STEPS = 6


def step(n: int, text: str) -> None:
    """One numbered line per step, as packaging/demo.sh prints them."""
    print(f"\n[{n}/{STEPS}] {text}", flush=True)


def main() -> int:
    ctr = harness.start(nproc=1, gib=2.0, name="gpusnap-demo-gpu")
    try:
        used = harness.gpu_memory_used()
        step(1, f"CUDA container {ctr.name}: {used >> 20} MiB in use on GPU 0")
        step(2, f"Checkpoint it (GPU memory included) into an archive; the container stops: "
                f"gpusnap checkpoint {ctr.name} --export {ARCHIVE}")
        gpusnap("checkpoint", ctr.name, "--export", str(ARCHIVE))
        step(3, f"GPU 0 released: {harness.gpu_memory_used() >> 20} MiB in use. "
                f"What the archive holds: gpusnap inspect {ARCHIVE}")
        gpusnap("inspect", str(ARCHIVE))
        step(4, f"Remove the container: podman rm {ctr.name}")
        subprocess.run(["podman", "rm", ctr.name], check=True, capture_output=True)
        its = ctr.iterations()
        step(5, f"Restore it from the archive: gpusnap restore {ARCHIVE}")
        gpusnap("restore", str(ARCHIVE))
        ctr.wait_running(above=its)
        ctr.verify()
        step(6, f"Restored: {harness.gpu_memory_used() >> 20} MiB in use on the GPU; "
                "all 2 GiB of its tensor verified")
        return 0
    finally:
        ctr.remove()
        ARCHIVE.unlink(missing_ok=True)


if __name__ == "__main__":
    sys.exit(main())
