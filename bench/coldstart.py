"""Cold start against restore: how soon a warmed-up GPU inference server answers.

    bench/coldstart.py --gib 8 --out coldstart.json [--network bridge|none] [--no-tcp]
                       [--server plain|compiled]

One run on a GPU machine prepared by tests/gpu/prepare.sh (about 5 minutes at
8 GiB). The server is tests/gpu/jobs.py's *serve*: it imports PyTorch, reads
GIB GiB of bf16 weights from files in its image (/weights, in Podman's storage
on the disk), runs warm-up requests, then answers on a socket. Cases, each
timed from its command to the first answer (the page cache dropped before
each, so files and cached chunks come from the disk as on a node that did
not just write them):

  a  cold       `podman run` of the server image
  b  restore    `gpusnap restore REF --name r1`, an empty chunk cache; the
                pages files it writes are kept in RAM for the next replica
                (pages/prepared_pages.keep)
  c  warm       `gpusnap restore REF --name r2`: the cache (b) filled, and
                (b)'s pages files, linked
  d  2 at once  `gpusnap restore REF --name r3` and `--name r4` together, as (c)
  e  cache only `--name r5` with (b)'s kept pages set aside and
                GPUSNAP_KEEP_PAGES=0: the pages written anew from the chunk cache

--server compiled runs jobs.py's *serve-compiled* instead: at start-up it also
torch.compiles its forward pass and captures a CUDA graph per batch size, with
inductor's and Triton's caches in a host folder. (a) is then two cold starts:
(a0) with that folder empty, (a1) with what (a0) left in it; (a1) is the
source, and each replica's speed-up is given against both.

REF is `gpusnap push` of (a)'s container once it answers (it keeps running:
the source of every replica). Every replica must answer requests 0-9 exactly
as the source did and pass `verify` (each layer summed again, compared with
the sums taken at load), and its name, address and MAC must differ from the
source's and the other replicas'. (d)'s two replicas and the source answer
at the same time on the one GPU. The registry is a docker-registry on
loopback with its storage on a tmpfs; the chunk cache is on the disk.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from migrate import (GPUSNAP, journal_events, journal_size, need_gpusnap_python,  # noqa: E402
                     timed)

from tests.faults.netreg import make_registry  # noqa: E402
from tests.gpu import harness  # noqa: E402
from tests.integration.oci_registry import permissive_policy  # noqa: E402

RAM = Path("/mnt/gpusnap-ram")
GPU_DIR = Path(__file__).resolve().parent.parent / "tests" / "gpu"
REQUESTS = range(10)


def sh(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    res = subprocess.run(list(args), capture_output=True, text=True)
    if check and res.returncode:
        raise SystemExit(f"{' '.join(args)} failed: {res.stderr.strip()[-2000:]}")
    return res


def drop_caches() -> None:
    """Files and cached chunks from the disk, as on a node that did not just write them."""
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def server_image(gib: float) -> str:
    """The skeleton image plus /weights (built once per size: generating and
    importing 8 GiB takes about a minute)."""
    image = f"localhost/gpusnap-serve:{gib:g}"
    if sh("podman", "image", "exists", image, check=False).returncode == 0:
        return image
    scratch = Path(tempfile.mkdtemp(prefix="gpusnap-weights-", dir="/var/tmp"))
    try:
        sh(harness.PYTHON, str(GPU_DIR / "jobs.py"), "weights", str(scratch / "w"), str(gib))
        env = {**os.environ, "TMPDIR": str(scratch)}  # the move into the image's root: a rename
        subprocess.run(["sh", str(GPU_DIR / "gpu-image.sh"), image, str(scratch / "w")],
                       env=env, check=True, capture_output=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return image


def network_mode(image: str, wanted: str) -> str:
    """bridge when Podman can give a container an address here, else none."""
    if wanted != "bridge":
        return wanted
    probe = sh("podman", "run", "--rm", "--network", "bridge", *harness.mount_args(), image,
               "/usr/bin/true", check=False)
    if probe.returncode:
        print(f"no bridge network here ({probe.stderr.strip()[-300:]}): --network none",
              flush=True)
        return "none"
    return "bridge"


class Server:
    """A serve container, reached through /proc/PID/root/tmp/serve.sock."""

    def __init__(self, name: str, pid: int | None = None) -> None:
        self.name = name
        self._pid = pid

    @property
    def pid(self) -> int:
        """``pid`` as given (a restore's --json names it: no `podman inspect`
        between the restore and its first answer, which a cold start does not
        wait for either), else Podman's."""
        return self._pid or int(sh("podman", "inspect", self.name, "--format",
                                   "{{.State.Pid}}").stdout)

    def identity(self) -> dict:
        out = sh("podman", "inspect", self.name, "--format",
                 "{{.NetworkSettings.IPAddress}} {{.NetworkSettings.MacAddress}} "
                 "{{.Config.Hostname}} {{.Id}}").stdout.split()
        out += [""] * (4 - len(out))
        return {"name": self.name, "ip": out[0], "mac": out[1], "hostname": out[2],
                "id": out[3][:12]}

    def ask(self, lines: list[str], timeout: float = 600) -> tuple[list[str], float]:
        """Answers to ``lines`` and the time the first came, waiting for the socket."""
        path = f"/proc/{self.pid}/root/tmp/serve.sock"
        deadline = time.monotonic() + timeout
        while True:
            try:
                with socket.socket(socket.AF_UNIX) as s:
                    s.connect(path)
                    with s.makefile("rw") as f:
                        answers, first = [], None
                        for line in lines:
                            f.write(line + "\n")
                            f.flush()
                            answers.append(f.readline().strip())
                            first = first or time.time()
                        return answers, first
            except (FileNotFoundError, ConnectionRefusedError):
                if time.monotonic() > deadline:
                    raise SystemExit(f"{self.name} did not answer in {timeout:.0f} s")
                time.sleep(0.02)

    def phases(self) -> dict[str, float]:
        """The server's own phase times (cold start only: a restored one logs none)."""
        out = {}
        for line in sh("podman", "logs", self.name).stdout.splitlines():
            parts = line.split()
            if len(parts) == 3 and parts[0] == "phase":
                out[parts[2]] = float(parts[1])
        return out

    def remove(self) -> None:
        sh("podman", "rm", "-f", "-t", "0", self.name, check=False)


