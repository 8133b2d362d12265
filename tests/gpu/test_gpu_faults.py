"""Faults on the GPU path, at size: a CUDA container holding 8 GiB
(GPUSNAP_FAULT_GIB), and one thing killed or broken at one phase in each case.

Dump side, on one source container that every case must leave running with its
GPU data intact (or restorable from what is on disk, and restored):
the CLI killed while the driver holds the GPU locked, CRIU killed mid-dump,
the upload killed (foreground and detached), the registry killed mid-push, the
export's disk full. Restore side, on one checkpoint of such a container: the
registry killed mid-restore, the agent killed mid-fill, the target GPU taken
between the plan and the driver's restore, the restored container killed
during the driver's restore, `doctor --fix` run during it, the driver's restore
refused for memory (the container it cannot run on removed, the archive
unchanged; a local checkpoint kept until the GPU state is back), and the CLI
killed during it.

After each: the workers are the original ones (their seed) counting on from the
checkpoint, every element of their GPU data equal to the checkpoint's; no CUDA
process is left locked or checkpointed; no process outside a running container
holds GPU memory; `gpusnap doctor --fix` leaves nothing to report; and where a
command failed, the user saw one line saying what happened and what to type.
"""

from __future__ import annotations

import contextlib
import functools
import json
import shlex
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from gpusnap.gpu.cuda import CudaDriver, ProcessState
from gpusnap.ops.leftovers import staging_folders
from gpusnap.runtime import podman as rt_podman
from tests.conftest import (assert_one_line_error, gpusnap, gpusnap_json, journal_mark,
                            journal_since, podman)
from tests.faults.conftest import (cached_blobs, finished, kept_in, kill_criu_mid_dump,
                                   migrate_until_the_registry_dies, settled, sigkill,
                                   start_cli, unique_repo, wait_quiet, when)
from tests.faults.netreg import make_registry
from tests.gpu import harness

GIB = float(os.environ.get("GPUSNAP_FAULT_GIB", "8"))
STATE = Path(os.environ.get("GPUSNAP_STATE_DIR", "/run/gpusnap"))
pytestmark = pytest.mark.timeout(420)


# -- what every case checks afterwards ---------------------------------------------

_driver = functools.cache(CudaDriver)  # one per run: the probes ask it every 10 ms

def _status(name: str) -> str:
    res = podman("inspect", name, "--format", "{{.State.Status}}", check=False)
    return res.stdout.strip() if res.returncode == 0 else "gone"


def _container_of(pid: int) -> str | None:
    try:
        found = re.search(r"libpod-([0-9a-f]{64})", Path(f"/proc/{pid}/cgroup").read_text())
    except OSError:
        return None
    return found.group(1) if found else None


def _gpu_pids() -> list[int]:
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    return [int(p) for p in out.split()]


def assert_gpu_clean() -> None:
    """No CUDA process locked or checkpointed, none holding GPU memory outside a
    running container, and nothing left for `gpusnap doctor` after --fix.
    Staging folders are first left idle as long as doctor takes for in use: a
    push's pages folder in RAM, last written at its dump, can be younger than
    that when the restore that read it returns."""
    settled(staging_folders())
    gpusnap("doctor", "--fix", "--json")
    report = json.loads(gpusnap("doctor", "--json").stdout)
    assert report["stuck"] == [], report["stuck"]
    assert report["leftovers"] == [], report["leftovers"]
    running = set(podman("ps", "-q", "--no-trunc").stdout.split())
    for pid in _gpu_pids():
        assert _container_of(pid) in running, f"pid {pid} holds GPU memory outside a running container"
    driver = _driver()
    for cid in running:
        for pid in harness.host_pids(cid):
            assert driver.state(pid) == ProcessState.RUNNING, (cid, pid, driver.state(pid))


def _one_line(res: subprocess.CompletedProcess) -> str:
    """The failed command's own line (assert_one_line_error checked its shape)."""
    return res.stderr.strip().splitlines()[0]


def say(capsys, text: str) -> None:
    with capsys.disabled():
        print(f"\n  {text}", flush=True)


# -- the dump side: one source container, left running by every case --------------

@pytest.fixture(scope="module")
def held():
    ctrs: dict[str, harness.CudaContainer] = {}
    yield ctrs
    for ctr in ctrs.values():
        ctr.remove()


