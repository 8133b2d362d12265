"""End-to-end migration through a registry: the plain pipeline against gpusnap,
same machine, same run, same container (`make bench-migrate`; root, after
`make install` and `make demo-image`).

    /opt/gpusnap/venv/bin/python bench/migrate.py [--gib 0.75] [--out bench-migrate.json]
    /opt/gpusnap/venv/bin/python bench/migrate.py --gpu 8,16   # GPU machine, see below

A demo container holds GIB GiB in /dev/shm (half random, half a repeated
pattern, as bench/checkpoint_bench.py means to fill it: busybox's `head -c`
takes `512m`, not `512M`) and counts into a host file
(a bind mount) every 50 ms. It is migrated through a loopback docker-registry
(plain HTTP), source and target being this host:

  plain    podman container checkpoint --export F (Podman's zstd);
           oras push REF F; oras pull REF; podman rm; podman container restore --import F
  gpusnap  gpusnap migrate CTR REF --json; podman rm; gpusnap restore REF --json

then, after 1% of its memory changed, migrated again by both to a new tag of
the same repository: gpusnap sends and fetches only the changed chunks (the
target keeps its chunk cache), ORAS sends the whole archive again.

Per phase seconds (dump+compress, upload, download, restore; `podman rm`
apart), downtime (the largest gap between counter writes seen by a 10 ms
poller: last write on the source to first write after restore), bytes moved,
each tool's peak RSS (ru_maxrss from wait4: the largest process of its tree)
and the ratios. The last line is `speedup X.XX`: plain end-to-end seconds of
the first migration over gpusnap's, each pipeline's fastest of --rounds (2)
first migrations, run alternately: this VM shares its host, and one run's
phases vary by 2x from one minute to the next.

GPU variant (--gpu GIB[,GIB...], a CUDA container per size from
tests/gpu/harness.py, one process on GPU 0): the plain pipeline adds the
driver's lock + checkpoint before the export and restore + unlock after the
import (CRIU without gpusnap's action script, as bench/gpu_checkpoint.py); the
floor is the driver's own checkpoint + restore time of the gpusnap run, from
the journal's `quiesced`/`resumed` events; printed: gpusnap total / floor.
No second (1%) migration there: the workload's GPU memory is not changed.
Each size and pipeline gets its own registry, removed afterwards: the GPU
checkpoint is as large as the GPU memory, and it exists up to three times at
once (staged export, registry, pulled tar), so `--workdir` needs ~3x the
largest size free (64 GiB disks: up to 16 GiB). The GPU machine also needs
`docker-registry`, `oras` and the `requests`/`zstandard` Python packages,
which the .gpu-bundle does not carry yet. On it, after tests/gpu/prepare.sh:

    /opt/gpusnap/venv/bin/python bench/migrate.py --gpu 8,16 --out LOGDIR/bench-migrate-gpu.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.faults.netreg import PlainRegistry, make_registry  # noqa: E402
from tests.integration.oci_registry import permissive_policy  # noqa: E402

IMAGE = "localhost/gpusnap-demo:latest"
GPUSNAP = "/usr/local/bin/gpusnap"
GPUSNAP_PYTHON = "/opt/gpusnap/venv/bin/python"  # made by `make install`, tests/gpu/prepare.sh
MEDIA = "application/vnd.gpusnap.bench.archive.v1+zstd"
JOURNAL = Path(os.environ.get("GPUSNAP_STATE_DIR", "/run/gpusnap")) / "journal.jsonl"
CRIU_CONF = Path("/etc/criu/runc.conf")


def need_gpusnap_python() -> None:
    """Stop at once, in one line, where this Python cannot import what gpusnap
    imports mid-case (a GPU host's `python3` is its PyTorch venv: no
    cryptography, so a 32 GiB case failed after five minutes of work)."""
    missing = [m for m in ("cryptography", "zstandard") if importlib.util.find_spec(m) is None]
    if missing:
        sys.exit(f"this Python ({sys.executable}) lacks {', '.join(missing)}: "
                 f"run the bench with {GPUSNAP_PYTHON}")


@dataclass
class Run:
    seconds: float
    maxrss_kib: int
    stdout: str


def timed(cmd: list[str], cwd: Path | None = None, env: dict | None = None) -> Run:
    """Run ``cmd``; its wall seconds and, from wait4, the peak RSS of its process tree's
    largest member (children it waited for included)."""
    out = tempfile.TemporaryFile()
    err = tempfile.TemporaryFile()
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=out, stderr=err, cwd=cwd, env=env)
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.monotonic() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    out.seek(0)
    err.seek(0)
    stdout, stderr = out.read().decode(errors="replace"), err.read().decode(errors="replace")
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{stdout[-2000:]}{stderr[-2000:]}")
    return Run(seconds, usage.ru_maxrss, stdout)


class Beat:
    """Polls a file the workload rewrites; keeps the times its content changed."""

    def __init__(self, path: Path, every: float = 0.01) -> None:
        self.path, self.every = path, every
        self.changes: list[float] = []
        self._last: bytes | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                data = self.path.read_bytes()
            except OSError:
                data = None
            if data and data != self._last:
                self._last = data
                self.changes.append(time.monotonic())
            time.sleep(self.every)

    def wait_beat(self, after: float, timeout: float = 120) -> float:
        """The first change after ``after`` (the workload runs again)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            later = [t for t in self.changes if t > after]
            if later:
                return later[0]
            time.sleep(self.every)
        raise SystemExit(f"{self.path}: the workload did not run again within {timeout} s")

    def downtime(self, start: float, end: float) -> float:
        """The largest gap between changes from the last one before ``start`` to the
        first after ``end``: the app may run on for a moment after the migration
        starts (until CRIU freezes it), and comes back before the command returns."""
        seen = [t for t in self.changes if t <= start][-1:] + \
            [t for t in self.changes if start < t <= end] + \
            [t for t in self.changes if t > end][:1]
        return max(b - a for a, b in zip(seen, seen[1:]))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


