"""The GPU demo (tests/gpu/demo-gpu.sh): checkpoint -> export -> rm -> restore -> verify."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.gpu import harness

ARCHIVE = Path("/var/tmp/gpusnap-demo-gpu.tar.zst")


def gpusnap(*args: str) -> None:
    subprocess.run(["/usr/local/bin/gpusnap", *args], check=True)


def main() -> int:
    ctr = harness.start(nproc=1, gib=2.0, name="gpusnap-demo-gpu")
    try:
        used = harness.gpu_memory_used()
        print(f"CUDA container {ctr.name}: {used >> 20} MiB in use on GPU 0")
        gpusnap("checkpoint", ctr.name, "--export", str(ARCHIVE))
        print(f"checkpointed: {harness.gpu_memory_used() >> 20} MiB in use on GPU 0")
        gpusnap("inspect", str(ARCHIVE))
        subprocess.run(["podman", "rm", ctr.name], check=True, capture_output=True)
        its = ctr.iterations()
        gpusnap("restore", str(ARCHIVE))
        ctr.wait_running(above=its)
        ctr.verify()
        print(f"restored: {harness.gpu_memory_used() >> 20} MiB in use; all 2 GiB verified")
        return 0
    finally:
        ctr.remove()
        ARCHIVE.unlink(missing_ok=True)


if __name__ == "__main__":
    sys.exit(main())