@pytest.fixture
def source(held) -> harness.CudaContainer:
    """The 8 GiB container, running and intact; a new one where a case before lost it
    (that case has failed already: the next ones still test their own fault)."""
    ctr = held.get("source")
    if ctr is not None and _status(ctr.name) != "running":
        ctr.remove()
        ctr = None
    if ctr is None:
        ctr = held["source"] = harness.start(nproc=1, gib=GIB)
    ctr.wait_running()
    ctr.pids = harness.host_pids(ctr.name)  # host pids: a restore gives the workers new ones
    return ctr


@pytest.fixture
def registry(tmp_path):
    """A registry per case, its storage removed after it: each push holds twice the
    GPU memory (the driver's copy and CRIU's), and a few fill the disk."""
    reg = make_registry(tmp_path / "registry")
    yield reg
    reg.stop()
    logs = os.environ.get("GPUSNAP_TEST_LOGS")
    if logs:  # the registry's side of a failure (a full disk answers 500 UNKNOWN)
        Path(logs).mkdir(parents=True, exist_ok=True)
        lines = (tmp_path / "registry" / "registry.log").read_text(errors="replace").splitlines()
        (Path(logs) / f"registry-{tmp_path.name}.log").write_text("".join(  # not the HEAD misses
            f"{ln}\n" for ln in lines if "blob unknown" not in ln and "manifest unknown" not in ln))
    shutil.rmtree(tmp_path / "registry", ignore_errors=True)


@pytest.fixture
def own_cache(cache_dir):
    """The case's chunk cache, removed after it (tens of GB at this size)."""
    yield cache_dir
    shutil.rmtree(cache_dir, ignore_errors=True)


def _locked_or_checkpointed(pids: list[int]) -> bool:
    """Whether the driver holds any of ``pids`` (a process gone counts: CRIU dumped it)."""
    driver = _driver()
    for pid in pids:
        if not Path(f"/proc/{pid}").exists():
            return True
        try:
            if driver.state(pid) != ProcessState.RUNNING:
                return True
        except Exception:  # ended between the two reads
            return True
    return False


def _back_running(ctr: harness.CudaContainer, its: list[int]) -> str:
    """The source as the fault left it, brought back where it stopped: 'running'
    or 'restored'. A stopped container's checkpoint is Podman's local one; the
    next checkpoint of it says how to get it back (the line a user would see)."""
    if _status(ctr.name) == "running":
        ctr.assert_restored(ctr.seeds, its)
        return "running"
    again = gpusnap("checkpoint", ctr.name)
    assert_one_line_error(again, "not running")
    assert f"gpusnap restore {ctr.name}" in again.stderr, again.stderr
    gpusnap_json("restore", ctr.name)
    ctr.assert_restored(ctr.seeds, its)
    return "restored"


def _settle(ctr: harness.CudaContainer, where: Path, timeout: float = 300) -> None:
    """Until Podman, CRIU and the pump left ``where`` and the container is running
    with its GPU back, or stopped (the guardian resumes survivors after CRIU)."""
    wait_quiet(where, timeout=timeout)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _status(ctr.name) != "running" or not _locked_or_checkpointed(ctr.pids):
            return
        time.sleep(0.2)
    raise AssertionError(f"{ctr.name} is still locked {timeout} s after the fault")


def test_cli_killed_while_the_driver_holds_the_gpu(source, tmp_path, capsys):
    its, pids = source.iterations(), source.pids
    cli = start_cli("checkpoint", source.name, "--export", str(tmp_path / "x.tar.zst"))
    when(lambda: _locked_or_checkpointed(pids), cli, "the GPU was locked", timeout=120)
    sigkill(cli)
    _settle(source, tmp_path)
    assert not (tmp_path / "x.tar.zst").exists(), "a half-written archive under its name"
    say(capsys, f"CLI killed with the GPU locked: the container was {_back_running(source, its)}")
    assert_gpu_clean()