class _Phases(dict):
    """Each phase printed as it ends: a run cut short by a time limit still tells."""

    def __init__(self, who: str) -> None:
        super().__init__()
        self.who = who

    def __setitem__(self, phase: str, seconds: float) -> None:
        super().__setitem__(phase, seconds)
        print(f"  {self.who}: {phase} {seconds:.2f} s", flush=True)


@dataclass
class Migration:
    pipeline: str
    label: str
    phases: dict[str, float] = field(default_factory=dict)
    rss_kib: dict[str, int] = field(default_factory=dict)
    bytes_up: int = 0
    bytes_down: int = 0
    archive_bytes: int | None = None
    downtime_s: float = 0.0
    driver: dict[str, float] = field(default_factory=dict)
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.phases = _Phases(f"{self.pipeline}, {self.label}")

    @property
    def total(self) -> float:
        return sum(self.phases.values())

    def row(self) -> dict:
        return {"pipeline": self.pipeline, "migration": self.label,
                "phases_s": {k: round(v, 3) for k, v in self.phases.items()},
                "total_s": round(self.total, 3), "downtime_s": round(self.downtime_s, 3),
                "bytes_up": self.bytes_up, "bytes_down": self.bytes_down,
                "archive_bytes": self.archive_bytes, "peak_rss_kib": self.rss_kib,
                "driver_s": self.driver, **self.extra}


def journal_events(since: int, container_id: str | None = None) -> list[dict]:
    """Journal lines appended after byte ``since`` (for ``container_id`` where they name one)."""
    try:
        with open(JOURNAL, "rb") as f:
            f.seek(since)
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return []
    events = []
    for line in lines:
        try:
            e = json.loads(line)
        except ValueError:
            continue
        if container_id is None or e.get("container") in (None, container_id):
            events.append(e)
    return events


def journal_size() -> int:
    try:
        return JOURNAL.stat().st_size
    except OSError:
        return 0


def container_id(name: str) -> str:
    return subprocess.run(["podman", "inspect", name, "--format", "{{.Id}}"], capture_output=True,
                          text=True, check=True).stdout.strip()


# -- the workload -------------------------------------------------------------------


class Workload:
    """A container to migrate: ``beat`` changes while it runs."""
    name: str
    beat: Beat

    def change_one_percent(self) -> None: ...
    def check_after_restore(self) -> None: ...
    def remove(self) -> None: ...


