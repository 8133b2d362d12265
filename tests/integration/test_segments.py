"""Big files pushed by segments in worker processes (gpusnap/oci/segments.py):
the same chunks as the one-stream path, the same bytes back."""

from __future__ import annotations

import hashlib
import shutil
import json
import subprocess
import tarfile
import uuid
from pathlib import Path

import pytest

from tests.conftest import GPUSNAP, assert_one_line_error, journal_mark, journal_since, run
from tests.integration.oci_registry import PASSWORD, make_large_checkpoint

pytestmark = pytest.mark.usefixtures("cache_dir")


@pytest.fixture(autouse=True)
def two_workers(monkeypatch):
    """Workers are off by default on hosts of fewer than 8 cores (CI has 2)."""
    monkeypatch.setenv("GPUSNAP_PROCESSES", "2")


def _push(registry, source: Path, ref: str) -> dict:
    res = run([GPUSNAP, "push", str(source), ref, *registry.flags(), "--json"],
              input=PASSWORD + "\n")
    assert res.returncode == 0, (res.stdout, res.stderr)
    return json.loads(res.stdout)


def _sha(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def test_segments_cut_as_one_stream_does_and_come_back_whole(registry, tmp_path):
    ckpt = tmp_path / "ckpt"
    make_large_checkpoint(ckpt, 600 << 20)
    repo = registry.ref(f"ckpt/segments-{uuid.uuid4().hex[:8]}")
    first = _push(registry, ckpt, f"{repo}:dir")
    assert first["processes"] >= 2 and first["parallel_bytes"] == 600 << 20, first

    # The same files as an archive: read in one stream by this process. Every
    # chunk of the pages must be one the first push made (nothing new is sent).
    archive = tmp_path / "ckpt.tar.zst"
    subprocess.run(f"tar -C {ckpt} -cf - . | zstd -q -1 -o {archive}", shell=True, check=True)
    second = _push(registry, archive, f"{repo}:archive")
    assert second["parallel_bytes"] == 0, second
    assert second["bytes_sent"] < 1 << 20, second  # the small files' chunks at most

    out = tmp_path / "pulled.tar.zst"
    res = run([GPUSNAP, "pull", first["pinned"], "-o", str(out), "--json", *registry.flags()],
              input=PASSWORD + "\n")
    assert res.returncode == 0, (res.stdout, res.stderr)
    pulled = json.loads(res.stdout)
    assert pulled["processes"] >= 2, pulled  # pages-1.img came through the fetch workers
    plain = tmp_path / "pulled.tar"
    subprocess.run(["zstd", "-q", "-d", str(out), "-o", str(plain)], check=True)
    with tarfile.open(plain) as tar:
        tar.extract("checkpoint/pages-1.img", tmp_path / "x", filter="data")
    assert _sha(tmp_path / "x" / "checkpoint" / "pages-1.img") == _sha(ckpt / "checkpoint" / "pages-1.img")


def _moved(pid: int) -> int:
    """Bytes the process has read and written so far (/proc/PID/io); 0 once gone."""
    try:
        io = dict(line.split(": ") for line in Path(f"/proc/{pid}/io").read_text().splitlines())
    except OSError:
        return 0
    return int(io["rchar"]) + int(io["wchar"])


def _workers_of(pid: int) -> list[int]:
    """The CLI's spawned worker processes (multiprocessing's spawn_main children)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmd = (stat.parent / "cmdline").read_bytes()
        except OSError:
            continue
        if int(fields[1]) == pid and b"spawn_main" in cmd:
            found.append(int(stat.parent.name))
    return found


@pytest.mark.parametrize("verb", ["push", "pull"])
def test_a_worker_killed_mid_transfer_is_one_line_and_the_rerun_completes(registry, tmp_path,
                                                                         verb):
    """A worker process SIGKILLed (the OOM killer's way) fails the push or pull
    with one line, leaves no archive, and the same command run again completes."""
    import os
    import signal
    import time

    ckpt = tmp_path / "ckpt"
    make_large_checkpoint(ckpt, 600 << 20, seed=uuid.uuid4().int % 10**6)
    ref = registry.ref(f"ckpt/killed-{verb}-{uuid.uuid4().hex[:8]}:v1")
    out = tmp_path / "pulled.tar"
    if verb == "pull":
        _push(registry, ckpt, ref)
        args = ["pull", ref, "-o", str(out), "--no-cache"]
    else:
        args = ["push", str(ckpt), ref]
    proc = subprocess.Popen([GPUSNAP, *args, *registry.flags()], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdin.write(PASSWORD + "\n")
    proc.stdin.close()
    proc.stdin = None
    deadline = time.monotonic() + 120
    while not (workers := _workers_of(proc.pid)) and proc.poll() is None:
        assert time.monotonic() < deadline, "no worker process started"
        time.sleep(0.05)
    assert workers, f"{verb} ended before a worker was seen"
    start = _moved(workers[0])
    while _moved(workers[0]) < start + (1 << 20) and proc.poll() is None:  # at work on a segment
        assert time.monotonic() < deadline, "the worker moved no data"
        time.sleep(0.01)
    os.kill(workers[0], signal.SIGKILL)
    stdout, stderr = proc.communicate(timeout=300)
    res = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    assert_one_line_error(res, "worker process died")
    assert not out.exists() and not list(tmp_path.glob(".pulled.tar*"))
    again = run([GPUSNAP, *args, *registry.flags(), "--json"], input=PASSWORD + "\n")
    assert again.returncode == 0, (again.stdout, again.stderr)
    if verb == "pull":
        with tarfile.open(out) as tar:
            tar.extract("checkpoint/pages-1.img", tmp_path / "x", filter="data")
        assert _sha(tmp_path / "x" / "checkpoint" / "pages-1.img") == \
            _sha(ckpt / "checkpoint" / "pages-1.img")


# A shell holding ~280 MB of base64 text in a variable (anonymous memory, so
# CRIU's pages-*.img, not /dev/shm's tar) answers "md5 of it" on request.
# Only shell builtins in the loop: busybox runs mv, rm and sleep in a forked
# child, and a dump that caught one before its exec held the ~290 MB twice (the
# prepared-pages test then found half of it prepared: the CI flake of
# 2026-11-26; and memory two tasks map at one range is left to CRIU, so no page
# fill). The wait is `read -t` on a FIFO nobody writes. /tmp/c may be read half
# written: wait_counter retries.
_BIG_MEMORY = ("mkfifo /tmp/w; exec 3<>/tmp/w; "
               "x=$(head -c 210m /dev/urandom | base64 -w 0); i=0; while true; do i=$((i+1)); "
               "echo $i > /tmp/c; "
               "if [ -e /tmp/flip ]; then rm /tmp/flip; x=\"${x%?}!\"; fi; "
               "if [ -e /tmp/grow ]; then rm /tmp/grow; y=$(head -c 3m /dev/urandom | base64); fi; "
               "if [ -e /tmp/ask ]; then rm /tmp/ask; echo -n \"$x\" | md5sum > /tmp/sum.new; "
               "mv /tmp/sum.new /tmp/sum; fi; read -t 0.05 _ <&3; done")


def _events_since(mark: int) -> list[str]:
    return [e["event"] for e in journal_since(mark)]


def _md5_of_memory(name: str) -> str:
    import time

    subprocess.run(["podman", "exec", name, "sh", "-c", "rm -f /tmp/sum; touch /tmp/ask"],
                   check=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        res = subprocess.run(["podman", "exec", name, "sh", "-c", "cat /tmp/sum"],
                             capture_output=True, text=True)
        if res.returncode == 0 and res.stdout.strip():
            return res.stdout.split()[0]
        time.sleep(0.5)
    raise AssertionError(f"{name} did not answer with the md5 of its memory")


def _start_big_memory(name: str) -> str:
    """A container running _BIG_MEMORY, counting; the md5 of its memory."""
    from tests.conftest import DEMO_IMAGE, wait_counter

    subprocess.run(["podman", "run", "-d", "--name", name, "--network", "none", DEMO_IMAGE,
                    "sh", "-c", _BIG_MEMORY], check=True, capture_output=True)
    wait_counter(name, 3, timeout=120)
    return _md5_of_memory(name)


def test_big_process_memory_moves_beside_podmans_tars_and_comes_back_whole(registry, name):
    """migrate + restore REF of a container with ~300 MB of process memory: the
    pages file leaves the export as a symlink (post-dump), is fetched by the
    workers straight into its file beside the import, and CRIU's pre-restore
    puts it in place; the process's memory is the same afterwards."""
    import time

    before = _start_big_memory(name)
    mark = journal_mark()
    ref = registry.ref(f"ckpt/big-memory-{uuid.uuid4().hex[:8]}:v1")
    res = run([GPUSNAP, "migrate", name, ref, *registry.flags(), "--json"], input=PASSWORD + "\n")
    assert res.returncode == 0, (res.stdout, res.stderr)
    pushed = json.loads(res.stdout)
    assert pushed["parallel_bytes"] >= 256 << 20, pushed  # the pages file, by the workers
    subprocess.run(["podman", "rm", name], check=True, capture_output=True)
    res = run([GPUSNAP, "restore", pushed["pinned"], *registry.flags(), "--json"],
              input=PASSWORD + "\n")
    assert res.returncode == 0, (res.stdout, res.stderr)
    pulled = json.loads(res.stdout)["pull"]
    assert pulled["pages_written_in_place"] >= 256 << 20, pulled
    events = _events_since(mark)
    assert "pages-aside" in events and "pages-in-place" in events, events
    # the ~290 MB were written into the restored shell by page_fill's threads, not by CRIU
    assert "pages-filled" in events, events
    # by the agent the CLI started before Podman, which took CRIU's pre-restore
    assert "agent-taken" in events, events
    time.sleep(0.2)
    assert _md5_of_memory(name) == before
    left = [p for d in (Path("/var/lib/containers"), Path("/var/tmp"))
            for p in d.glob(".gpusnap-pull-*") if any(p.glob("pages-*.img"))]
    assert not left, left  # the pages folder goes with the restore


def test_pages_prepared_by_a_prefetch_are_the_parent_of_the_final_round_and_linked_for_replicas(
        registry, name):
    """Pre-copy of a container with ~300 MB of process memory: `pull --prefetch`
    of round 1 writes its pages file out (pages/prepared_pages.py); the restore of
    the final round reads it as CRIU's parent, writing only the pages it lacks
    (pages/parent_pages.py), and the process's memory is as before. A prefetch of the final round prepares it
    again, and two replicas restored from it link that file: nothing written."""
    before = _start_big_memory(name)
    repo = registry.ref(f"ckpt/prepared-{uuid.uuid4().hex[:8]}")
    flags = [*registry.flags(), "--json"]
    replicas = [f"{name}-r{n}" for n in (1, 2)]
    made: list[Path] = []  # prepared folders: GBs of RAM on a real host, removed whatever happens
    try:
        res = run([GPUSNAP, "migrate", "-P", name, f"{repo}:pre", *flags], input=PASSWORD + "\n")
        assert res.returncode == 0, (res.stdout, res.stderr)
        res = run([GPUSNAP, "pull", "--prefetch", json.loads(res.stdout)["pinned"], *flags],
                  input=PASSWORD + "\n")
        assert res.returncode == 0, (res.stdout, res.stderr)
        prepared = json.loads(res.stdout)["prepared"]
        assert prepared and prepared["bytes"] >= 256 << 20, prepared
        folder = Path(prepared["folder"])
        made.append(folder)
        assert (folder / "index.json").is_file() and (folder / "pages-1.img").is_file()
        res = run([GPUSNAP, "migrate", name, f"{repo}:final", *flags], input=PASSWORD + "\n")
        assert res.returncode == 0, (res.stdout, res.stderr)
        final = json.loads(res.stdout)["pinned"]
        subprocess.run(["podman", "rm", name], check=True, capture_output=True)
        mark = journal_mark()
        res = run([GPUSNAP, "restore", final, *flags], input=PASSWORD + "\n")
        assert res.returncode == 0, (res.stdout, res.stderr)
        assert "pages-filled" in _events_since(mark)  # read by page_fill through two parents
        pulled = json.loads(res.stdout)["pull"]
        took = pulled["pages_prepared"]
        # whole, not pytest's cut repr: pages_prepared_skipped says why when it was not taken
        # round 1's folder is CRIU's parent: only pages it lacks were written
        assert took and took["how"] == "parent" and took["folder"] == str(folder), \
            json.dumps(pulled)
        assert took["bytes_reused"] >= 200 << 20, took  # the base64 text lay where it was
        assert pulled["pages_written_in_place"] < 64 << 20, pulled
        assert not folder.exists()  # spent by the restore
        assert _md5_of_memory(name) == before

        res = run([GPUSNAP, "pull", "--prefetch", final, *flags], input=PASSWORD + "\n")
        assert res.returncode == 0, (res.stdout, res.stderr)
        folder = Path(json.loads(res.stdout)["prepared"]["folder"])
        made.append(folder)
        for replica in replicas:
            res = run([GPUSNAP, "restore", final, "--name", replica, *flags],
                      input=PASSWORD + "\n")
            assert res.returncode == 0, (res.stdout, res.stderr)
            pulled = json.loads(res.stdout)["pull"]
            assert (pulled["pages_prepared"] or {}).get("how") == "linked", json.dumps(pulled)
            assert pulled["pages_written_in_place"] == 0, pulled
            assert _md5_of_memory(replica) == before
        assert (folder / "pages-1.img").is_file()  # still there for the next replica
    finally:
        subprocess.run(["podman", "rm", "-f", *replicas], capture_output=True)
        for folder in made:
            shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.parametrize("workers", ["2", "0"])
def test_the_first_replicas_pages_are_kept_and_the_next_replica_links_them(registry, name,
                                                                            workers, monkeypatch):
    """`gpusnap restore REF --name r1` writes the pages file anew (nothing
    prepared on this host) and keeps it in RAM as REF's prepared folder; `--name
    r2` links it, writing nothing, and both hold the source's memory while the
    source runs on. Also with no worker processes (hosts under 8 cores), where
    the pages file went through the pipe and r2 wrote it anew, linking nothing."""
    import os

    monkeypatch.setenv("GPUSNAP_PROCESSES", workers)
    before = _start_big_memory(name)
    ref = registry.ref(f"ckpt/kept-{uuid.uuid4().hex[:8]}:v1")
    flags = [*registry.flags(), "--json"]
    env = {**os.environ, "GPUSNAP_KEEP_PAGES": "auto"}
    replicas = [f"{name}-r{n}" for n in (1, 2)]
    kept = None
    try:
        res = run([GPUSNAP, "push", name, ref, *flags], input=PASSWORD + "\n")
        assert res.returncode == 0, (res.stdout, res.stderr)
        pinned = json.loads(res.stdout)["pinned"]
        res = run([GPUSNAP, "restore", pinned, "--name", replicas[0], *flags],
                  input=PASSWORD + "\n", env=env)
        assert res.returncode == 0, (res.stdout, res.stderr)
        pulled = json.loads(res.stdout)["pull"]
        if workers != "0":
            assert pulled["pages_written_in_place"] >= 256 << 20, pulled
        # nothing was prepared before r1: its own kept folder is not taken for one
        assert "100%" not in (pulled["pages_prepared_skipped"] or ""), pulled
        kept = pulled["pages_kept"]
        assert kept and kept["bytes"] >= 256 << 20, json.dumps(pulled)
        assert (Path(kept["folder"]) / "pages-1.img").is_file()
        res = run([GPUSNAP, "restore", pinned, "--name", replicas[1], *flags],
                  input=PASSWORD + "\n", env=env)
        assert res.returncode == 0, (res.stdout, res.stderr)
        pulled = json.loads(res.stdout)["pull"]
        assert (pulled["pages_prepared"] or {}).get("how") == "linked", json.dumps(pulled)
        assert pulled["pages_written_in_place"] == 0 and pulled["pages_kept"] is None, pulled
        for replica in replicas:
            assert _md5_of_memory(replica) == before
        assert _md5_of_memory(name) == before  # the source ran on
    finally:
        subprocess.run(["podman", "rm", "-f", *replicas], capture_output=True)
        if kept:
            shutil.rmtree(kept["folder"], ignore_errors=True)


def test_a_running_containers_pages_left_in_podmans_folder_are_read_to_the_end(registry, name):
    """`migrate -P` where CRIU's pages stay in Podman's checkpoint folder (no
    action script moves them: GPUSNAP_PAGES_ASIDE=0 here, crun < 1.26 in the
    field): the dump is stale once the export is written and is dropped then,
    while the push's workers still read it by segments. They read the files
    the push holds open; the pushed checkpoint restores with the same memory.
    (Under trixie's crun 1.21 this ended in a worker's FileNotFoundError.)"""
    import os

    before = _start_big_memory(name)
    repo = registry.ref(f"ckpt/left-{uuid.uuid4().hex[:8]}")
    env = {**os.environ, "GPUSNAP_PAGES_ASIDE": "0"}
    res = run([GPUSNAP, "migrate", "-P", name, f"{repo}:pre", *registry.flags(), "--json"],
              input=PASSWORD + "\n", env=env)
    assert res.returncode == 0, res.stderr
    pushed = json.loads(res.stdout)
    assert pushed["parallel_bytes"] >= 256 << 20, pushed  # read by the workers
    copy = f"{name}-copy"  # round 1 of a pre-copy restores as a copy; the source runs on
    try:
        res = run([GPUSNAP, "restore", pushed["pinned"], "--name", copy, *registry.flags(),
                   "--json"], input=PASSWORD + "\n")
        assert res.returncode == 0, res.stdout + res.stderr
        assert _md5_of_memory(copy) == before
    finally:
        subprocess.run(["podman", "rm", "-f", "-t", "0", copy], capture_output=True)