def test_criu_killed_mid_dump(source, tmp_path, capsys):
    its = source.iterations()
    pid = source.pids[0]
    cli = start_cli("checkpoint", source.name, "--export", str(tmp_path / "x.tar.zst"))
    # a second into CRIU's dump of the process, its GPU memory already in it
    kill_criu_mid_dump(pid, cli, after=1.0)
    res = finished(cli)
    assert_one_line_error(res)
    _settle(source, tmp_path)
    say(capsys, f"CRIU killed mid-dump: {_one_line(res)} / the container was "
                f"{_back_running(source, its)}")
    assert_gpu_clean()


def _restore_ref_here(ctr: harness.CudaContainer, ref: str, its: list[int], *flags: str) -> None:
    podman("rm", ctr.name)
    for f in ctr.status.glob("w*"):  # the restored worker writes these afresh
        if not f.name.endswith(".born"):
            f.unlink()
    gpusnap_json("restore", ref, *flags)
    ctr.assert_restored(ctr.seeds, its)


def test_upload_killed_in_the_foreground(source, registry, capsys):
    repo = unique_repo()
    ref = registry.ref(f"{repo}:v1")
    mark = journal_mark()
    its = source.iterations()
    cli = start_cli("migrate", source.name, ref, *registry.flags())

    def checkpointed() -> list[dict]:
        return [e for e in journal_since(mark) if e.get("event") == "checkpointed"]

    when(lambda: len(registry.linked_blobs(repo)) >= 10 and bool(checkpointed()), cli,
         "10 chunks were uploaded and the checkpoint was complete", timeout=300)
    sigkill(cli)
    kept = Path(checkpointed()[0]["export"])
    wait_quiet(kept.parent)
    try:
        assert _status(source.name) == "exited"
        report = json.loads(gpusnap("doctor", "--json").stdout)
        shown = [c for c in report["checks"] if c["name"] == "kept checkpoints"][0]
        # doctor's own command, as printed: this push's reference and flags
        printed = re.search(r"`(gpusnap push [^`]+)` finishes the push", shown["fix"])
        assert str(kept) in shown["detail"] and printed and ref in printed.group(1), shown
        again = gpusnap_json(*shlex.split(printed.group(1))[1:])
        assert 0 < again["chunks_sent"] < again["chunks"], again
        _restore_ref_here(source, ref, its, *registry.flags())
        say(capsys, f"upload killed: doctor showed {shown['detail'][:80]}... / re-push sent "
                    f"{again['chunks_sent']} of {again['chunks']} chunks")
    finally:
        shutil.rmtree(kept.parent, ignore_errors=True)
    assert_gpu_clean()


def test_upload_killed_in_the_background(source, registry, capsys):
    from gpusnap.ops.uploads import alive

    repo = unique_repo()
    its = source.iterations()
    started = gpusnap_json("migrate", source.name, registry.ref(f"{repo}:v1"), "-d",
                           *registry.flags())
    deadline = time.monotonic() + 300
    while len(registry.linked_blobs(repo)) < 10 and time.monotonic() < deadline:
        time.sleep(0.01)
    os.kill(registry.proc.pid, signal.SIGSTOP)  # the upload cannot finish while the kill is aimed
    try:
        live = gpusnap_json("status", started["id"])
        assert live["phase"] == "uploading", live
        os.kill(live["pid"], signal.SIGKILL)
        state_file = Path(started["state_file"])
        while alive(live["pid"], state_file):
            time.sleep(0.05)
    finally:
        os.kill(registry.proc.pid, signal.SIGCONT)
    export = Path(live["export"])
    try:
        res = gpusnap("status", started["id"], "--wait")
        # the pages lie aside (in RAM) with Podman's local checkpoint: that is what
        # the hint restores, no `podman rm` first; and the retry is the push's own
        assert_one_line_error(res, "the upload was killed",
                              hint=f"`gpusnap restore {source.name}` (its local checkpoint")
        assert f"`gpusnap push {export} {registry.ref(f'{repo}:v1')}" in res.stderr, res.stderr
        for f in source.status.glob("w*"):  # the restored worker writes these afresh
            if not f.name.endswith(".born"):
                f.unlink()
        gpusnap_json("restore", source.name)  # as the hint says
        source.assert_restored(source.seeds, its)
        say(capsys, f"background upload killed: {_one_line(res)}")
    finally:
        shutil.rmtree(export.parent, ignore_errors=True)
    assert_gpu_clean()