class CpuWorkload(Workload):
    def __init__(self, gib: float, work: Path) -> None:
        self.name = f"gpusnap-migbench-{uuid.uuid4().hex[:6]}"
        self.status = work / "status"
        self.status.mkdir()
        self.half = max(1, int(gib * 512))
        script = (f"dd if=/dev/urandom of=/dev/shm/r bs=1M count={self.half} 2>/dev/null; "
                  f"yes gpusnap | head -c {self.half}m > /dev/shm/p; "  # busybox: m, not M
                  "i=0; while true; do i=$((i+1)); echo $i > /status/c.new; "
                  "mv /status/c.new /status/c; sleep 0.05; done")
        subprocess.run(["podman", "run", "-d", "--name", self.name, "--network", "none",
                        "--shm-size", f"{int(gib * 1024) + 64}m", "-v", f"{self.status}:/status",
                        IMAGE, "sh", "-c", script], capture_output=True, check=True)
        self.beat = Beat(self.status / "c")
        self.beat.wait_beat(time.monotonic(), timeout=600)
        self.counter = self.count()

    def count(self) -> int:
        return int((self.status / "c").read_text().strip() or 0)

    def change_one_percent(self) -> None:
        """1% of the memory rewritten with new random bytes, in the middle of /dev/shm/r."""
        mib = max(1, self.half * 2 // 100)
        subprocess.run(["podman", "exec", self.name, "dd", "if=/dev/urandom", "of=/dev/shm/r",
                        "bs=1M", f"count={mib}", f"seek={self.half // 2}", "conv=notrunc"],
                       capture_output=True, check=True)

    def check_after_restore(self) -> None:
        now = self.count()
        if now < self.counter:
            raise SystemExit(f"the counter went back ({self.counter} -> {now}): state was lost")
        self.counter = now

    def remove(self) -> None:
        self.beat.stop()
        subprocess.run(["podman", "rm", "-f", "-t", "0", self.name], capture_output=True)


class GpuWorkload(Workload):
    def __init__(self, gib: float) -> None:
        from tests.gpu import harness

        self.harness = harness
        self.ctr = harness.start(nproc=1, gib=gib)
        self.name = self.ctr.name
        self.beat = Beat(self.ctr.status / "w0", every=0.01)
        self.beat.wait_beat(time.monotonic())
        self.its = self.ctr.iterations()

    def check_after_restore(self) -> None:
        self.its = self.ctr.wait_running(above=self.its)
        self.ctr.verify()

    def remove(self) -> None:
        self.beat.stop()
        self.ctr.remove()


# -- the two pipelines ---------------------------------------------------------------


def plain(w: Workload, reg: PlainRegistry, ref: str, work: Path, label: str,
          gpu_driver=None) -> Migration:
    m = Migration("plain", label)
    archive = work / "plain.tar.zst"
    saved_conf = CRIU_CONF.read_text() if gpu_driver and CRIU_CONF.exists() else None
    start = time.monotonic()
    try:
        if gpu_driver:  # what a script around cuda-checkpoint does: one process after the other
            t = time.monotonic()
            for pid in w.harness.host_pids(w.name):
                gpu_driver.lock(pid, 0)
                gpu_driver.checkpoint(pid)
            m.phases["gpu quiesce"] = m.driver["checkpoint"] = time.monotonic() - t
            CRIU_CONF.write_text("")  # CRIU without gpusnap's action script
        r = timed(["podman", "container", "checkpoint", "--export", str(archive), w.name])
        m.phases["dump+compress"], m.rss_kib["podman checkpoint"] = r.seconds, r.maxrss_kib
        m.archive_bytes = m.bytes_up = m.bytes_down = archive.stat().st_size
        r = timed(["oras", "push", "--plain-http", ref, f"{archive.name}:{MEDIA}"], cwd=work)
        m.phases["upload"], m.rss_kib["oras push"] = r.seconds, r.maxrss_kib
        archive.unlink()  # the target host has only what it pulls
        out = work / "plain-pulled"
        out.mkdir()
        r = timed(["oras", "pull", "--plain-http", "-o", str(out), ref])
        m.phases["download"], m.rss_kib["oras pull"] = r.seconds, r.maxrss_kib
        r = timed(["podman", "rm", w.name])
        m.phases["rm"] = r.seconds
        r = timed(["podman", "container", "restore", "--import", str(out / archive.name)])
        m.phases["restore"], m.rss_kib["podman restore"] = r.seconds, r.maxrss_kib
        if gpu_driver:
            t = time.monotonic()
            pids = w.harness.host_pids(w.name)
            for pid in pids:
                gpu_driver.restore(pid)
            for pid in pids:
                gpu_driver.unlock(pid)
            m.phases["gpu resume"] = m.driver["restore"] = time.monotonic() - t
    finally:
        if saved_conf is not None:
            CRIU_CONF.write_text(saved_conf)
        shutil.rmtree(work / "plain-pulled", ignore_errors=True)
        archive.unlink(missing_ok=True)
    end = time.monotonic()
    w.beat.wait_beat(end)
    m.downtime_s = w.beat.downtime(start, end)
    w.check_after_restore()
    return m


def ours(w: Workload, reg: PlainRegistry, ref: str, cache: Path, label: str,
         m: Migration | None = None, source: dict | None = None) -> Migration:
    """``source``: the source host's environment, when it keeps a cache of its own."""
    m = m or Migration("gpusnap", label)
    env = {**os.environ, "GPUSNAP_CACHE_DIR": str(cache)}  # the target host's chunk cache
    cid = container_id(w.name)
    mark = journal_size()
    start = time.monotonic()
    r = timed([GPUSNAP, "migrate", w.name, ref, "--plain-http", "--json"], env=source or env)
    pushed = json.loads(r.stdout)
    events = journal_events(mark, cid)
    dump = next((e["seconds"] for e in events if e.get("event") == "checkpointed"), None)
    if dump is None:
        raise SystemExit("the journal has no `checkpointed` event for the migration")
    m.phases["dump+compress"] = dump
    m.phases["upload"] = r.seconds - dump
    m.rss_kib["gpusnap migrate"] = r.maxrss_kib
    m.bytes_up, m.extra["checkpoint_bytes"] = pushed["bytes_sent"], pushed["bytes"]
    m.extra["chunks"], m.extra["chunks_sent"] = pushed["chunks"], pushed["chunks_sent"]
    m.phases["rm"] = timed(["podman", "rm", w.name]).seconds
    restore_ref(m, pushed["pinned"], env, events)
    end = time.monotonic()
    w.beat.wait_beat(end)
    m.downtime_s = w.beat.downtime(start, end)
    w.check_after_restore()
    return m


def with_precopy(w: Workload, reg: PlainRegistry, repo: str, work: Path, label: str
                 ) -> Migration:
    """`gpusnap migrate -P` (round 1, the workload runs on), `gpusnap pull
    --prefetch` into the target's cache, then `ours` to the final tag. The
    downtime counts from the final round; round 1 and the prefetch are in the total."""
    m = Migration("pre-copy", label)
    source = {**os.environ, "GPUSNAP_CACHE_DIR": str(work / f"{repo.replace('/', '-')}-source")}
    target = work / f"{repo.replace('/', '-')}-target"
    r = timed([GPUSNAP, "migrate", "-P", w.name, reg.ref(f"{repo}:pre"), "--plain-http",
               "--json"], env=source)
    first = json.loads(r.stdout)
    m.phases["round 1"], m.extra["round1_bytes_sent"] = r.seconds, first["bytes_sent"]
    r = timed([GPUSNAP, "pull", "--prefetch", first["pinned"], "--plain-http", "--json"],
              env={**os.environ, "GPUSNAP_CACHE_DIR": str(target)})
    m.phases["prefetch"] = r.seconds
    return ours(w, reg, reg.ref(f"{repo}:final"), target, label, m=m, source=source)


def restore_ref(m: Migration, pinned: str, env: dict, push_events: list[dict]) -> dict:
    """`gpusnap restore REF`: its download and restore phases, RSS and bytes
    into ``m``, and the driver's own checkpoint + restore time (the floor)
    from the journal events of the push and of this restore."""
    mark = journal_size()
    r = timed([GPUSNAP, "restore", pinned, "--plain-http", "--json"], env=env)
    restored = json.loads(r.stdout)
    m.phases["download"] = restored["pull"]["seconds"]
    m.phases["restore"] = r.seconds - restored["pull"]["seconds"]
    m.rss_kib["gpusnap restore"] = r.maxrss_kib
    m.bytes_down = restored["pull"]["bytes_fetched"]
    m.extra["bytes_from_cache"] = restored["pull"]["bytes_from_cache"]
    m.extra["pages_prepared"] = restored["pull"].get("pages_prepared")  # pages/prepared_pages.py
    events = journal_events(mark)
    m.extra["pages_filled"] = next(({k: e.get(k) for k in ("bytes", "seconds", "threads")}
                                    for e in events if e.get("event") == "pages-filled"), None)
    driver_floor(m, events + push_events)
    return restored


def driver_floor(m: Migration, events: list[dict]) -> None:
    for e in events:
        if e.get("event") == "quiesced" and e.get("timing"):
            m.driver["checkpoint"] = round(sum(e["timing"].values()), 3)
        if e.get("event") == "resumed" and e.get("timing"):
            m.driver["restore"] = round(sum(e["timing"].values()), 3)


# -- report -----------------------------------------------------------------------------


def mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f}"


