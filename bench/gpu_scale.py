"""GPU migration at scale, built for 10-minute calls on one warm GPU machine.

    /opt/gpusnap/venv/bin/python bench/gpu_scale.py start ...  # the venv of tests/gpu/prepare.sh

    bench/gpu_scale.py start  --results DIR [--sizes 8,16,32] [--jobs infer,train]
                              [--pipelines gpusnap,local,plain] [--ram-gib 70]
    bench/gpu_scale.py wait   --results DIR [--seconds 540]   # until done or the time is up
    bench/gpu_scale.py report --results DIR [--png F] [--timelines]

`start` runs the cases in a process of its own session (it outlives the call
that started it, as long as the machine stays warm) and returns at once; `wait`
follows its log. Every case (size x job x pipeline) writes DIR/<case>.json when
it ends; a later `start` (a fresh machine, after the runner died) skips the
cases that have one, so a whole size is measured in a few calls back to back.

Cases, each with a new container of tests/gpu/jobs.py (inference: bf16 weights
fixed after load + a KV-like buffer rewritten per step; training: weights and
Adam moments rewritten every step), one process on GPU 0:

  gpusnap  `gpusnap migrate CTR REF`, `podman rm`, `gpusnap restore REF`
  tar      as gpusnap, with GPUSNAP_PAGES_ASIDE=0: CRIU's pages through Podman's
           export and import tars (how gpusnap moved them before 2026-11-25)
  disk     as gpusnap, with GPUSNAP_PAGES_RAM=0: CRIU's pages on the disk on both
           ends, never in RAM (pages/memory.py; how gpusnap kept them until 2026-11-25 21:00)
  shm      as gpusnap, with GPUSNAP_PAGES_HUGE=0: pages in RAM on /dev/shm's 4 KiB
           pages, not gpusnap's huge-page tmpfs (how they were kept until 2026-11-26)
  detach   `gpusnap migrate --detach CTR REF` (back once checkpointed locally),
           `gpusnap status ID --wait`, then as gpusnap
  precopy  `gpusnap migrate -P CTR REF:pre` (the job runs on), `gpusnap pull
           --prefetch REF:pre` (the target's cache), then as gpusnap to REF:final
  precopy-shm  precopy with GPUSNAP_PAGES_HUGE=0
  precopy-patch  precopy with GPUSNAP_PAGES_PARENT=0: round 1's prepared file
           patched (shifted chunks moved within it) instead of read as CRIU's
           parent images (how the final round was restored until 2026-11-26 12:00)
  precopy-nofill  precopy with /etc/gpusnap/page-fill.json {"enabled": false}:
           CRIU writes every page into the restored process on its one thread
           (how every restore went until 2026-11-26 15:00; pages/fill_plan.py)
  gpusnap-nofill  gpusnap likewise
  precopy-noahead  precopy with GPUSNAP_DUMP_AHEAD=0: CRIU reads the driver's copy
           of the GPU memory out of the process on its one thread (how every dump
           went until 2026-11-26 19:00; pages/dump_ahead.py)
  gpusnap-noahead  gpusnap likewise
  local    `gpusnap checkpoint CTR --export F`, `podman rm`, `gpusnap restore F`
  plain    driver lock + checkpoint, `podman container checkpoint --export` with
           CRIU not set up for gpusnap, `oras push`, `oras pull`, `podman rm`,
           `podman container restore --import`, driver restore + unlock
           (bench/migrate.py's `plain`)

Downtime is read from the job's own progress.log: its last step on the source
to its first on the target. Content checks after restore: inference, every
weight regenerated and compared and the answers to repeated requests equal to
those before; training, the loss lines equal an uninterrupted run's. The floor
is the driver's own checkpoint + restore of the case, from the journal.

Where things live: the registry's storage on a tmpfs of --ram-gib at
/mnt/gpusnap-ram (RAM, so the 64 GB disk holds Podman's storage and the
checkpoint's other copies), or with --ram-gib 0 on the disk (pre-copy at 32
GiB on one host: the RAM then holds the pages prepared by the prefetch,
pages/prepared_pages.py, beside the source's pages and the job); scratch archives (gpusnap's staged export, the
plain and local cases' archives) on --workdir: the disk, or with --stage-gib a
tmpfs mounted there; each is deleted as soon as the next phase has it. The
chunk caches: --cache-dir (put it on the disk where CRIU's pages should go to
RAM: a cache on a tmpfs takes the memory memory.ram_dir looks for). The
registry: --registry (default Debian 13's build where prepare.sh put it), its
version in every case's row.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from migrate import (GPUSNAP, Beat, Migration, container_id, driver_floor,  # noqa: E402
                     journal_events, journal_size, need_gpusnap_python, plain, restore_ref,
                     timed)

from timeline import Timeline, summary  # noqa: E402

from gpusnap.pages import fill_plan  # noqa: E402

from gpusnap.pages import memory  # noqa: E402

from tests.faults.netreg import make_registry  # noqa: E402
from tests.integration.oci_registry import permissive_policy  # noqa: E402

RAM = Path("/mnt/gpusnap-ram")
DISK_REGISTRIES = Path("/var/lib/gpusnap-bench-registries")  # --ram-gib 0
# Debian 13's docker-registry (2.8.3, Go 1.24), which tests/gpu/prepare.sh unpacks:
# a registry as users run it today; Debian 12's Go 1.19 build spends about twice the
# CPU per byte stored (bench/ingest.py), on the cores the push shares with it here.
TRIXIE = "/opt/gpusnap/registry-trixie"
SHM = {memory.HUGE_ENV: "0"}  # pages in RAM on /dev/shm, not gpusnap's huge-page tmpfs
NO_AHEAD = {"GPUSNAP_DUMP_AHEAD": "0"}  # CRIU dumps the driver's copy itself (pages/dump_ahead.py)
JOBS = Path(__file__).resolve().parent.parent / "tests" / "gpu" / "jobs.py"


# -- the job in its container ---------------------------------------------------------


class Job:
    """A tests/gpu/jobs.py container; what bench/migrate.py's `plain` needs of a workload."""

    def __init__(self, kind: str, gib: float) -> None:
        from tests.gpu import harness
        self.harness, self.kind, self.gib = harness, kind, gib
        self.ctr = harness._run(f"gpusnap-scale-{kind}-{gib:g}-{os.getpid()}", [0], 1,
                                harness.PYTHON, "/work/jobs.py", kind, str(gib))
        self.name = self.ctr.name
        self.status = self.ctr.status
        self.beat = Beat(self.status / "w0", every=0.01)
        self.beat.wait_beat(time.monotonic(), timeout=600)
        self.gpu_bytes = harness.gpu_memory_used(0)
        self.answers_before: dict[str, str] = {}

    def mark(self) -> None:
        """Just before the migration: the answers to compare after it (~100
        requests at 10 steps/s: every request id once at least)."""
        deadline = time.monotonic() + 15
        while len(self.answers()) < 97 and time.monotonic() < deadline:
            time.sleep(0.5)
        self.answers_before = self.answers()

    def steps(self) -> list[tuple[float, int]]:
        out = []
        for line in (self.status / "progress.log").read_text().splitlines():
            parts = line.split()
            if len(parts) >= 2:
                out.append((float(parts[0]), int(parts[1])))
        return out

    def answers(self) -> dict[str, str]:
        out = {}
        for line in (self.status / "progress.log").read_text().splitlines():
            parts = line.split()
            if len(parts) >= 6 and parts[2] == "request":
                out[parts[3]] = parts[5]
        return out

    def downtime(self, start_wall: float, until: float | None = None
                 ) -> tuple[float, float, float]:
        """(seconds, last step time on the source, first on the target): the
        largest gap between steps from the migration's start on (up to
        ``until``: a pre-copy round's pause of the running job)."""
        times = [t for t, _ in self.steps()]
        before = [t for t in times if t <= start_wall][-1:]
        after = [t for t in times if t > start_wall and (until is None or t <= until)]
        seen = before + after
        gaps = [(b - a, a, b) for a, b in zip(seen, seen[1:])]
        return max(gaps) if gaps else (0.0, 0.0, 0.0)

    def check_after_restore(self) -> None:
        """Runs again; inference: every weight and the KV buffer compared, and the
        repeated requests answered as before; training: in `check_losses`."""
        self.ctr.wait_running(above=[self.steps()[-1][1]], timeout=300)
        if self.kind == "infer":
            self.ctr.verify(timeout=600)
            time.sleep(10)  # ~100 more requests: every request id again
            now = self.answers()
            differ = {r: (a, now[r]) for r, a in self.answers_before.items() if now.get(r) != a}
            if differ:
                raise SystemExit(f"{len(differ)} requests answered differently after restore: "
                                 f"{list(differ.items())[:3]}")

    def check_losses(self) -> int:
        """Training: the loss lines equal an uninterrupted run's (a second
        process on the same GPU after this one is removed). Lines compared."""
        lines = (self.status / "loss.log").read_text().splitlines()
        self.remove()
        env = {**os.environ, "GPUSNAP_JOB_STATUS": "/tmp"}
        ref = subprocess.run([self.harness.PYTHON, str(JOBS), "train", str(self.gib),
                              "--reference", str(len(lines))],
                             capture_output=True, text=True, env=env, check=True).stdout.splitlines()
        if lines != ref[:len(lines)]:
            bad = next(i for i, (a, b) in enumerate(zip(lines, ref)) if a != b)
            raise SystemExit(f"loss line {bad + 1} differs from an uninterrupted run: "
                             f"{lines[bad]!r} != {ref[bad]!r}")
        return len(lines)

    def remove(self) -> None:
        self.beat.stop()
        self.ctr.remove()