def test_registry_killed_mid_push(source, registry, capsys):
    repo = unique_repo()
    ref = registry.ref(f"{repo}:v1")
    its = source.iterations()
    res = migrate_until_the_registry_dies(registry, source.name, repo)
    assert_one_line_error(res, f"cannot reach registry {registry.host}",
                          f"{source.name} is checkpointed and stopped", "kept in")
    kept = kept_in(res.stderr)
    try:
        registry.start()
        gpusnap_json("push", str(kept), ref, *registry.flags())
        _restore_ref_here(source, ref, its, *registry.flags())
        say(capsys, f"registry killed mid-push: {_one_line(res)}")
    finally:
        shutil.rmtree(kept.parent, ignore_errors=True)
        if registry.proc.poll() is not None:
            registry.start()
    assert_gpu_clean()


def test_export_disk_full(source, tmp_path, capsys):
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512m", "tmpfs", str(small)], check=True)
    try:
        its = source.iterations()
        res = gpusnap("checkpoint", source.name, "--export", str(small / "x.tar.zst"),
                      "--skip-space-check")
        assert_one_line_error(res, "the disk is full", "kept locally")
        assert sorted(os.listdir(small)) == [], "a partial archive or a FIFO was left"
        say(capsys, f"export disk full: {_one_line(res)} / the container was "
                    f"{_back_running(source, its)}")
    finally:
        subprocess.run(["umount", "-l", str(small)])
    assert_gpu_clean()


# -- the restore side: one checkpoint, restored again after each fault ----------------

@pytest.fixture(scope="module")
def checkpoint(held, tmp_path_factory):
    """An 8 GiB container checkpointed to a file and removed: (container, archive,
    iterations at the checkpoint)."""
    # The dump side is over: its container and what it holds on disk make room
    # for this one's (the archive and Podman's images of 8 GiB: ~55 GB at once).
    if "source" in held:
        held.pop("source").remove()
    ctr = held["restored"] = harness.start(nproc=1, gib=GIB)
    archive = tmp_path_factory.mktemp("faults-archive") / "job.tar.zst"
    its = ctr.iterations()
    res = gpusnap("checkpoint", ctr.name, "--export", str(archive), "--json")
    assert res.returncode == 0, f"{res.stderr}\n{harness.room()}"
    podman("rm", ctr.name)
    return ctr, archive, its


@pytest.fixture
def gone(checkpoint):
    """The checkpoint's container removed, and its status files but the seeds with it."""
    ctr, archive, its = checkpoint
    subprocess.run(["podman", "rm", "-f", "-t", "0", ctr.name], capture_output=True, timeout=120)
    for f in ctr.status.glob("w*"):
        if not f.name.endswith(".born"):
            f.unlink()
    return checkpoint


def _restores_again(ctr: harness.CudaContainer, source: str, its: list[int], *flags: str) -> None:
    subprocess.run(["podman", "rm", "-f", "-t", "0", ctr.name], capture_output=True, timeout=120)
    gpusnap_json("restore", source, *flags)
    ctr.assert_restored(ctr.seeds, its)


def test_registry_killed_mid_restore(gone, registry, own_cache, capsys):
    ctr, archive, its = gone
    ref = registry.ref(f"{unique_repo()}:v1")
    gpusnap_json("push", str(archive), ref, *registry.flags())
    cli = start_cli("restore", ref, *registry.flags())
    when(lambda: cached_blobs(own_cache) >= 10, cli, "10 chunks were fetched", timeout=300)
    registry.kill()
    res = finished(cli)
    try:
        assert_one_line_error(res, f"cannot reach registry {registry.host}")
        assert _status(ctr.name) == "gone", "restored from a partial download"
    finally:
        registry.start()
    assert_gpu_clean()
    _restores_again(ctr, ref, its, *registry.flags())
    say(capsys, f"registry killed mid-restore: {_one_line(res)}")
    assert_gpu_clean()


def _agent_asked() -> Path | None:
    """An agent folder where a CRIU step waits on the agent's answer (the step's
    FIFO, packaging/bin/criu-action): that step is in the agent's hands."""
    for folder in (STATE / "actions").glob("*-agent"):
        if any(folder.glob("reply.*")):
            return folder
    return None


