"""Shared helpers: run the installed CLI, start demo containers, read their counters."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import pytest

DEMO_IMAGE = "localhost/gpusnap-demo:latest"
GPUSNAP = "/usr/local/bin/gpusnap"
# Written to a new file and renamed: a reader never sees the file truncated and empty.
# /tmp/born: a token written once at start; a restore keeps it, a restart replaces it.
COUNTER = "cat /proc/sys/kernel/random/uuid > /tmp/born; i=0; while true; do i=$((i+1)); echo $i > /tmp/c.new; mv /tmp/c.new /tmp/c; sleep 0.05; done"
# COUNTER that also holds /tmp/hN open and renames it every ~10 ms: a
# --leave-running export, whose root filesystem Podman writes after the
# container ran on, misses the name CRIU recorded (ops/snapshot_files.py). The
# loop sleeps: one that forks without pause makes CRIU time out seizing it.
RENAMING_HOLDER = ("cat /proc/sys/kernel/random/uuid > /tmp/born; : > /tmp/h0; exec 3</tmp/h0; "
                   "i=0; while true; do j=$((i+1)); mv /tmp/h$i /tmp/h$j; i=$j; "
                   "echo $i > /tmp/c.new; mv /tmp/c.new /tmp/c; sleep 0.01; done")


def journal_path() -> Path:
    return Path(os.environ.get("GPUSNAP_STATE_DIR", "/run/gpusnap")) / "journal.jsonl"


def journal_mark() -> int:
    """Where the journal ends now: journal_since(mark) reads what came after."""
    try:
        return journal_path().stat().st_size
    except OSError:
        return 0  # a fresh host has none yet


def journal_since(mark: int) -> list[dict]:
    """The journal's events after ``mark`` (journal_mark); none where nothing was recorded."""
    try:
        with open(journal_path(), "rb") as f:
            f.seek(mark)
            return [json.loads(line) for line in f.read().decode().splitlines() if line.strip()]
    except FileNotFoundError:
        return []


def _criu_log_excerpt(log: Path, tail: int = 60) -> str:
    """CRIU's errors and the end of its log: at runc's and crun's log level
    the end of a failed freeze lists the stacks of the tasks that would not freeze."""
    lines = log.read_text(errors="replace").splitlines()
    errors = [line for line in lines[:-tail] if "Error" in line or "Timeout" in line]
    return "\n".join(errors[-20:] + ["..."] + lines[-tail:] if errors else lines[-tail:])


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test shows the CRIU logs gpusnap kept while it ran (journal.keep_log):
    a flake in CI leaves its cause in the CI log, not in a machine since gone."""
    report = yield
    if report.failed:
        logs = Path(os.environ.get("GPUSNAP_STATE_DIR", "/run/gpusnap")) / "logs"
        try:
            kept = sorted(p for p in logs.glob("*.log") if p.stat().st_mtime >= call.start - 1)
        except OSError:
            kept = []
        for log in kept[-3:]:
            report.sections.append((f"CRIU log kept in {log}", _criu_log_excerpt(log)))
    return report


@pytest.fixture(scope="session", autouse=True)
def permissive_trust_policy(tmp_path_factory) -> Path:
    """Restores from the test registries take unsigned checkpoints: a session
    policy accepting anything (GPUSNAP_POLICY, inherited by every gpusnap the
    tests start). tests/integration/test_registry_trust.py sets its own per test."""
    path = tmp_path_factory.mktemp("trust") / "policy.json"
    path.write_text(json.dumps({"default": {"type": "insecureAcceptAnything"}}))
    os.chmod(path, 0o644)  # as root, a policy others can write is refused
    before = os.environ.get("GPUSNAP_POLICY")
    os.environ["GPUSNAP_POLICY"] = str(path)
    yield path
    if before is None:
        os.environ.pop("GPUSNAP_POLICY", None)
    else:
        os.environ["GPUSNAP_POLICY"] = before


@pytest.fixture(scope="session", autouse=True)
def pages_kept_only_where_asked():
    """A restore keeps the pages it wrote in RAM for the next replica
    (pages/prepared_pages.keep): across hundreds of tests that would be GBs of
    this VM's RAM and folders other tests' restores would find. Off here
    (GPUSNAP_KEEP_PAGES=0); the tests of it turn it on."""
    before = os.environ.get("GPUSNAP_KEEP_PAGES")
    os.environ["GPUSNAP_KEEP_PAGES"] = "0"
    yield
    if before is None:
        os.environ.pop("GPUSNAP_KEEP_PAGES", None)
    else:
        os.environ["GPUSNAP_KEEP_PAGES"] = before


# Past this a command fails its test naming itself (TimeoutExpired), before
# pytest-timeout's 900 s would fail it with a stack; a test may pass its own.
RUN_BOUND_S = 600


def run(cmd: list[str], check: bool = False, **kw) -> subprocess.CompletedProcess:
    kw.setdefault("timeout", RUN_BOUND_S)
    res = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if check and res.returncode != 0:
        raise AssertionError(f"{cmd} failed ({res.returncode}):\n{res.stdout}\n{res.stderr}")
    return res


def gpusnap(*args: str, check: bool = False, env: dict | None = None) -> subprocess.CompletedProcess:
    return run([GPUSNAP, *args], check=check, env=env)


def gpusnap_json(*args: str) -> dict:
    res = gpusnap(*args, "--json", check=True)
    return json.loads(res.stdout)


def podman(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return run(["podman", *args], check=check)


def read_counter(name: str) -> int:
    out = podman("exec", name, "cat", "/tmp/c").stdout.strip()
    return int(out)


def wait_counter(name: str, above: int, timeout: float = 10.0) -> int:
    deadline = time.monotonic() + timeout
    value = -1
    while time.monotonic() < deadline:
        try:
            value = read_counter(name)
        except (AssertionError, ValueError):
            value = -1
        if value > above:
            return value
        time.sleep(0.05)
    raise AssertionError(f"counter of {name} stayed at {value}, expected > {above}")


def born(name: str) -> str:
    """The token the container's process wrote when it started (COUNTER)."""
    return podman("exec", name, "cat", "/tmp/born").stdout.strip()