def compile_cache_args(folder: Path) -> list[str]:
    """A compiled server's inductor and Triton caches in a host folder, kept
    between its runs as a careful operator keeps them."""
    return ["-v", f"{folder}:/cache", "-e", "TORCHINDUCTOR_CACHE_DIR=/cache/inductor",
            "-e", "TRITON_CACHE_DIR=/cache/triton"]


def cold_start(image: str, name: str, network: str, gib: float, tcp: bool,
               job: str = "serve", extra: tuple[str, ...] = (),
               case: str = "a cold podman run") -> tuple[Server, dict]:
    drop_caches()
    t0 = time.time()
    sh("podman", "run", "-d", "--name", name, "--network", network,
       *(["-e", "SERVE_TCP=1"] if tcp else []),
       *harness.gpu_device_args([0]), *harness.mount_args(),
       "-v", f"{GPU_DIR}:/work:ro", *extra,
       "-e", f"LD_LIBRARY_PATH={harness.DRIVER_DIR}/lib64:{harness.DRIVER_DIR}/lib",
       "-e", "PYTHONUNBUFFERED=1", image, harness.PYTHON, "/work/jobs.py", job, "/weights")
    started = time.time()
    srv = Server(name)
    _, first = srv.ask(["0"], timeout=1800)  # an empty compile cache: minutes of autotuning
    p = srv.phases()
    steps = [("import torch + CUDA context", "started", "imported"),
             (f"load {gib:g} GiB of weights", "imported", "loaded")]
    if "compiled" in p:
        steps += [("compile", "loaded", "compiled"), ("capture CUDA graphs", "compiled", "captured"),
                  ("warm-up", "captured", "warm")]
    else:
        steps += [("warm-up", "loaded", "warm")]
    phases = {"podman run": round(started - t0, 3)}
    phases.update({label: round(p[b] - p[a], 3) for label, a, b in steps})
    phases["first answer"] = round(first - p["warm"], 3)
    row = {"case": case, "first_answer_s": round(first - t0, 3), "phases": phases,
           "gpu_bytes": harness.gpu_memory_used(0)}
    return srv, row