def test_agent_killed_mid_fill(gone, capsys):
    ctr, archive, its = gone
    mark = journal_mark()
    cli = start_cli("restore", str(archive))
    when(lambda: any(e.get("event") == "pages-fill-planned" for e in journal_since(mark))
         and _agent_asked() is not None, cli, "the agent was filling pages", timeout=300)
    folder = _agent_asked()
    os.kill(int((folder / "pid").read_text()), signal.SIGKILL)
    res = finished(cli)
    events = [e["event"] for e in journal_since(mark)]
    if res.returncode == 0:  # the fill had ended as the kill came: the script went on alone
        happened = "the restore finished"
        ctr.assert_restored(ctr.seeds, its)
    else:  # the script's own words (criu-action), not CRIU's "exited, status=1"
        assert_one_line_error(res, "gpusnap's agent", "restore it again")
        happened = _one_line(res)
        assert _status(ctr.name) in ("gone", "exited", "created"), _status(ctr.name)
        assert_gpu_clean()
        _restores_again(ctr, str(archive), its)
    say(capsys, f"agent killed mid-fill: {happened} (journal: {events[-6:]})")
    assert_gpu_clean()


def test_target_gpu_taken_between_plan_and_restore(gone, capsys):
    ctr, archive, its = gone
    gpus = harness.gpu_count()
    target = 1 if gpus > 1 else 0
    flags = ["--gpu-map", "0=1"] if target else []
    hog = harness.Hog(target)
    try:
        mark = journal_mark()
        cli = start_cli("restore", str(archive), *flags)
        when(lambda: any(e.get("event") == "import-started" for e in journal_since(mark)), cli,
             "the plan was made and Podman started the import", timeout=300)
        hog.take(harness.gpu_memory_free(target) - int(GIB / 2 * (1 << 30)))
        res = finished(cli)
        assert_one_line_error(res)
        assert _status(ctr.name) in ("gone", "exited", "created"), _status(ctr.name)
        assert_gpu_clean()
    finally:
        hog.remove()
    _restores_again(ctr, str(archive), its, *flags)
    say(capsys, f"GPU {target} taken after the plan: {_one_line(res)}")
    assert_gpu_clean()


