"""Checkpoint migration through a registry: gpusnap against ORAS, same run
(`make bench-registry`; root, after `make install` and `make demo-image`).

    /opt/gpusnap/venv/bin/python bench/registry_bench.py [--gib N] [--out FILE.json]

A demo container holds N GiB in /dev/shm (3/4 random, 1/4 zeros: memory that
does not compress, and untouched pages). Against one loopback docker-registry
(TLS, htpasswd), each pipeline moves that container's checkpoint from the
container to an archive `podman container restore --import` takes:

  plain    podman container checkpoint --export F --leave-running; oras push F;
           oras pull
  oras     oras push / oras pull of gpusnap's own export of the container
           (the same archive gpusnap pushes below, so the transfer is compared
           on equal bytes)
  gpusnap  gpusnap push CTR REF --leave-running (checkpoint + push);
           gpusnap pull REF -o F.tar.zst --no-cache (no chunk cache: ORAS has none)

Every push goes to a new repository and every gpusnap run gets an empty chunk
cache, so nothing is deduplicated against an earlier phase. The registry
shares the host's cores: the CPU seconds of both are printed. The last line is
`speedup X.XX`: plain end to end (export + push + pull) over gpusnap's (push +
pull). Default size: 4 GiB on hosts with 8 cores or more, else 1 GiB.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.integration.oci_registry import (PASSWORD, USER, Registry, make_registry,  # noqa: E402
                                            permissive_policy)

IMAGE = "localhost/gpusnap-demo:latest"
GPUSNAP = "/usr/local/bin/gpusnap"
MEDIA = "application/vnd.gpusnap.bench.archive.v1+zstd"


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Phase:
    """One timed command: wall seconds, and CPU seconds of it and of the registry."""

    def __init__(self, what: str, cmd: list[str], reg: Registry, stdin: str = "",
                 cwd: Path | None = None, env: dict | None = None) -> None:
        before_reg = cpu_seconds(reg.proc.pid)
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.monotonic()
        res = subprocess.run(cmd, input=stdin, capture_output=True, text=True, cwd=cwd, env=env)
        self.seconds = time.monotonic() - start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if res.returncode != 0:
            raise SystemExit(f"{what}: {' '.join(cmd)} failed:\n{res.stdout}{res.stderr}")
        self.what = what
        self.cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
        self.registry_cpu = cpu_seconds(reg.proc.pid) - before_reg
        self.stdout = res.stdout
        self.sent = 0

    def json(self) -> dict:
        return json.loads(self.stdout)

    def line(self, size: int, sent: int | None = None) -> dict:
        self.sent = size if sent is None else sent
        mb_s = size / self.seconds / 1e6
        print(f"  {self.what:<44} {self.seconds:7.2f} s {mb_s:6.0f} MB/s  "
              f"moved {self.sent / 2**20:7.0f} MiB  CPU {self.cpu:5.1f} s + registry "
              f"{self.registry_cpu:5.1f} s", flush=True)
        return {"phase": self.what, "seconds": round(self.seconds, 3), "bytes": self.sent,
                "cpu_s": round(self.cpu, 2), "registry_cpu_s": round(self.registry_cpu, 2)}


def start_container(gib: float) -> str:
    name = f"gpusnap-regbench-{uuid.uuid4().hex[:6]}"
    mib = int(gib * 1024)
    rnd, zero = mib * 3 // 4, mib - mib * 3 // 4
    fill = (f"dd if=/dev/urandom of=/dev/shm/r bs=1M count={rnd} 2>/dev/null; "
            f"dd if=/dev/zero of=/dev/shm/z bs=1M count={zero} 2>/dev/null; "
            "touch /dev/shm/done; while true; do sleep 1; done")
    subprocess.run(["podman", "run", "-d", "--name", name, "--network", "none",
                    "--shm-size", f"{mib + 64}m", IMAGE, "sh", "-c", fill],
                   capture_output=True, check=True)
    deadline = time.monotonic() + 600
    while subprocess.run(["podman", "exec", name, "ls", "/dev/shm/done"],
                         capture_output=True).returncode != 0:
        if time.monotonic() > deadline:
            raise SystemExit("the benchmark container did not fill its memory")
        time.sleep(0.5)
    return name


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=4 if (os.cpu_count() or 1) >= 8 else 1)
    ap.add_argument("--out", help="also write the figures as JSON here")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="gpusnap-regbench-", dir="/var/tmp"))
    # unsigned pushes: the pulls take them (trust costs are bench/trust_bench.py's)
    os.environ["GPUSNAP_POLICY"] = str(permissive_policy(work))
    reg = make_registry(work / "registry")
    gflags = ["--ca-file", str(reg.ca), "--username", USER, "--password-stdin"]
    oflags = ["--ca-file", str(reg.ca), "--username", USER, "--password-stdin"]
    name = ""
    caches = iter(range(100))

    def gpusnap_env() -> dict:
        return {**os.environ, "GPUSNAP_CACHE_DIR": str(work / f"cache-{next(caches)}")}

    def ref(what: str) -> str:
        return reg.ref(f"bench/{what}-{uuid.uuid4().hex[:6]}:v1")

    try:
        name = start_container(args.gib)
        print(f"registry bench: {args.gib:g} GiB container memory, {os.cpu_count()} cores, "
              f"docker-registry on loopback (TLS, htpasswd)", flush=True)
        rows = []

        print("plain: podman container checkpoint --export + oras push / oras pull")
        plain_archive = work / "plain.tar.zst"
        p_export = Phase("podman checkpoint --export (zstd, Podman)",
                         ["podman", "container", "checkpoint", "--leave-running", "--export",
                          str(plain_archive), name], reg)
        plain_size = plain_archive.stat().st_size
        rows.append(p_export.line(plain_size, 0))
        r = ref("plain")
        p_push = Phase("oras push of Podman's archive", ["oras", "push", *oflags, r,
                       f"{plain_archive.name}:{MEDIA}"], reg, PASSWORD + "\n", cwd=work)
        rows.append(p_push.line(plain_size))
        (work / "plain-out").mkdir()
        p_pull = Phase("oras pull of Podman's archive", ["oras", "pull", *oflags, "-o",
                       str(work / "plain-out"), r], reg, PASSWORD + "\n")
        rows.append(p_pull.line(plain_size))
        plain_archive.unlink()

        print("oras: oras push / oras pull of gpusnap's export (the same bytes as below)")
        archive = work / "gpusnap.tar.zst"
        g_export = Phase("gpusnap checkpoint --export (zstd -T0)",
                         [GPUSNAP, "checkpoint", name, "--leave-running", "--export",
                          str(archive)], reg)
        size = archive.stat().st_size
        rows.append(g_export.line(size, 0))
        r = ref("oras")
        o_push = Phase("oras push", ["oras", "push", *oflags, r, f"{archive.name}:{MEDIA}"],
                       reg, PASSWORD + "\n", cwd=work)
        rows.append(o_push.line(size))
        (work / "oras-out").mkdir()
        o_pull = Phase("oras pull", ["oras", "pull", *oflags, "-o", str(work / "oras-out"), r],
                       reg, PASSWORD + "\n")
        rows.append(o_pull.line(size))
        r = ref("archive")
        a_push = Phase("gpusnap push of that archive", [GPUSNAP, "push", str(archive), r,
                       *gflags, "--json"], reg, PASSWORD + "\n", env=gpusnap_env())
        pushed = a_push.json()
        rows.append(a_push.line(size, pushed["bytes_sent"]))
        a_pull = Phase("gpusnap pull of that archive (.tar.zst)",
                       [GPUSNAP, "pull", r, "-o", str(work / "a.tar.zst"), "--no-cache",
                        *gflags, "--json"], reg, PASSWORD + "\n", env=gpusnap_env())
        rows.append(a_pull.line(size, a_pull.json()["bytes_fetched"]))
        for p in (archive, work / "a.tar.zst"):
            p.unlink()
        subprocess.run(["rm", "-rf", str(work / "oras-out"), str(work / "plain-out")])

        print("gpusnap: gpusnap push CTR (checkpoint + push) / gpusnap pull")
        r = ref("gpusnap")
        push_env = gpusnap_env()
        g_push = Phase("gpusnap push CTR --leave-running", [GPUSNAP, "push", name, r,
                       "--leave-running", *gflags, "--json"], reg, PASSWORD + "\n",
                       env=push_env)
        pushed = g_push.json()
        rows.append(g_push.line(pushed["bytes"], pushed["bytes_sent"]))
        g_pull = Phase("gpusnap pull -o .tar.zst --no-cache",
                       [GPUSNAP, "pull", r, "-o", str(work / "g.tar.zst"), "--no-cache",
                        *gflags, "--json"], reg, PASSWORD + "\n", env=gpusnap_env())
        rows.append(g_pull.line(pushed["bytes"], g_pull.json()["bytes_fetched"]))
        # Same repository, new tag, the push's chunk cache kept: what a second
        # migration of a container whose memory did not change costs.
        again = Phase("gpusnap re-push CTR, memory unchanged", [GPUSNAP, "push", name,
                      r.replace(":v1", ":v2"), "--leave-running", *gflags, "--json"], reg,
                      PASSWORD + "\n", env=push_env)
        rows.append(again.line(pushed["bytes"], again.json()["bytes_sent"]))

        plain = p_export.seconds + p_push.seconds + p_pull.seconds
        oras = g_export.seconds + o_push.seconds + o_pull.seconds
        ours = g_push.seconds + g_pull.seconds
        print("end to end, container -> registry -> importable archive:")
        print(f"  plain (podman export + oras push + oras pull)   {plain:7.2f} s, "
              f"{plain_size / 2**20:.0f} MiB moved")
        print(f"  gpusnap export + oras push + oras pull         {oras:7.2f} s, "
              f"{size / 2**20:.0f} MiB moved")
        print(f"  gpusnap push + gpusnap pull                     {ours:7.2f} s, "
              f"{pushed['bytes_sent'] / 2**20:.0f} MiB moved")
        print(f"  transfer alone, same archive: push oras/gpusnap "
              f"{o_push.seconds / a_push.seconds:.2f}x, pull oras/gpusnap "
              f"{o_pull.seconds / a_pull.seconds:.2f}x")
        print(f"  vs gpusnap export + oras: {oras / ours:.2f}x")
        if args.out:
            Path(args.out).write_text(json.dumps({
                "gib": args.gib, "cores": os.cpu_count(), "phases": rows,
                "plain_s": round(plain, 3), "gpusnap_export_oras_s": round(oras, 3),
                "gpusnap_s": round(ours, 3), "speedup": round(plain / ours, 3)}, indent=2))
        print(f"speedup {plain / ours:.2f}")
    finally:
        if name:
            subprocess.run(["podman", "rm", "-f", "-t", "0", name], capture_output=True)
        reg.stop()
        subprocess.run(["rm", "-rf", str(work)])


if __name__ == "__main__":
    main()