def report(rows: list[Migration]) -> None:
    phases = ["gpu quiesce", "dump+compress", "upload", "download", "rm", "restore", "gpu resume"]
    shown = [p for p in phases if any(p in m.phases for m in rows)]
    head = f"{'pipeline':<8} {'migration':<20}" + "".join(f"{p:>14}" for p in shown)
    print("\n" + head + f"{'total':>9}{'downtime':>10}{'up MiB':>9}{'down MiB':>10}")
    for m in rows:
        print(f"{m.pipeline:<8} {m.label:<20}" +
              "".join(f"{m.phases[p]:>14.2f}" if p in m.phases else f"{'-':>14}" for p in shown) +
              f"{m.total:>9.2f}{m.downtime_s:>10.2f}{mib(m.bytes_up):>9}{mib(m.bytes_down):>10}")
    print("peak RSS (MiB): " + "; ".join(
        f"{m.pipeline} {m.label}: " + ", ".join(f"{k} {v / 1024:.0f}" for k, v in m.rss_kib.items())
        for m in rows))


def pair_ratios(p: Migration, g: Migration) -> dict:
    return {"total": round(p.total / g.total, 2), "downtime": round(p.downtime_s / g.downtime_s, 2),
            "bytes_up": round(p.bytes_up / max(g.bytes_up, 1), 2),
            "bytes_down": round(p.bytes_down / max(g.bytes_down, 1), 2)}