# what a timeline keeps of each journal event (the rest is paths and pids)
EVENT_FIELDS = ("seconds", "bytes", "huge_bytes", "fill_s", "runs", "threads", "timing", "how", "files",
                "by", "driver_ahead", "skipped")


def timeline(events: list[dict], t0: float) -> list[list]:
    """The journal's events of one restore as [seconds since t0, event, what
    it measured]: where its seconds went, between gpusnap's steps, CRIU's
    action-script steps and the driver's restore."""
    return [[round(e["at"] - t0, 3), e.get("event"),
             {k: e[k] for k in EVENT_FIELDS if k in e}] for e in events if "at" in e]


def restore(ref: str, name: str, cache: Path, t0: float, keep: str = "auto",
            extra: tuple[str, ...] = ()) -> dict:
    mark = journal_size()
    r = timed([GPUSNAP, "restore", ref, "--name", name, "--plain-http", "--json", *extra],
              env={**os.environ, "GPUSNAP_CACHE_DIR": str(cache), "GPUSNAP_KEEP_PAGES": keep})
    done = time.time()
    out = json.loads(r.stdout)
    _, first = Server(name, out["container"].get("pid")).ask(["0"])
    pull = out.get("pull") or {}
    return {"first_answer_s": round(first - t0, 3), "restore_rss_mib": round(r.maxrss_kib / 1024),
            # replicas restored together share the journal: theirs interleave
            "timeline": timeline(journal_events(mark), t0),
            "bytes_fetched": pull.get("bytes_fetched"),
            "bytes_from_cache": pull.get("bytes_from_cache"),
            "pages_prepared": pull.get("pages_prepared"), "pages_kept": pull.get("pages_kept"),
            "phases": {"download": pull.get("seconds"),
                       "restore": round(r.seconds - (pull.get("seconds") or 0), 3),
                       "first answer": round(first - done, 3)}}


