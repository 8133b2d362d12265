"""GPU checkpoint benchmark: gpusnap against the plain serial pipeline, same run.

For 1 and 2 CUDA processes (GIB GiB of GPU memory each) in one container:

  gpusnap  `gpusnap checkpoint --export` / `gpusnap restore`: parallel quiesce
           in CRIU's pre-dump, Podman's archive through multi-threaded zstd
  plain    what a user scripts today: driver lock + checkpoint of each process
           in turn (as a `cuda-checkpoint --toggle` loop does), then
           `podman container checkpoint --export` with plain CRIU; on restore,
           `podman container restore --import`, then driver restore + unlock of
           each process in turn.

Measured: time to "GPU free" (NVML shows the memory released), to "image
complete" (the export written), and restore until every process runs on the
GPU again. Prints a table and the plain/gpusnap ratios.

    python bench/gpu_checkpoint.py [--gib 2] [--procs 1,2] [--out bench.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpusnap.gpu.cuda import CudaDriver, ProcessState  # noqa: E402
from tests.gpu import harness  # noqa: E402

CRIU_CONF = Path("/etc/criu/runc.conf")


class MemoryWatch:
    """Polls NVML until GPU memory falls to ``below``; records when."""

    def __init__(self, below: int) -> None:
        self.below, self.when, self._stop = below, None, False
        self.t0 = time.monotonic()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop and self.when is None:
            if harness.gpu_memory_used() <= self.below:
                self.when = time.monotonic() - self.t0
            time.sleep(0.02)

    def stop(self) -> float | None:
        self._stop = True
        self._thread.join()
        return self.when


def podman(*args: str) -> None:
    res = subprocess.run(["podman", *args], capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"podman {' '.join(args)}: {res.stderr.strip()[-500:]}")


def gpusnap(*args: str) -> None:
    res = subprocess.run(["/usr/local/bin/gpusnap", *args], capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"gpusnap {' '.join(args)}: {res.stderr.strip()[-500:]}")


def wait_all_running(driver: CudaDriver, name: str, nproc: int) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        pids = harness.host_pids(name)
        if len(pids) == nproc and all(driver.state(p) == ProcessState.RUNNING for p in pids):
            return
        time.sleep(0.01)
    raise RuntimeError("processes did not come back")


def one(variant: str, nproc: int, gib: float, driver: CudaDriver, workdir: Path) -> dict:
    baseline = harness.gpu_memory_used()
    ctr = harness.start(nproc=nproc, gib=gib)
    archive = workdir / f"{variant}-{nproc}.tar.zst"
    saved_conf = CRIU_CONF.read_text()
    try:
        watch = MemoryWatch(baseline + (256 << 20))
        if variant == "plain":
            for pid in harness.host_pids(ctr.name):  # one after the other
                driver.lock(pid, 0)
                driver.checkpoint(pid)
            CRIU_CONF.write_text("")  # CRIU without gpusnap
            podman("container", "checkpoint", "--export", str(archive), ctr.name)
        else:
            gpusnap("checkpoint", ctr.name, "--export", str(archive))
        image_s = time.monotonic() - watch.t0
        gpu_free_s = watch.stop()
        podman("rm", ctr.name)
        its = ctr.iterations()
        t0 = time.monotonic()
        if variant == "plain":
            podman("container", "restore", "--import", str(archive))
            pids = harness.host_pids(ctr.name)
            for pid in pids:
                driver.restore(pid)
            for pid in pids:
                driver.unlock(pid)
        else:
            gpusnap("restore", str(archive))
        wait_all_running(driver, ctr.name, nproc)
        restore_s = time.monotonic() - t0
        ctr.wait_running(above=its)
        ctr.verify()
        return {"variant": variant, "processes": nproc, "gpu_gib": nproc * gib,
                "gpu_free_s": round(gpu_free_s or image_s, 3), "image_complete_s": round(image_s, 3),
                "restore_s": round(restore_s, 3), "total_s": round(image_s + restore_s, 3),
                "archive_bytes": archive.stat().st_size}
    finally:
        CRIU_CONF.write_text(saved_conf)
        ctr.remove()
        archive.unlink(missing_ok=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=2.0, help="GPU memory per process")
    ap.add_argument("--procs", default="1,2", help="CUDA processes per container, e.g. 1,2")
    ap.add_argument("--out", default="bench-gpu.json")
    ap.add_argument("--workdir", default="/var/tmp/gpusnap-bench")
    args = ap.parse_args()
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    driver = CudaDriver()
    rows = []
    procs = [int(n) for n in args.procs.split(",")]
    for nproc in procs:
        for variant in ("plain", "gpusnap"):
            row = one(variant, nproc, args.gib, driver, workdir)
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"\n{'variant':<8} {'procs':>5} {'GiB':>5} {'GPU free s':>10} {'image s':>8} {'restore s':>9} {'total s':>8}")
    for r in rows:
        print(f"{r['variant']:<8} {r['processes']:>5} {r['gpu_gib']:>5.0f} {r['gpu_free_s']:>10.2f} "
              f"{r['image_complete_s']:>8.2f} {r['restore_s']:>9.2f} {r['total_s']:>8.2f}")
    ratios = {}
    for nproc in procs:
        p, g = [next(r for r in rows if r["variant"] == v and r["processes"] == nproc)
                for v in ("plain", "gpusnap")]
        ratios[nproc] = {k: round(p[k] / g[k], 2) for k in ("gpu_free_s", "image_complete_s", "restore_s", "total_s")}
        print(f"ratio plain/gpusnap, {nproc} process(es): " +
              ", ".join(f"{k} {v:.2f}x" for k, v in ratios[nproc].items()))
    Path(args.out).write_text(json.dumps({"gib_per_process": args.gib, "rows": rows,
                                          "ratios": ratios, "host": os.uname().nodename,
                                          "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
                                         indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