def run_cpu(args, work: Path, reg: PlainRegistry) -> tuple[list[Migration], float]:
    """The first migration ``--rounds`` times per pipeline, alternating (each
    gpusnap round into a new repository with an empty target cache: a first
    migration every time); the speedup compares each pipeline's fastest round,
    the usual reading on a shared, noisy host. Then the 1% change, once."""
    w = CpuWorkload(args.gib, work)
    rows: list[Migration] = []

    def both(repo: str, tag: str, cache: Path, label: str) -> None:
        for m in (plain(w, reg, reg.ref(f"{repo}-plain:{tag}"), work, label),
                  ours(w, reg, reg.ref(f"{repo}:{tag}"), cache, label)):
            rows.append(m)
            print(json.dumps(m.row()), flush=True)
    try:
        print(f"migrate bench: {args.gib:g} GiB container memory, {os.cpu_count()} cores, "
              f"docker-registry on loopback (plain HTTP), {args.rounds} round(s)", flush=True)
        base = f"bench/migrate-{uuid.uuid4().hex[:6]}"
        for r in range(args.rounds):
            repo, cache = f"{base}-{r}", work / f"target-chunk-cache-{r}"
            both(repo, "v1", cache, "first" if args.rounds == 1 else f"first, round {r + 1}")
        w.change_one_percent()
        both(repo, "v2", cache, "after 1% change")
        pre = with_precopy(w, reg, f"{base}-precopy", work, "first, pre-copy")
        print(json.dumps(pre.row()), flush=True)
    finally:
        w.remove()
    report(rows + [pre])
    labels = sorted({m.label for m in rows}, key=[m.label for m in rows].index)
    for label in labels:
        p, g = [m for m in rows if m.label == label]
        print(f"plain / gpusnap, {label}: " +
              ", ".join(f"{k} {v:.2f}x" for k, v in pair_ratios(p, g).items()))
    firsts = [m for m in rows if m.label.startswith("first")]
    best_plain = min(m.total for m in firsts if m.pipeline == "plain")
    best_ours = min(m.total for m in firsts if m.pipeline == "gpusnap")
    if args.rounds > 1:
        print(f"first migration, fastest of {args.rounds}: plain {best_plain:.2f} s, "
              f"gpusnap {best_ours:.2f} s")
    without = min(m.downtime_s for m in firsts if m.pipeline == "gpusnap")
    print(f"downtime of a first migration: gpusnap {without:.2f} s, with pre-copy "
          f"{pre.downtime_s:.2f} s (round 1 sent {mib(pre.extra['round1_bytes_sent'])} MiB, "
          f"the final round {mib(pre.bytes_up)} MiB); plain {min(m.downtime_s for m in firsts if m.pipeline == 'plain'):.2f} s")
    return rows + [pre], best_plain / best_ours