def together(ref: str, tag: str, names: tuple[str, ...], case: str, cache: Path,
             expected: list[str], tcp: bool, servers: list[Server],
             keep: str = "auto") -> list[dict]:
    """Replicas ``names`` restored at the same time (page cache dropped first),
    each checked and left running (added to ``servers``); their rows."""
    drop_caches()
    t0 = time.time()
    done: dict[str, dict] = {}

    def one(n: str) -> None:
        # A thread drops SystemExit silently (migrate.timed raises it with the
        # restore's own words): say it here, or "see above" points at nothing.
        try:
            done[n] = restore(ref, f"{tag}-{n}", cache, t0, keep)
        except BaseException as exc:  # noqa: BLE001
            print(f"replica {tag}-{n}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)

    threads = [threading.Thread(target=one, args=(n,)) for n in names]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if len(done) != len(names):
        raise SystemExit(f"a replica of ({case}) failed: see above")
    rows = []
    for n in names:
        srv = Server(f"{tag}-{n}")
        servers.append(srv)
        check(srv, expected, tcp)
        label = f"{case}: {n}" if len(names) > 1 else case
        rows.append({"case": label, **done[n], "identity": srv.identity(),
                     **({"together": len(names)} if len(names) > 1 else {})})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def check(srv: Server, expected: list[str], tcp: bool = False) -> None:
    answers, _ = srv.ask([str(n) for n in REQUESTS] + ["verify"])
    if answers[:-1] != expected or answers[-1] != "ok":
        raise SystemExit(f"{srv.name} answered {answers} (expected {expected} + ok)")
    ip = srv.identity()["ip"]
    if tcp and ip:  # its own address, the server's TCP port restored with it
        with socket.create_connection((ip, 8000), timeout=30) as s, s.makefile("rw") as f:
            f.write("0\n")
            f.flush()
            if f.readline().strip() != expected[0]:
                raise SystemExit(f"{srv.name} answered otherwise on {ip}:8000")


def run(args) -> dict:
    os.environ.setdefault("GPUSNAP_POLICY", str(permissive_policy(Path(tempfile.mkdtemp()))))
    image = server_image(args.gib)
    network = network_mode(image, args.network)
    RAM.mkdir(parents=True, exist_ok=True)
    if not os.path.ismount(RAM):
        sh("mount", "-t", "tmpfs", "-o", f"size={args.ram_gib}g", "tmpfs", str(RAM))
    reg = make_registry(RAM / "registry-coldstart")
    cache = Path(tempfile.mkdtemp(prefix="gpusnap-coldstart-cache-", dir="/var/lib"))
    tag = f"coldstart-{os.getpid()}"
    servers: list[Server] = []
    rows: list[dict] = []
    prepared = None
    compile_cache = Path(tempfile.mkdtemp(prefix="gpusnap-compile-cache-", dir="/var/lib"))
    first_answers: list[str] = []  # (a0)'s, when there is an (a0)
    try:
        if args.server == "compiled":
            # (a0) an empty compile cache, (a1) the cache (a0) filled: the source
            first, row = cold_start(image, f"{tag}-cold0", network, args.gib, args.tcp,
                                    "serve-compiled", tuple(compile_cache_args(compile_cache)),
                                    "a0 cold, empty compile cache")
            first_answers, _ = first.ask([str(n) for n in REQUESTS])
            first.remove()
            rows.append(row)
            print(json.dumps(row), flush=True)
            src, row = cold_start(image, f"{tag}-source", network, args.gib, args.tcp,
                                  "serve-compiled", tuple(compile_cache_args(compile_cache)),
                                  "a1 cold, warm compile cache")
        else:
            src, row = cold_start(image, f"{tag}-source", network, args.gib, args.tcp)
        servers.append(src)
        rows.append(row)
        print(json.dumps(row), flush=True)
        expected, _ = src.ask([str(n) for n in REQUESTS])
        check(src, expected, args.tcp)
        differ = [n for n, a, b in zip(REQUESTS, first_answers, expected) if a != b]
        if args.server == "compiled" and differ:
            # autotuning may pick other kernels on each empty-cache compile: other roundings
            print(f"note: the two cold starts answered requests {differ} differently: "
                  "autotuning chose other kernels", flush=True)
        ref = reg.ref(f"bench/serve-{args.gib:g}:warm")
        push = timed([GPUSNAP, "push", src.name, ref, "--plain-http", "--json"],
                     env={**os.environ, "GPUSNAP_CACHE_DIR": str(cache / "source")})
        pushed = json.loads(push.stdout)
        print(f"pushed {pushed['bytes'] / 1e9:.2f} GB in {push.seconds:.1f} s", flush=True)
        pinned = pushed["pinned"]
        target = cache / "target"
        warm = [("c restore, warm cache", "r2")] + [
            (f"c again ({k})", f"r2-{k}") for k in range(1, args.repeat_warm + 1)]
        for case, name in [("b restore, empty cache", "r1")] + warm:
            drop_caches()
            row = {"case": case, **restore(pinned, f"{tag}-{name}", target, time.time())}
            srv = Server(f"{tag}-{name}")
            check(srv, expected, args.tcp)
            row["identity"] = srv.identity()
            rows.append(row)
            print(json.dumps(row), flush=True)
            srv.remove()  # one replica at a time until (d)
            prepared = prepared or row.get("pages_kept")
        if args.compare_huge_pages:
            rows.append(with_settings(pinned, f"{tag}-r2n", target, expected, args.tcp,
                                      "c' warm cache, no huge pages", {"huge_pages": False}))
        for k in range(1, args.compare_agent + 1):
            rows.append(with_settings(pinned, f"{tag}-r2a{k}", target, expected, args.tcp,
                                      f"c'' warm cache, no agent ({k})", {"agent": False}))
        for k in range(1, args.compare_read_ahead + 1):
            rows.append(with_settings(pinned, f"{tag}-r2f{k}", target, expected, args.tcp,
                                      f"c3 warm cache, no file read-ahead ({k})",
                                      {"read_ahead": False}))
        rows += together(pinned, tag, ("r3", "r4"), "d 2 at once", target, expected, args.tcp,
                         servers)
        # (b)'s pages kept in RAM set aside: a replica from the chunk cache alone
        # (GPUSNAP_KEEP_PAGES=0: written anew from the cache, as before keeping)
        aside = None
        if prepared:
            aside = Path(prepared["folder"]).with_name(".aside-" + Path(prepared["folder"]).name)
            os.rename(prepared["folder"], aside)
        try:
            rows += together(pinned, tag, ("r5",), "e warm cache, nothing kept", target,
                             expected, args.tcp, servers, keep="0")
        finally:
            if aside:
                os.rename(aside, prepared["folder"])
        logged = criu_log(pinned, f"{tag}-r6", target, Path(args.criu_log), servers) \
            if args.criu_log else None
        check(src, expected, args.tcp)  # the source answered all along; still does
        ids = [s.identity() for s in servers]
        for key in ("name", "id") + (("ip", "mac") if network == "bridge" else ()):
            if len({i[key] for i in ids}) != len(ids):
                raise SystemExit(f"replicas share a {key}: {ids}")
        colds = [r for r in rows if r["case"].startswith("a")]
        cold = colds[0]["first_answer_s"]
        replicas = rows[len(colds):]
        return {"gib": args.gib, "network": network, "tcp": args.tcp, "image": image,
                "server": args.server,
                "reference": pinned,
                "push_seconds": round(push.seconds, 3), "checkpoint_bytes": pushed["bytes"],
                "gpu_bytes_3_running": harness.gpu_memory_used(0),
                "running_together": ids, "rows": rows, "criu_log_row": logged,
                "speedup_vs_cold": {r["case"]: round(cold / r["first_answer_s"], 2)
                                    for r in replicas},
                **({"speedup_vs_warm_compile_cache": {
                    r["case"]: round(colds[1]["first_answer_s"] / r["first_answer_s"], 2)
                    for r in replicas}} if len(colds) > 1 else {}),
                "beyond_driver": {r["case"]: b for r in replicas if (b := beyond_driver(r))}}
    finally:
        for s in servers:
            s.remove()
        reg.stop()
        shutil.rmtree(reg.root, ignore_errors=True)
        shutil.rmtree(cache, ignore_errors=True)
        shutil.rmtree(compile_cache, ignore_errors=True)
        if prepared:  # the pages (b) kept: GBs of RAM
            shutil.rmtree(prepared["folder"], ignore_errors=True)


def with_settings(ref: str, name: str, cache: Path, expected: list[str], tcp: bool,
                  case: str, wanted: dict) -> dict:
    """(c) again with page-fill.json saying ``wanted`` (e.g. {"huge_pages": false}:
    the fill's areas keep 4 KiB pages; {"agent": false}: each CRIU step in a Python
    of its own); the row beside (c)'s."""
    from gpusnap.pages import fill_plan
    saved = fill_plan.SETTINGS.read_text() if fill_plan.SETTINGS.exists() else None
    fill_plan.SETTINGS.parent.mkdir(parents=True, exist_ok=True)
    fill_plan.SETTINGS.write_text(json.dumps(wanted))
    try:
        drop_caches()
        row = {"case": case, **restore(ref, name, cache, time.time())}
    finally:
        if saved is None:
            fill_plan.SETTINGS.unlink()
        else:
            fill_plan.SETTINGS.write_text(saved)
    srv = Server(name)
    check(srv, expected, tcp)
    row["identity"] = srv.identity()
    srv.remove()
    print(json.dumps(row), flush=True)
    return row


def criu_log(ref: str, name: str, cache: Path, out: Path, servers: list[Server]) -> dict:
    """One more replica like (c), restored with --keep so that Podman leaves
    CRIU's restore.log (its own timestamps: where CRIU's part of the restore
    goes), copied into ``out``; its row, not counted among the cases."""
    drop_caches()
    row = {"case": "f like c, CRIU's log kept (--keep)",
           **restore(ref, name, cache, time.time(), extra=("--keep",))}
    servers.append(Server(name))
    userdata = sh("podman", "inspect", "-f", "{{.StaticDir}}", name).stdout.strip()
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(Path(userdata) / "restore.log", out / "restore.log")
    # CRIU's images but the pages (a few MB): what pre-restore plans the fill from,
    # for a profile off the GPU machine (their sizes in pages-sizes.json)
    images = Path(userdata) / "checkpoint"
    shutil.copytree(images, out / "images", symlinks=True, dirs_exist_ok=True,
                    ignore=lambda _, names: [n for n in names if n.startswith("pages-")])
    (out / "images" / "pages-sizes.json").write_text(json.dumps(
        {p.name: p.stat().st_size if p.exists() else None  # a link Podman's cleanup cut
         for p in images.glob("pages-*.img")}))
    print(json.dumps(row), flush=True)
    return row


def beyond_driver(row: dict) -> dict | None:
    """What a replica restored alone spent beyond the driver's restore of its GPU
    memory (issue 40's mark: at most 1.0x that restore); None for replicas
    restored together (their journal events interleave) and rows without it."""
    driver = [e[2]["timing"]["restore"] for e in row.get("timeline") or []
              if e[1] == "resumed" and "restore" in (e[2].get("timing") or {})]
    if row.get("together") or len(driver) != 1 or not driver[0]:
        return None
    seconds = row["first_answer_s"] - driver[0]
    return {"seconds": round(seconds, 3), "driver_s": driver[0],
            "ratio": round(seconds / driver[0], 2)}


def report(result: dict) -> None:
    print(f"\ncold start against restore, {result['gib']:g} GiB of weights "
          f"(network {result['network']}):")
    for r in result["rows"]:
        phases = ", ".join(f"{k} {v}" for k, v in r["phases"].items())
        extra = f"; fetched {r['bytes_fetched'] / 1e9:.2f} GB" if r.get("bytes_fetched") is not None \
            else ""
        print(f"  {r['case']:<24} first answer {r['first_answer_s']:7.2f} s  ({phases}{extra})")
    for case, x in result["speedup_vs_cold"].items():
        print(f"  {case}: {x}x faster than a cold start")
    for case, x in result.get("speedup_vs_warm_compile_cache", {}).items():
        print(f"  {case}: {x}x faster than a cold start with a warm compile cache")
    for case, b in result.get("beyond_driver", {}).items():
        print(f"  {case}: {b['seconds']:.2f} s beyond the driver's restore ({b['driver_s']:.2f} s): "
              f"{b['ratio']}x it")


def main() -> int:
    # A `timeout` around the bench: the replicas and the registry are still removed.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gib", type=float, default=8)
    ap.add_argument("--server", default="plain", choices=("plain", "compiled"),
                    help="compiled: torch.compile + CUDA graphs at start-up, cold-started "
                         "with an empty and with a warm compile cache")
    ap.add_argument("--network", default="bridge", choices=("bridge", "none"))
    ap.add_argument("--no-tcp", dest="tcp", action="store_false",
                    help="the server's unix socket only (CRIU < 4.2 cannot dump TCP sockets "
                         "on Linux >= 6.16)")
    ap.add_argument("--ram-gib", type=int, default=40, help="tmpfs for the registry's storage")
    ap.add_argument("--out", required=True)
    ap.add_argument("--repeat-warm", type=int, default=0, metavar="N",
                    help="(c) N more times, one after the other (its spread)")
    ap.add_argument("--compare-huge-pages", action="store_true",
                    help="(c) once more with the fill's huge pages turned off")
    ap.add_argument("--compare-agent", type=int, default=0, metavar="N",
                    help="(c) N more times with the CRIU-step agent turned off")
    ap.add_argument("--compare-read-ahead", type=int, default=0, metavar="N",
                    help="(c) N more times without reading ahead the file pages CRIU "
                         "copies on write")
    ap.add_argument("--criu-log", metavar="DIR",
                    help="restore one more replica with --keep and copy CRIU's restore.log here")
    args = ap.parse_args()
    need_gpusnap_python()
    result = run(args)
    Path(args.out).write_text(json.dumps(result, indent=2))
    report(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