# -- the pipelines ----------------------------------------------------------------------


def gpusnap_case(job: Job, ref: str, cache: Path, m: Migration | None = None,
                 env: dict | None = None, after_push=None) -> Migration:
    """`gpusnap migrate` (stop), `podman rm`, `gpusnap restore REF`; the source
    and the target keep their own chunk caches under ``cache``, as two hosts would."""
    m = m or Migration("gpusnap", f"{job.kind} {job.gib:g} GiB")
    source, target = ({**os.environ, **(env or {}), "GPUSNAP_CACHE_DIR": str(cache / side)}
                      for side in ("source", "target"))
    cid, mark = container_id(job.name), journal_size()
    m.extra["start_wall"] = time.time()
    r = timed([GPUSNAP, "migrate", job.name, ref, "--plain-http", "--json"], env=source)
    pushed = json.loads(r.stdout)
    events = journal_events(mark, cid)
    dump = next((e["seconds"] for e in events if e.get("event") == "checkpointed"), r.seconds)
    m.phases["dump+upload"] = dump
    m.phases["upload after dump"] = r.seconds - dump
    free = next((e["at"] for e in events if e.get("event") == "quiesced" and "at" in e), None)
    m.extra["gpu_free_after_s"] = round(free - m.extra["start_wall"], 3) if free else None
    m.rss_kib["gpusnap migrate"] = r.maxrss_kib
    m.bytes_up, m.extra["checkpoint_bytes"] = pushed["bytes_sent"], pushed["bytes"]
    m.extra["chunks"], m.extra["push"] = pushed["chunks"], {
        k: pushed.get(k) for k in ("seconds", "throughput_mb_s", "prefetched_bytes", "layers",
                                   "parallel_bytes", "processes", "chunks_sent",
                                   "unchanged_bytes", "early_bytes")}
    read = next((e for e in events if e.get("event") == "pages-read-ahead"), None)
    if read:  # the driver's copy read ahead of CRIU; in a final round, what it found as round 1's
        m.extra["read_ahead"] = {k: read.get(k) for k in ("bytes", "read_s", "drop_s",
                                                          "unchanged", "moved_by")}
    if after_push:
        after_push(pushed["pinned"])
    m.phases["rm"] = timed(["podman", "rm", job.name]).seconds
    restore_ref(m, pushed["pinned"], target, events)
    after = journal_events(mark, cid)  # where CRIU's pages were, each side (pages/memory.py)
    m.extra["pages_in_ram"] = {
        "source": any(e.get("event") == "pages-aside" and
                      memory.in_ram(Path(str(e.get("aside", "")))) for e in after),
        "target": any(e.get("event") == "pages-in-place" and e.get("in_ram") for e in after)}
    return m