def _containers_now() -> dict[str, list[int]]:
    """Each container's processes, by the libpod cgroup they are in. Read from
    /proc, not asked of Podman: `podman inspect` waits on the container's lock,
    which the restore holds until its end."""
    out: dict[str, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            cid = _container_of(int(d.name))
            if cid:
                out.setdefault(cid, []).append(int(d.name))
    return out


def _held_by_driver(pids: list[int]) -> bool:
    """Whether one of ``pids`` is a CUDA process the driver has not given back yet."""
    driver = _driver()
    for pid in pids:
        try:
            if driver.state(pid) in (ProcessState.LOCKED, ProcessState.CHECKPOINTED):
                return True
        except Exception:  # not a CUDA process, or gone
            continue
    return False


def _resuming(mark, before: set[str], found: list[int]):
    """A probe: CRIU has restored the processes and filled their pages, and
    post-resume (the driver's restore) is in the agent's hands, or the driver
    still holds them; the new container's processes go into ``found``."""
    def probe() -> bool:
        if "pages-filled" not in {e.get("event") for e in journal_since(mark)}:
            return False
        new = [pids for cid, pids in _containers_now().items() if cid not in before]
        if new and (_agent_asked() is not None or _held_by_driver(new[0])):
            found.extend(new[0])
            return True
        return False
    return probe


def _restore_until_the_driver_restores(archive: Path) -> tuple[subprocess.Popen, list[int]]:
    """`gpusnap restore ARCHIVE` started and followed until the driver's restore
    is under way: the CLI, and the restored container's processes."""
    mark = journal_mark()
    before = set(_containers_now())
    cli = start_cli("restore", str(archive))
    found: list[int] = []
    when(_resuming(mark, before, found), cli, "the driver's restore had started", timeout=300)
    return cli, found


def test_restored_container_killed_during_the_driver_restore(gone, capsys):
    ctr, archive, its = gone
    cli, killed = _restore_until_the_driver_restores(archive)
    for pid in killed:  # as a power cut takes it: every process at once
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    res = finished(cli)
    if res.returncode == 0:
        happened = f"the restore reported success, the container {_status(ctr.name)}"
    else:  # CRIU dies with them (runc moved it into their cgroup): CRIU's end, not runc's EOF
        assert_one_line_error(res, "nothing was restored")
        assert "unixpacket" not in res.stderr, res.stderr
        happened = _one_line(res)
        left = re.search(r"is left \(.*\): `(podman rm -f \S+)`", res.stderr)
        if left:  # CRIU's cgroup yard, mounted in its userdata, outlived it: the line's
            # own command must clear it (G10 of 2026-11-29 saw the first removal fail)
            rm = subprocess.run(left.group(1).split(), capture_output=True, text=True,
                                timeout=120)
            assert rm.returncode == 0, f"{left.group(1)} as printed: {rm.stderr}"
    assert _status(ctr.name) != "running" or not harness.host_pids(ctr.name)
    assert_gpu_clean()
    _restores_again(ctr, str(archive), its)
    say(capsys, f"killed during the driver's restore ({len(killed)} processes): {happened}")
    assert_gpu_clean()


# select(2) and pselect6(2) on x86_64 (glibc's select is either): where the
# agent waits for CRIU's next step
SELECT = {"23", "270"}


def _agent_waiting_for_post_resume() -> int | None:
    """The restore's agent, stopped (SIGSTOP) in its wait for CRIU's next step
    once it has answered post-restore: the pid, or None where it is not there
    yet (it is let go again where it was not in that wait)."""
    for folder in (STATE / "actions").glob("*-agent"):
        try:
            pid = int((folder / "pid").read_text())
            # the agent itself, not a process that took the pid of one long gone
            if b"gpusnap.action.agent" not in Path(f"/proc/{pid}/cmdline").read_bytes():
                continue
        except (OSError, ValueError):
            continue
        if any(folder.glob("reply.*")):
            return None  # a step is in its hands: post-restore is not answered yet
        try:
            os.kill(pid, signal.SIGSTOP)
        except ProcessLookupError:
            continue
        try:
            deadline = time.monotonic() + 10
            while _state(pid) != "T" and time.monotonic() < deadline:
                time.sleep(0.001)
            # stopped inside select(2) it has not read post-resume's request: the
            # driver's restore has not begun (/proc/PID/syscall: its number first)
            if Path(f"/proc/{pid}/syscall").read_text().split()[0] in SELECT:
                return pid
        except (OSError, IndexError):
            pass
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
    return None


def _state(pid: int) -> str:
    """The process's state letter ("T": stopped), "" where it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def test_doctor_fix_during_the_driver_restore_leaves_it_to_the_restore(gone, capsys):
    """The restored processes wait checkpointed from CRIU's restore until the
    driver's; the restore's turn tells `doctor --fix` they are at work, so it
    neither resumes them onto the GPUs they were dumped on nor removes what
    the restore still reads. That wait lasts a second or two: the agent is
    stopped once it has answered post-restore, so the processes wait under
    its turn until doctor has left them (its 'doctor-left' event)."""
    ctr, archive, its = gone
    mark = journal_mark()
    cli = start_cli("restore", str(archive))
    agent: list[int] = []
    doctor = None
    try:
        restoring = _held_before_the_drivers_restore(cli, mark, agent)
        doctor = start_cli("doctor", "--fix", "--json")
        when(lambda: any(e.get("event") == "doctor-left" for e in journal_since(mark)), doctor,
             "doctor had left the processes to the restore", timeout=120)
    finally:
        for pid in agent:
            os.kill(pid, signal.SIGCONT)
    report = json.loads(finished(doctor).stdout)
    res = finished(cli)
    assert res.returncode == 0, res.stderr
    gpu = next(c for c in report["checks"] if c["name"] == "gpu processes")
    assert "left to gpusnap's restore" in gpu["detail"], gpu
    assert not set(report["fixed"]) & set(restoring), report["fixed"]
    ctr.assert_restored(ctr.seeds, its)
    say(capsys, f"doctor --fix during the driver's restore: {gpu['detail']}")
    assert_gpu_clean()


def _held_before_the_drivers_restore(cli: subprocess.Popen, mark, agent: list[int]) -> list[int]:
    """The restore ``cli`` runs followed until CRIU has resumed its processes and
    they wait CHECKPOINTED for the driver's restore, the agent stopped (its pid
    into ``agent``, for the caller to SIGCONT) before post-resume: their pids."""
    before = set(_containers_now())

    def held() -> bool:
        if not agent and "pages-filled" in {e.get("event") for e in journal_since(mark)}:
            agent.extend(filter(None, [_agent_waiting_for_post_resume()]))
        return bool(agent)
    when(held, cli, "the agent had answered post-restore", timeout=300)
    restoring: list[int] = []

    def checkpointed() -> bool:  # CRIU resumed them; the driver has not restored them
        new = [pids for cid, pids in _containers_now().items() if cid not in before]
        if new and _held_by_driver(new[0]):
            restoring[:] = new[0]
        return bool(restoring)
    when(checkpointed, cli, "the restored processes waited for the driver", timeout=120)
    return restoring


def _post_resume_failed(mark) -> list[dict]:
    return [e for e in journal_since(mark)
            if e.get("event") == "failed" and e.get("action") == "post-resume"]


def _refused_for_memory(*restore: str, plain: bool = False
                        ) -> tuple[subprocess.CompletedProcess, object]:
    """`gpusnap restore RESTORE...` (``plain``: `podman container restore
    RESTORE...`) held before the driver's restore while GPU 0 (the checkpoint's)
    is filled but for 512 MiB, so post-resume fails for real; the command,
    stopped meanwhile, goes on once the memory is free again (the CLI tries the
    resume itself): its result, and the journal mark taken before it."""
    hog = harness.Hog(0)  # its container up first: starting it takes longer than the restore
    try:
        mark = journal_mark()
        cli = subprocess.Popen(["podman", "container", "restore", *restore], text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE) \
            if plain else start_cli("restore", *restore)
    except BaseException:
        hog.remove()
        raise
    agent: list[int] = []
    try:
        _held_before_the_drivers_restore(cli, mark, agent)
        os.kill(cli.pid, signal.SIGSTOP)  # its check of the processes waits for the free GPU
        hog.take(harness.gpu_memory_free(0) - (1 << 29))
        os.kill(agent.pop(), signal.SIGCONT)
        deadline = time.monotonic() + 120
        while not _post_resume_failed(mark) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:  # the hog goes before the CLI goes on (its retry meets a free GPU); the CLI goes on whatever fails
        with contextlib.suppress(ProcessLookupError):
            for pid in agent:
                os.kill(pid, signal.SIGCONT)
        try:
            hog.remove()
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(cli.pid, signal.SIGCONT)
    res = finished(cli)
    failed = _post_resume_failed(mark)
    assert failed and "CUDA_ERROR_OUT_OF_MEMORY" in failed[0]["error"], failed
    return res, mark


def _resumed_by_the_check(ctr: harness.CudaContainer, its: list[int], mark) -> str:
    """A driver that takes the process back once the memory is free: the
    restore's check resumed it, every tensor equal."""
    late = [e for e in journal_since(mark) if e.get("by") == "restore's check"]
    assert late and late[0]["event"] == "resumed", late
    ctr.assert_restored(ctr.seeds, its)
    return f"resumed by the restore's check: pids {late[0]['pids']}"


