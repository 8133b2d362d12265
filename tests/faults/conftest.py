"""Fault scenarios through the registry phases: a loopback plain-HTTP registry per
test, a demo container whose memory makes each phase last long enough to be
interrupted, and the helpers the scenarios share."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import uuid
from pathlib import Path
from typing import Callable

import pytest

from tests.conftest import (COUNTER, DEMO_IMAGE, GPUSNAP, gpusnap, have_podman, podman,
                            read_counter, wait_counter)
from tests.faults.netreg import PlainRegistry, make_registry

HERE = Path(__file__).parent
# Random (incompressible) memory: on 2 cores the export takes ~1 s, the push ~3 s,
# the pull ~1-2 s: windows wide enough to land a kill inside each.
FILL_MIB = 160


def pytest_collection_modifyitems(config, items):
    mine = [item for item in items if HERE in Path(item.fspath).parents]
    for item in mine:
        item.add_marker(pytest.mark.integration)
    if mine and not have_podman():
        raise pytest.UsageError("fault tests need `make install` (podman and gpusnap)")


@pytest.fixture
def registry(tmp_path) -> PlainRegistry:
    reg = make_registry(tmp_path / "registry")
    yield reg
    reg.stop()


@pytest.fixture(autouse=True)
def _own_cache(cache_dir) -> None:
    """Each test its own chunk cache (the target host's): nothing cached hides a fault."""


@pytest.fixture
def loaded(name: str) -> str:
    """A running counter with FILL_MIB of random memory in /dev/shm."""
    podman("run", "-d", "--name", name, "--network", "none", "--shm-size", f"{FILL_MIB + 32}m",
           DEMO_IMAGE, "sh", "-c",
           f"dd if=/dev/urandom of=/dev/shm/fill bs=1M count={FILL_MIB} 2>/dev/null; {COUNTER}")
    wait_counter(name, 3, timeout=60)
    return name


def unique_repo() -> str:
    return f"faults/t-{uuid.uuid4().hex[:8]}"


def status(name: str) -> str:
    res = podman("container", "inspect", name, "--format", "{{.State.Status}}", check=False)
    return res.stdout.strip() if res.returncode == 0 else "gone"


def start_cli(*args: str) -> subprocess.Popen:
    return subprocess.Popen([GPUSNAP, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def finished(proc: subprocess.Popen, timeout: float = 300) -> subprocess.CompletedProcess:
    out, err = proc.communicate(timeout=timeout)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def when(cond: Callable[[], bool], proc: subprocess.Popen, what: str, timeout: float = 120) -> None:
    """Wait until ``cond()`` holds while ``proc`` still runs; fail if it ended first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        if proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"the command ended (rc {proc.returncode}) before {what}: {err}")
        time.sleep(0.01)
    proc.kill()
    proc.wait(timeout=30)
    raise AssertionError(f"timed out waiting for {what}")


def sigkill(proc: subprocess.Popen) -> None:
    """SIGKILL the CLI alone (its children go on, as after a crash)."""
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    for stream in (proc.stdout, proc.stderr):
        stream.close()


def cached_blobs(cache: Path) -> int:
    return sum(1 for p in (cache / "blobs/sha256").glob("*/*") if p.is_file())


def tag_exists(reg: PlainRegistry, repo: str, tag: str) -> bool:
    res = subprocess.run(["oras", "manifest", "fetch", "--plain-http", reg.ref(f"{repo}:{tag}")],
                         capture_output=True, text=True, timeout=60)
    return res.returncode == 0


def settled(paths) -> None:
    """Wait until staging directories are idle long enough for doctor to call them left over."""
    from gpusnap.ops.leftovers import STAGING_IDLE_S

    for p in paths:
        try:
            time.sleep(max(0.0, p.stat().st_mtime + STAGING_IDLE_S + 0.5 - time.time()))
        except OSError:
            continue


def doctor_fix() -> dict:
    return json.loads(gpusnap("doctor", "--fix", "--json").stdout)


def doctor() -> dict:
    return json.loads(gpusnap("doctor", "--json").stdout)


def still_counting(name: str) -> int:
    assert status(name) == "running", status(name)
    return wait_counter(name, read_counter(name))


def wait_quiet(path: Path, timeout: float = 60) -> None:
    """Until no process names ``path`` (Podman and the FIFO pump outlive a killed CLI)."""
    from gpusnap.runtime.fifo_pump import referenced

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and referenced(str(path)):
        time.sleep(0.2)
    assert not referenced(str(path)), f"a process still works on {path}"


def say(capsys, text: str) -> None:
    """A figure for docs/reliability.md, shown with `pytest -s`-less runs too."""
    with capsys.disabled():
        print(f"\n  {text}", flush=True)


def criu_pids() -> list[int]:
    """Running CRIU processes, by their command line (is_criu)."""
    found = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                args = (d / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if is_criu(args):
                found.append(int(d.name))
    return found


def is_criu(args: list[bytes]) -> bool:
    """CRIU's command line; a dumping CRIU retitles itself "criu: dump ...", and
    may run under its own glibc's loader (packaging), so comm is not always criu."""
    return any(os.path.basename(a) == b"criu" or a.startswith(b"criu: ") for a in args)


def kill_criu_mid_dump(pid: int, proc: subprocess.Popen, timeout: float = 120,
                       after: float = 0.0) -> int:
    """SIGKILL CRIU ``after`` seconds after it seized ``pid`` (its tracer: the dump
    under way), while ``proc`` runs; the pid killed."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            break
        tracer = int(status.split("TracerPid:", 1)[1].split()[0])
        try:
            if tracer and is_criu(Path(f"/proc/{tracer}/cmdline").read_bytes().split(b"\0")):
                time.sleep(after)
                os.kill(tracer, signal.SIGKILL)
                return tracer
        except (OSError, ProcessLookupError):
            pass
        time.sleep(0.0005)
    raise AssertionError(f"CRIU never seized {pid} (command rc {proc.poll()})")


def kill_criu_mid_restore(proc: subprocess.Popen, timeout: float = 120) -> int:
    """SIGKILL a restoring CRIU once it has forked the container's tasks (its
    children other than the action script), while ``proc`` runs; the pid killed."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        for pid in criu_pids():
            try:
                kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
                restoring = [k for k in kids
                             if b"criu-action" not in Path(f"/proc/{k}/cmdline").read_bytes()]
            except OSError:
                continue
            if restoring:
                os.kill(pid, signal.SIGKILL)
                return pid
        time.sleep(0.001)
    raise AssertionError(f"CRIU never forked the tasks (command rc {proc.poll()})")


def kept_in(stderr: str) -> Path:
    """The archive a failed `migrate` names as all that is left of the container."""
    import re

    found = re.search(r"kept in (\S+)", stderr)
    assert found, stderr
    return Path(found.group(1))


def migrate_until_the_registry_dies(registry, name: str, repo: str) -> subprocess.CompletedProcess:
    """`gpusnap migrate NAME` to ``repo``, the registry SIGKILLed once 10 chunks are in;
    the command's result (it is left down: the caller starts it again)."""
    cli = start_cli("migrate", name, registry.ref(f"{repo}:v1"), *registry.flags())
    when(lambda: len(registry.linked_blobs(repo)) >= 10, cli, "10 chunks were uploaded",
         timeout=300)
    registry.kill()
    return finished(cli)