@contextlib.contextmanager
def no_page_fill():
    """The restore's CRIU action reads this host file, not the CLI's environment."""
    path = fill_plan.SETTINGS
    old = path.read_bytes() if path.exists() else None
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text('{"enabled": false}')
    try:
        yield
    finally:
        if old is None:
            path.unlink(missing_ok=True)
        else:
            path.write_bytes(old)


def detach_case(job: Job, ref: str, cache: Path) -> Migration:
    """`gpusnap migrate --detach`: back once the checkpoint is on local storage,
    the upload in the background; `gpusnap status ID --wait` until it is
    pushed, then `podman rm` and `gpusnap restore REF` as gpusnap_case."""
    m = Migration("detach", f"{job.kind} {job.gib:g} GiB")
    source, target = ({**os.environ, "GPUSNAP_CACHE_DIR": str(cache / side)}
                      for side in ("source", "target"))
    cid, mark = container_id(job.name), journal_size()
    m.extra["start_wall"] = time.time()
    r = timed([GPUSNAP, "migrate", "--detach", job.name, ref, "--plain-http", "--json"],
              env=source)
    m.phases["returned (checkpointed)"], m.rss_kib["gpusnap migrate -d"] = r.seconds, r.maxrss_kib
    upload = json.loads(r.stdout)["id"]
    w = timed([GPUSNAP, "status", upload, "--wait", "--json"], env=source)
    state = json.loads(w.stdout)
    m.phases["background upload after return"] = w.seconds
    pushed = state["result"]
    m.extra.update({k: state.get(k) for k in ("checkpointed_after_s", "gpu_free_after_s",
                                              "pushed_after_s")})
    m.bytes_up, m.extra["checkpoint_bytes"] = pushed["bytes_sent"], pushed["bytes"]
    m.phases["rm"] = timed(["podman", "rm", job.name]).seconds
    restore_ref(m, pushed["pinned"], target, journal_events(mark, cid))
    return m