def test_a_driver_restore_refused_for_memory_removes_the_restored_container(gone, capsys):
    """CRIU only logs a post-resume step that failed, so Podman says the restore is
    done while its processes wait CHECKPOINTED, off the GPU. Here post-resume
    fails for real (CUDA_ERROR_OUT_OF_MEMORY) and the CLI's own try once the
    memory is free again is refused for good by driver 580
    (CUDA_ERROR_OPERATING_SYSTEM, seen 2026-11-30): it then removes the
    container it cannot run on and says the archive is unchanged, and the
    archive restores. A driver that takes the process back is resumed by that
    check, with every tensor equal."""
    ctr, archive, its = gone
    res, mark = _refused_for_memory(str(archive))
    if res.returncode == 0:
        happened = _resumed_by_the_check(ctr, its, mark)
    else:  # driver 580: refused for good
        assert_one_line_error(res, "did not bring back the GPU state", "tried again: ",
                              "is removed; nothing was restored", f"{archive} is unchanged")
        assert _status(ctr.name) == "gone", _status(ctr.name)
        assert any(e.get("event") == "restore-off-the-gpu" for e in journal_since(mark))
        assert_gpu_clean()
        _restores_again(ctr, str(archive), its)
        happened = _one_line(res)
    say(capsys, f"the driver's restore refused for memory: {happened}")
    assert_gpu_clean()