def assert_continued(name: str, before: int, token: str, timeout: float = 10.0) -> int:
    """``name`` runs the process that counted to ``before`` (read before the
    checkpoint) and wrote ``token``: restored, not started again. A fresh start
    writes a new token and counts from 1. Returns the first value read."""
    first = wait_counter(name, -1, timeout)  # up: the token is written before the first count
    assert born(name) == token, f"{name} was started afresh, not restored (new /tmp/born)"
    assert first >= before, f"{name} counted from {first}, below {before}: started afresh"
    return first


def assert_one_line_error(res: subprocess.CompletedProcess, *needles: str,
                          hint: str | None = None) -> None:
    """Exit 1, an 'Error:' line that names the problem, and no traceback;
    ``hint``: the '->' line under it (what to do next) says this."""
    assert res.returncode == 1, (res.returncode, res.stdout, res.stderr)
    assert "Traceback" not in res.stderr + res.stdout
    # a deprecated flag's note may come first; then the error, its hint, nothing else
    lines = [line for line in res.stderr.strip().splitlines() if not line.startswith("Note: ")]
    assert lines and lines[0].startswith("Error: "), res.stderr
    for needle in needles:
        assert needle in res.stderr, (needle, res.stderr)
    if hint is not None:
        assert len(lines) == 2 and lines[1].lstrip().startswith("->") and hint in lines[1], \
            (hint, res.stderr)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch) -> Path:
    """The test's own chunk cache (GPUSNAP_CACHE_DIR): a blob cached by one test
    must not hide another's failure."""
    d = tmp_path / "chunk-cache"
    monkeypatch.setenv("GPUSNAP_CACHE_DIR", str(d))
    return d


@pytest.fixture
def name() -> str:
    n = f"gpusnap-test-{uuid.uuid4().hex[:8]}"
    yield n
    run(["podman", "rm", "-f", "-t", "0", n])


@pytest.fixture
def counter(name: str) -> str:
    """A running demo container counting in /tmp/c."""
    podman("run", "-d", "--name", name, "--network", "none", DEMO_IMAGE, "sh", "-c", COUNTER)
    wait_counter(name, 3)
    return name


def have_podman() -> bool:
    return shutil.which("podman") is not None and Path(GPUSNAP).exists()


def foreign_h100_manifest():
    """A GPU manifest naming an H100 that no test host has (refusals are tested with it)."""
    from gpusnap.gpu.manifest import Manifest, ManifestProcess

    uuid = "GPU-6288d6a6-619c-49d1-a845-a5381d6fe0c6"
    return Manifest(
        gpus=[{"index": 0, "uuid": uuid, "name": "NVIDIA H100 80GB HBM3", "minor": 0,
               "pci_bus_id": "00000000:18:00.0", "memory_total": 85520809984,
               "compute_capability": "9.0", "mig_enabled": False}],
        processes=[ManifestProcess(pid=7, comm="python3", gpus=[uuid], gpu_memory={uuid: 2 << 30})],
        driver_version="580.159.04", cuda_driver_version="13.0", criu_version="4.1.1",
        quiesced_by="gpusnap", host={"hostname": "gpu-host", "kernel": "6.18", "arch": "x86_64"})


def with_gpu_manifest(export: Path, tmp_path: Path) -> Path:
    """``export`` with a GPU manifest naming an H100 no test host has, as if its
    processes had been CUDA processes gpusnap quiesced."""
    from gpusnap import MANIFEST_NAME

    root = tmp_path / "unpacked"
    root.mkdir()
    run(["tar", "-I", "zstd", "-xf", str(export), "-C", str(root)], check=True)
    (root / "checkpoint" / MANIFEST_NAME).write_text(foreign_h100_manifest().to_json())
    out = tmp_path / "gpu.tar.zst"
    run(["tar", "-I", "zstd", "-cf", str(out), "-C", str(root), "."], check=True)
    return out