def precopy_case(job: Job, pre: str, final: str, cache: Path, name: str = "precopy",
                 env: dict | None = None) -> Migration:
    """`gpusnap migrate -P` (round 1, the job runs on), `gpusnap pull --prefetch`
    on the target, then gpusnap_case's final round and restore. Downtime counts
    from the final round; round 1's pause of the job is reported beside it."""
    m = Migration(name, f"{job.kind} {job.gib:g} GiB")
    source, target = ({**os.environ, **(env or {}), "GPUSNAP_CACHE_DIR": str(cache / side)}
                      for side in ("source", "target"))
    round1_wall = time.time()
    r = timed([GPUSNAP, "migrate", "-P", job.name, pre, "--plain-http", "--json"], env=source)
    first = json.loads(r.stdout)
    m.phases["round 1 (job runs)"], m.rss_kib["gpusnap migrate -P"] = r.seconds, r.maxrss_kib
    m.extra["round1_bytes_sent"] = first["bytes_sent"]
    r = timed([GPUSNAP, "pull", "--prefetch", first["pinned"], "--plain-http", "--json"],
              env=target)
    warm = json.loads(r.stdout)
    m.phases["prefetch (job runs)"], m.rss_kib["gpusnap pull --prefetch"] = r.seconds, r.maxrss_kib
    m.extra["prefetch"] = {k: warm.get(k) for k in ("bytes_fetched", "chunks", "seconds",
                                                    "throughput_mb_s", "fetch_seconds",
                                                    "prepared")}
    m.extra["pages_layout"] = {}  # filled once the final round is pushed: pages_layout()
    gpusnap_case(job, final, cache, m, env, after_push=lambda pinned: m.extra.update(
        pages_layout=pages_layout(first["pinned"], pinned)))
    m.extra["round1_pause_s"], _, _ = job.downtime(round1_wall, until=m.extra["start_wall"])
    m.extra["final_bytes_fraction"] = round(m.bytes_up / max(1, first["bytes_sent"]), 4)
    return m


def pages_layout(first: str, final: str) -> dict:
    """How the final round's pages files lie against round 1's, per file: bytes
    whose chunk is at the same offset in both, bytes whose chunk is somewhere
    in round 1's file, the first offset where they part, and the distances the
    others moved by, most bytes first. (Whether a target could patch round 1's
    file in place rather than write the final one anew; whether the source's
    final round could compare at a moved offset: pages/same_pages.py.)"""
    from gpusnap.pages import pages_aside
    from gpusnap.oci.registry import RegistryOptions
    from gpusnap.ops.pull import open_remote

    def files(ref: str) -> dict[str, list]:
        bundle = open_remote(ref, RegistryOptions(plain_http=True)).bundle
        return {f.path: f.chunks for f in bundle.files if pages_aside.is_pages(f.path)}

    out = {}
    old_files, new_files = files(first), files(final)
    for path, chunks in new_files.items():
        old, at, pos = old_files.get(path, []), {}, 0
        first_at: dict[str, int] = {}
        for c in old:
            at[(pos, c.digest)] = True
            first_at.setdefault(c.digest, pos)
            pos += c.size
        same = anywhere = pos = 0
        parted = None
        moved: Counter = Counter()
        for c in chunks:
            if (pos, c.digest) in at:
                same += c.size
            else:
                parted = pos if parted is None else parted
                if c.digest in first_at:
                    moved[pos - first_at[c.digest]] += c.size
            anywhere += c.size if c.digest in first_at else 0
            pos += c.size
        out[path] = {"bytes": pos, "old_bytes": sum(c.size for c in old), "same_offset": same,
                     "anywhere": anywhere, "first_difference": parted,
                     "moved_by": moved.most_common(3)}
    return out