def run_gpu(args, work: Path) -> tuple[list[Migration], float]:
    from gpusnap.gpu.cuda import CudaDriver

    driver = CudaDriver()
    rows: list[Migration] = []
    sizes = [float(s) for s in args.gpu.split(",")]
    for gib in sizes:
        print(f"GPU migration: {gib:g} GiB of GPU memory, one process", flush=True)
        for pipeline in ("plain", "gpusnap"):
            # A registry of its own: a GPU checkpoint is as large as its GPU memory,
            # and the GPU machines' disks hold only a few of them.
            reg = make_registry(work / f"registry-{pipeline}-{gib:g}")
            w = GpuWorkload(gib)
            try:
                m = plain(w, reg, reg.ref("bench/gpu-plain:v1"), work, f"{gib:g} GiB", driver) \
                    if pipeline == "plain" else \
                    ours(w, reg, reg.ref("bench/gpu:v1"), work / f"cache-{gib:g}", f"{gib:g} GiB")
            finally:
                w.remove()
                reg.stop()
                shutil.rmtree(reg.root, ignore_errors=True)
                shutil.rmtree(work / f"cache-{gib:g}", ignore_errors=True)
            m.extra["gpu_gib"] = gib
            rows.append(m)
            print(json.dumps(m.row()), flush=True)
    report(rows)
    for gib in sizes:
        p, g = [m for m in rows if m.extra["gpu_gib"] == gib]
        floor = sum(g.driver.values())
        g.extra["floor_s"] = round(floor, 3)
        g.extra["total_over_floor"] = round(g.total / floor, 2) if floor else None
        line = f"{gib:g} GiB: plain / gpusnap " + \
            ", ".join(f"{k} {v:.2f}x" for k, v in pair_ratios(p, g).items())
        if floor:
            line += (f"; floor (driver checkpoint + restore) {floor:.2f} s, gpusnap total / "
                     f"floor {g.total / floor:.2f}x")
        else:
            line += "; no driver timings in the journal (no floor)"
        print(line)
    return rows, sum(m.total for m in rows if m.pipeline == "plain") / \
        sum(m.total for m in rows if m.pipeline == "gpusnap")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=0.75, help="CPU container memory (GiB)")
    ap.add_argument("--rounds", type=int, default=2,
                    help="first migrations per pipeline (CPU); the fastest of each is compared")
    ap.add_argument("--gpu", help="GPU memory sizes, e.g. 8,32,64: the CUDA variant")
    ap.add_argument("--out", default="bench-migrate.json")
    ap.add_argument("--workdir", default="/var/tmp", help="archives, pulls and the registry")
    args = ap.parse_args()
    for tool in ("podman", "oras", "docker-registry"):
        if shutil.which(tool) is None:
            raise SystemExit(f"{tool} is not installed (make deps)")
    work = Path(tempfile.mkdtemp(prefix="gpusnap-migbench-", dir=args.workdir))
    # unsigned pushes: the restores take them (trust costs are bench/trust_bench.py's)
    os.environ["GPUSNAP_POLICY"] = str(permissive_policy(work))
    try:
        if args.gpu:
            rows, speedup = run_gpu(args, work)
        else:
            reg = make_registry(work / "registry")
            try:
                rows, speedup = run_cpu(args, work, reg)
            finally:
                reg.stop()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    Path(args.out).write_text(json.dumps({
        "gib": None if args.gpu else args.gib, "gpu_gib": args.gpu, "cores": os.cpu_count(),
        "host": os.uname().nodename, "kernel": os.uname().release,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "rows": [m.row() for m in rows], "speedup": round(speedup, 2)}, indent=2))
    print(f"speedup {speedup:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
