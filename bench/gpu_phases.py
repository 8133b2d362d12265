"""Where the time of a GPU container checkpoint goes, phase by phase.

One CUDA container (GIB GiB of GPU memory), with gpusnap installed:

  1. `podman container checkpoint --keep --print-stats` (local: no export)
  2. the same checkpoint directory packed by `tar | zstd -T0 -1` and by
     single-threaded `zstd -3` (what Podman's export costs vs. what it could)
  3. `podman container restore --keep --print-stats` (local)
  4. `podman container checkpoint --export --print-stats`, rm,
     `podman container restore --import --print-stats`
  5. raw disk write speed of the work directory (dd, 2 GiB, fdatasync)

Podman's stats split its own time from the runtime's (runc + CRIU, with the
CRIU action script's GPU quiesce inside); CRIU's own stats split freezing,
memory dump and write. Prints one JSON object and writes it to --out.

    python bench/gpu_phases.py [--gib 2] [--out phases.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.gpu import harness  # noqa: E402


def timed(cmd: list[str] | str, shell: bool = False) -> tuple[float, str]:
    t0 = time.monotonic()
    res = subprocess.run(cmd, capture_output=True, text=True, shell=shell)
    if res.returncode != 0:
        raise RuntimeError(f"{cmd}: {res.stderr.strip()[-800:]}")
    return round(time.monotonic() - t0, 3), res.stdout


def podman_stats(out: str) -> dict:
    """Podman's --print-stats JSON, durations in seconds."""
    data = json.loads(out)
    flat = {k: round(v / 1e6, 3) for k, v in data.items() if k.endswith("_duration")}
    for ctr in data.get("container_statistics") or []:
        for k, v in ctr.items():
            if k.endswith("_duration"):
                flat[k] = round(v / 1e6, 3)
        for k, v in (ctr.get("criu_statistics") or {}).items():
            flat["criu_" + k] = round(v / 1e6, 3) if k.endswith("_time") else v
    return flat


def du(path: Path) -> int:
    return int(subprocess.run(["du", "-sb", str(path)], capture_output=True, text=True).stdout.split()[0])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--out", default="phases.json")
    ap.add_argument("--workdir", default="/var/tmp/gpusnap-bench")
    args = ap.parse_args()
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    report: dict = {"gib": args.gib}
    ctr = harness.start(nproc=1, gib=args.gib)
    try:
        userdata = Path(timed(["podman", "inspect", ctr.name, "--format", "{{.StaticDir}}"])[1].strip())
        s, out = timed(["podman", "container", "checkpoint", "--keep", "--print-stats", ctr.name])
        report["local_checkpoint"] = {"wall_s": s, **podman_stats(out)}
        ckpt = userdata / "checkpoint"
        report["checkpoint_dir_bytes"] = du(ckpt)
        tarball = work / "phases.tar.zst"
        for label, z in (("zstd_T0_1", "zstd -q -T0 -1"), ("zstd_3_single", "zstd -q -3")):
            s, _ = timed(f"tar -C {userdata} -cf - checkpoint | {z} -o {tarball} -f", shell=True)
            report[label] = {"wall_s": s, "bytes": tarball.stat().st_size}
        s, _ = timed(f"zstd -dcq {tarball} | tar -tf - >/dev/null", shell=True)
        report["zstd_read_s"] = s
        tarball.unlink()
        s, out = timed(["podman", "container", "restore", "--keep", "--print-stats", ctr.name])
        report["local_restore"] = {"wall_s": s, **podman_stats(out)}
        ctr.wait_running()
        archive = work / "phases-export.tar.zst"
        s, out = timed(["podman", "container", "checkpoint", "--export", str(archive), "--print-stats",
                        ctr.name])
        report["export_checkpoint"] = {"wall_s": s, "bytes": archive.stat().st_size, **podman_stats(out)}
        timed(["podman", "rm", ctr.name])
        its = ctr.iterations()
        s, out = timed(["podman", "container", "restore", "--import", str(archive), "--print-stats"])
        report["import_restore"] = {"wall_s": s, **podman_stats(out)}
        ctr.wait_running(above=its)
        ctr.verify()
        report["verified"] = True
        archive.unlink()
        s, _ = timed(f"dd if=/dev/zero of={work}/dd.bin bs=16M count=128 conv=fdatasync 2>&1", shell=True)
        report["disk_write_gib_s"] = round(2 / s, 2)
        (work / "dd.bin").unlink()
    finally:
        ctr.remove()
    text = json.dumps(report, indent=2)
    print(text)
    Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