def local_case(job: Job, work: Path) -> Migration:
    m = Migration("local", f"{job.kind} {job.gib:g} GiB")
    archive = work / f"{job.name}.tar.zst"
    mark = journal_size()
    m.extra["start_wall"] = time.time()
    r = timed([GPUSNAP, "checkpoint", job.name, "--export", str(archive), "--json"])
    m.phases["checkpoint --export"], m.rss_kib["gpusnap checkpoint"] = r.seconds, r.maxrss_kib
    m.archive_bytes = archive.stat().st_size
    m.phases["rm"] = timed(["podman", "rm", job.name]).seconds
    r = timed([GPUSNAP, "restore", str(archive), "--json"])
    m.phases["restore"], m.rss_kib["gpusnap restore"] = r.seconds, r.maxrss_kib
    archive.unlink()
    driver_floor(m, journal_events(mark))
    return m


def plain_case(job: Job, reg, work: Path) -> Migration:
    from gpusnap.gpu.cuda import CudaDriver
    start_wall = time.time()
    m = plain(job, reg, reg.ref(f"bench/plain-{job.kind}-{job.gib:g}:v1"), work,
              f"{job.kind} {job.gib:g} GiB", CudaDriver())
    m.pipeline = "plain"
    m.extra["start_wall"] = start_wall
    return m


# -- the runner -------------------------------------------------------------------------


def _case_name(size: float, kind: str, pipeline: str) -> str:
    return f"{size:g}gib-{kind}-{pipeline}"


def _tmpfs(where: Path, gib: float) -> None:
    """A tmpfs of ``gib`` at ``where``: mounted, or one an earlier run mounted
    resized (it kept that run's size: 8 GiB training's two pre-copy rounds
    filled a 24 GiB registry, which then answered HTTP 500)."""
    fstype = next((line.split()[2] for line in open("/proc/mounts")
                   if line.split()[1] == str(where)), None)
    if fstype not in (None, "tmpfs"):
        print(f"{where} is a {fstype} mount: left as it is", flush=True)
        return
    how = f"remount,size={gib:g}g" if fstype else f"size={gib:g}g"
    subprocess.run(["mount", "-t", "tmpfs", "-o", how, "tmpfs", str(where)], check=True)