def test_a_local_restore_refused_for_memory_keeps_its_checkpoint(gone, capsys):
    """The same refusal for a container's own checkpoint: Podman drops it once
    CRIU is done unless kept, so gpusnap keeps it until the GPU state is back;
    the container stopped, the same checkpoint restores with every tensor equal."""
    ctr, archive, its = gone
    gpusnap_json("restore", str(archive))
    ctr.wait_running()
    its = ctr.iterations()
    gpusnap_json("checkpoint", ctr.name)
    res, mark = _refused_for_memory(ctr.name)
    if res.returncode == 0:
        happened = _resumed_by_the_check(ctr, its, mark)
    else:
        assert_one_line_error(res, "did not bring back the GPU state",
                              f"`podman stop -t 0 {ctr.name}`", "its checkpoint is kept")
        podman("stop", "-t", "0", ctr.name)
        assert_gpu_clean()
        gpusnap_json("restore", ctr.name)
        ctr.assert_restored(ctr.seeds, its)
        happened = _one_line(res)
    assert not rt_podman.inspect(ctr.name).checkpoint_dir.exists(), \
        "the checkpoint stayed after the restore that brought the GPU state back"
    say(capsys, f"a local restore refused for memory: {happened}")
    assert_gpu_clean()


def test_a_plain_podman_restore_refused_for_memory_keeps_its_checkpoint(gone, capsys):
    """G15: G14's refusal under a plain `podman container restore NAME` (the OCI
    hook's path, no gpusnap CLI): CRIU only logs the failed post-resume, so
    Podman says the restore is done and removes its checkpoint; the action
    script kept it aside first. doctor names it; the container stopped,
    `gpusnap restore NAME` restores it with every tensor equal."""
    ctr, archive, its = gone
    gpusnap_json("restore", str(archive))
    ctr.wait_running()
    its = ctr.iterations()
    gpusnap_json("checkpoint", ctr.name)
    res, mark = _refused_for_memory(ctr.name, plain=True)
    assert res.returncode == 0, res.stderr  # CRIU only logs post-resume: Podman says done
    (kept,) = [e for e in journal_since(mark) if e.get("event") == "checkpoint-kept"]
    assert "CUDA_ERROR_OUT_OF_MEMORY" in kept["why"], kept
    assert not rt_podman.inspect(ctr.name).checkpoint_dir.exists(), "Podman kept it itself"
    said = next(c for c in json.loads(gpusnap("doctor", "--json").stdout)["checks"]
                if c["name"] == "restores off the gpu")
    assert said["level"] == "warning" and ctr.name in said["detail"], said
    podman("stop", "-t", "0", ctr.name)
    assert_gpu_clean()
    again = journal_mark()
    gpusnap_json("restore", ctr.name)
    ctr.assert_restored(ctr.seeds, its)
    assert any(e.get("event") == "kept-checkpoint-put-back" for e in journal_since(again))
    assert not (rt_podman.inspect(ctr.name).userdata / "gpusnap-kept-checkpoint").exists()
    say(capsys, f"a plain podman restore refused for memory: podman rc {res.returncode}, "
                f"checkpoint kept ({kept['path']}), restored from it")
    assert_gpu_clean()


def test_cli_killed_during_the_driver_restore(gone, capsys):
    """A crash of `gpusnap restore` once the driver's restore is under way: the
    agent and Podman go on without it, so the container comes up, or nothing
    does and the archive restores again; either way no process is left locked."""
    ctr, archive, its = gone
    cli, _ = _restore_until_the_driver_restores(archive)
    sigkill(cli)
    was = _status(ctr.name)  # `podman inspect` waits for the restore's container lock
    if was == "running":
        ctr.assert_restored(ctr.seeds, its)
    else:
        _restores_again(ctr, str(archive), its)
    say(capsys, f"CLI killed during the driver's restore: the container was {was} afterwards")
    assert_gpu_clean()