def run(args) -> int:
    results = Path(args.results)
    results.mkdir(parents=True, exist_ok=True)
    if args.stage_gib:
        # Scratch archives in RAM: gpusnap stages its export in the roomiest of
        # /var/lib/containers and /var/tmp (runtime/storage.py), so a tmpfs
        # larger than the disk's free space takes it (and the plain archive).
        _tmpfs(Path(args.workdir), args.stage_gib)
    work = Path(tempfile.mkdtemp(prefix="gpusnap-scale-", dir=args.workdir))
    cache = Path(args.cache_dir) / work.name if args.cache_dir else work / "cache"
    os.environ["GPUSNAP_POLICY"] = str(permissive_policy(work))
    if args.registry:  # its docker-registry before the system's
        os.environ["PATH"] = f"{args.registry}:{os.environ['PATH']}"
    registry = _registry_version()
    print(f"registry: {registry}", flush=True)
    registries = RAM if args.ram_gib else DISK_REGISTRIES
    registries.mkdir(parents=True, exist_ok=True)
    if args.ram_gib:
        _tmpfs(RAM, args.ram_gib)
    try:
        for size in [float(s) for s in args.sizes.split(",")]:
            for kind in args.jobs.split(","):
                for pipeline in args.pipelines.split(","):
                    if kind == "train" and pipeline == "plain" and not args.plain_train:
                        continue
                    name = _case_name(size, kind, pipeline)
                    out = results / f"{name}.json"
                    if out.exists():
                        print(f"{name}: done before, skipped", flush=True)
                        continue
                    print(f"== {name} ({time.strftime('%H:%M:%S')})", flush=True)
                    try:
                        row = one_case(size, kind, pipeline, work, results, cache, registries)
                    except (SystemExit, Exception) as exc:  # the next case still runs
                        row = {"case": name, "failed": str(exc)[-3000:]}
                        print(f"{name}: FAILED {str(exc)[-1500:]}", flush=True)
                    row["registry"] = registry
                    out.write_text(json.dumps(row, indent=2))
                    print(json.dumps(row), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


def _registry_version() -> str:
    """The first docker-registry on PATH, as it names itself."""
    path = shutil.which("docker-registry")
    if path is None:
        return "none"
    out = subprocess.run([path, "--version"], capture_output=True, text=True).stdout.strip()
    return f"{path}: {out}"


def _forget_pages() -> int:
    """Pages an earlier case left on this host, removed: a restore keeps what it
    wrote for the next replica, and a target that holds the job's pages from
    the case before patches its download from them (454 MB fetched of 13.5 GB
    at 16 GiB), which a migration to another host never does."""
    from gpusnap.pages import kept_pages, prepared_pages

    gone = [*prepared_pages.folders(), *kept_pages.folders()]
    for folder in gone:
        shutil.rmtree(folder, ignore_errors=True)
    return len(gone)


def one_case(size: float, kind: str, pipeline: str, work: Path, results: Path,
             cache: Path, registries: Path = RAM) -> dict:
    forgot = _forget_pages()
    if forgot:
        print(f"  {forgot} folder(s) of pages an earlier case left removed", flush=True)
    reg = make_registry(registries / f"registry-{pipeline}") if pipeline != "local" else None
    job = Job(kind, size)
    print(f"  {job.name}: NVML shows {job.gpu_bytes / 2**30:.2f} GiB in use on GPU 0", flush=True)
    try:
        if kind == "infer":
            job.mark()
        with Timeline(results / f"{_case_name(size, kind, pipeline)}.timeline.jsonl",
                      reg.root if reg else None):
            if pipeline == "gpusnap":
                m = gpusnap_case(job, reg.ref(f"bench/{kind}-{size:g}:v1"), cache)
            elif pipeline == "tar":  # pages through Podman's tar, as before pages_aside.py
                m = gpusnap_case(job, reg.ref(f"bench/{kind}-{size:g}:tar"), cache,
                                 Migration("tar", f"{job.kind} {job.gib:g} GiB"),
                                 {"GPUSNAP_PAGES_ASIDE": "0"})
            elif pipeline == "disk":  # CRIU's pages on the disk on both ends, as before memory.py
                m = gpusnap_case(job, reg.ref(f"bench/{kind}-{size:g}:disk"), cache,
                                 Migration("disk", f"{job.kind} {job.gib:g} GiB"),
                                 {"GPUSNAP_PAGES_RAM": "0"})
            elif pipeline == "shm":  # pages in RAM on /dev/shm's 4 KiB pages, as before 2026-11-26
                m = gpusnap_case(job, reg.ref(f"bench/{kind}-{size:g}:shm"), cache,
                                 Migration("shm", f"{job.kind} {job.gib:g} GiB"), SHM)
            elif pipeline == "precopy-shm":
                m = precopy_case(job, reg.ref(f"bench/{kind}-{size:g}:pre-shm"),
                                 reg.ref(f"bench/{kind}-{size:g}:final-shm"), cache,
                                 "precopy-shm", SHM)
            elif pipeline == "precopy-patch":  # the prepared file patched, not CRIU's parent
                m = precopy_case(job, reg.ref(f"bench/{kind}-{size:g}:pre-patch"),
                                 reg.ref(f"bench/{kind}-{size:g}:final-patch"), cache,
                                 "precopy-patch", {"GPUSNAP_PAGES_PARENT": "0"})
            elif pipeline == "precopy-nofill":
                with no_page_fill():
                    m = precopy_case(job, reg.ref(f"bench/{kind}-{size:g}:pre-nofill"),
                                     reg.ref(f"bench/{kind}-{size:g}:final-nofill"), cache,
                                     "precopy-nofill")
            elif pipeline == "gpusnap-nofill":
                with no_page_fill():
                    m = gpusnap_case(job, reg.ref(f"bench/{kind}-{size:g}:nofill"), cache,
                                     Migration("gpusnap-nofill", f"{job.kind} {job.gib:g} GiB"))
            elif pipeline == "precopy-noahead":
                m = precopy_case(job, reg.ref(f"bench/{kind}-{size:g}:pre-noahead"),
                                 reg.ref(f"bench/{kind}-{size:g}:final-noahead"), cache,
                                 "precopy-noahead", NO_AHEAD)
            elif pipeline == "gpusnap-noahead":
                m = gpusnap_case(job, reg.ref(f"bench/{kind}-{size:g}:noahead"), cache,
                                 Migration("gpusnap-noahead", f"{job.kind} {job.gib:g} GiB"),
                                 NO_AHEAD)
            elif pipeline == "detach":
                m = detach_case(job, reg.ref(f"bench/{kind}-{size:g}:detach"), cache)
            elif pipeline == "precopy":
                m = precopy_case(job, reg.ref(f"bench/{kind}-{size:g}:pre"),
                                 reg.ref(f"bench/{kind}-{size:g}:final"), cache)
            elif pipeline == "local":
                m = local_case(job, work)
            else:
                m = plain_case(job, reg, work)
        if pipeline != "plain":  # plain() checks it itself
            job.check_after_restore()
        m.downtime_s, last, first = job.downtime(m.extra["start_wall"])
        m.extra.update({"gpu_gib": size, "job": kind, "nvml_gpu_bytes": job.gpu_bytes,
                        "last_step_source": last, "first_step_target": first,
                        "floor_s": round(sum(m.driver.values()), 3) or None})
        if kind == "train":
            m.extra["loss_lines_equal"] = job.check_losses()
        else:
            m.extra["answers_equal"] = len(job.answers_before)
    finally:
        job.remove()
        if reg:
            reg.stop()
            shutil.rmtree(reg.root, ignore_errors=True)
        shutil.rmtree(cache, ignore_errors=True)
    row = m.row()
    row["case"] = _case_name(size, kind, pipeline)
    return row


# -- start / wait / report ---------------------------------------------------------------


def start(args) -> int:
    results = Path(args.results)
    results.mkdir(parents=True, exist_ok=True)
    pidfile = results / "runner.pid"
    if pidfile.exists() and _alive(int(pidfile.read_text())):
        print(f"a runner is already at work (pid {pidfile.read_text().strip()})")
        return 0
    cmd = [sys.executable, __file__, "run", "--results", args.results, "--sizes", args.sizes,
           "--jobs", args.jobs, "--pipelines", args.pipelines, "--workdir", args.workdir,
           "--ram-gib", str(args.ram_gib), "--stage-gib", str(args.stage_gib),
           "--cache-dir", args.cache_dir, "--registry", args.registry] \
        + (["--plain-train"] if args.plain_train else [])
    log = open(results / "log.txt", "a")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    pidfile.write_text(str(proc.pid))
    print(f"runner started (pid {proc.pid}), log {results / 'log.txt'}")
    return 0


def _alive(pid: int) -> bool:
    """Running, not a zombie (the call that started it is gone, and the
    machine's init may never reap it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def wait(args) -> int:
    results = Path(args.results)
    pid = int((results / "runner.pid").read_text())
    log = results / "log.txt"
    pos = 0
    deadline = time.monotonic() + args.seconds
    alive = True
    while time.monotonic() < deadline:
        with open(log) as f:
            f.seek(pos)
            text = f.read()
            pos = f.tell()
        if text:
            print(text, end="", flush=True)
        if not _alive(pid):
            alive = False
            break
        time.sleep(2)
    print(f"\nrunner {'still at work' if alive else 'finished'}")
    return 0 if not alive else 3


def report(args) -> int:
    rows = [json.loads(p.read_text()) for p in sorted(Path(args.results).glob("*gib-*.json"))]
    for r in rows:
        if "failed" in r:
            print(f"{r['case']}: failed: {r['failed'][-300:]}")
            continue
        ph = ", ".join(f"{k} {v:.1f}" for k, v in r["phases_s"].items())
        floor = r.get("floor_s")
        print(f"{r['case']}: total {r['total_s']:.1f} s, downtime {r['downtime_s']:.1f} s "
              f"(NVML {r['nvml_gpu_bytes'] / 2**30:.1f} GiB; {ph}; up {r['bytes_up'] / 1e9:.2f} GB; "
              f"floor {floor} s; RSS MiB " +
              ", ".join(f"{k} {v // 1024}" for k, v in r["peak_rss_kib"].items()) + ")")
    ok = [r for r in rows if "failed" not in r]
    for r in ok:
        if r["pipeline"] != "gpusnap":
            continue
        twin = next((p for p in ok if p["pipeline"] == "plain" and p["gpu_gib"] == r["gpu_gib"]
                     and p["job"] == r["job"]), None)
        line = f"{r['job']} {r['gpu_gib']:g} GiB: gpusnap total / floor " + \
            (f"{r['total_s'] / r['floor_s']:.2f}x" if r.get("floor_s") else "-")
        if twin:
            line += (f"; plain / gpusnap total {twin['total_s'] / r['total_s']:.2f}x, "
                     f"downtime {twin['downtime_s'] / r['downtime_s']:.2f}x")
        tar = next((p for p in ok if p["pipeline"] == "tar" and p["gpu_gib"] == r["gpu_gib"]
                    and p["job"] == r["job"]), None)
        if tar:
            line += (f"; pages through Podman's tars (GPUSNAP_PAGES_ASIDE=0): downtime "
                     f"{tar['downtime_s']:.1f} s against {r['downtime_s']:.1f} s")
        print(line)
    for r in ok:
        if r["pipeline"] != "precopy":
            continue
        twin = next((p for p in ok if p["pipeline"] == "gpusnap" and p["gpu_gib"] == r["gpu_gib"]
                     and p["job"] == r["job"]), None)
        line = (f"{r['job']} {r['gpu_gib']:g} GiB pre-copy: downtime {r['downtime_s']:.1f} s"
                + (f" = {r['downtime_s'] / r['floor_s']:.2f}x the floor" if r.get("floor_s") else "")
                + f"; round 1 paused the job {r['round1_pause_s']:.1f} s; final round sent "
                f"{100 * r['final_bytes_fraction']:.1f}% of round 1's bytes")
        read, push = r.get("read_ahead") or {}, r.get("push") or {}
        if read.get("unchanged") is not None:
            line += (f"; its read found {read['unchanged'] / 1e9:.2f} of {read['bytes'] / 1e9:.2f}"
                     f" GB as round 1 left them"
                     + (f" (moved by {read['moved_by']} bytes)" if read.get("moved_by") else "")
                     + f", the push took {(push.get('unchanged_bytes') or 0) / 1e9:.2f} GB unhashed")
        if twin:
            line += f"; downtime without pre-copy {twin['downtime_s']:.1f} s"
        print(line)
    if args.png and ok:
        plot(ok, Path(args.png))
    if args.timelines:
        for path in sorted(Path(args.results).glob("*.timeline.jsonl")):
            print(f"-- {path.name.split('.')[0]}")
            print("\n".join(summary(path, args.step)))
    return 0


def plot(rows: list[dict], png: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for pipeline, style in (("plain", "s-"), ("gpusnap", "o-"), ("local", "^-"),
                            ("precopy", "D-"), ("tar", "v-")):
        pts = sorted((r["nvml_gpu_bytes"] / 2**30, r["total_s"], r["downtime_s"]) for r in rows
                     if r["pipeline"] == pipeline and r["job"] == "infer")
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=f"{pipeline}: total")
            ax.plot([p[0] for p in pts], [p[2] for p in pts], style[0] + "--", alpha=0.5,
                    label=f"{pipeline}: downtime")
    floor = sorted((r["nvml_gpu_bytes"] / 2**30, r["floor_s"]) for r in rows
                   if r["pipeline"] == "gpusnap" and r.get("floor_s") and r["job"] == "infer")
    if floor:
        ax.plot([p[0] for p in floor], [p[1] for p in floor], "k:", label="driver floor")
    ax.set_xlabel("GPU memory in use (GiB, NVML)")
    ax.set_ylabel("seconds")
    ax.set_title("Inference job migrated through a loopback registry")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("verb", choices=("start", "run", "wait", "report"))
    ap.add_argument("--results", required=True)
    ap.add_argument("--sizes", default="8,16,32")
    ap.add_argument("--jobs", default="infer,train")
    ap.add_argument("--pipelines", default="gpusnap,local,plain")
    ap.add_argument("--plain-train", action="store_true", help="also the plain pipeline for training")
    ap.add_argument("--workdir", default="/var/tmp")
    ap.add_argument("--ram-gib", type=int, default=70, help="tmpfs for the registries' storage "
                    f"(0: on the disk, {DISK_REGISTRIES}, leaving the RAM to pages in RAM)")
    ap.add_argument("--cache-dir", default="",
                    help="the chunk caches (default: under --workdir); on the disk, where the "
                         "tmpfs would take the memory the pages in RAM need (pages/memory.py)")
    ap.add_argument("--stage-gib", type=int, default=0,
                    help="a tmpfs of this size on --workdir for the scratch archives (0: the disk)")
    ap.add_argument("--registry", default=TRIXIE if os.path.isdir(TRIXIE) else "",
                    help="a folder whose docker-registry the cases use (default: Debian 13's "
                         "build where tests/gpu/prepare.sh put it; '' for the system's)")
    ap.add_argument("--seconds", type=float, default=540)
    ap.add_argument("--png")
    ap.add_argument("--timelines", action="store_true", help="report: what the machine did, per case")
    ap.add_argument("--step", type=float, default=5.0, help="report --timelines: seconds a line")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.verb in ("start", "run"):
        need_gpusnap_python()
    return {"start": start, "run": run, "wait": wait, "report": report}[args.verb](args)


if __name__ == "__main__":
    sys.exit(main())
