"""Bad input and faults with real Podman + runc + CRIU: one clear line, nothing lost.

Every case ends with the container running as it was, or restorable from
what is on disk (and then restored here, its counter continuing).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from gpusnap.procs import process_tree, rss_bytes
from gpusnap.runtime.fifo_pump import referenced
from tests.conftest import (COUNTER, DEMO_IMAGE, GPUSNAP, assert_continued, assert_one_line_error, born, gpusnap,
                            gpusnap_json, podman, read_counter, run, wait_counter,
                            with_gpu_manifest)


def _refused(res: subprocess.CompletedProcess, *needles: str) -> str:
    """One `Error:` line naming the problem, a `->` hint saying what to do; returns the hint."""
    assert_one_line_error(res, *needles)
    lines = res.stderr.strip().splitlines()
    assert sum(line.startswith("Error: ") for line in lines) == 1, res.stderr
    assert len(lines) == 2 and lines[1].lstrip().startswith("-> "), res.stderr
    return lines[1]


def _status(name: str) -> str:
    return podman("container", "inspect", name, "--format", "{{.State.Status}}").stdout.strip()


def _still_counting(name: str, token: str) -> None:
    """Running and counting: the process that wrote ``token``, not a restart."""
    assert _status(name) == "running"
    wait_counter(name, read_counter(name))
    assert born(name) == token


@pytest.mark.parametrize("verb", ["checkpoint", "restore", "freeze", "thaw", "inspect"])
def test_unknown_container(verb):
    res = gpusnap(verb, "gpusnap-no-such-container")
    assert "podman ps -a" in _refused(res, "gpusnap-no-such-container")


@pytest.mark.parametrize("verb", ["checkpoint", "freeze"])
def test_container_not_running(counter, verb):
    podman("stop", "-t", "0", counter)
    res = gpusnap(verb, counter)
    assert "podman start" in _refused(res, "not running")
    assert _status(counter) == "exited"  # untouched


@pytest.mark.parametrize("criu", ["3.17.1", None])
def test_criu_too_old_or_missing_is_refused_up_front(counter, criu, tmp_path):
    # The private CRIU 4 is only in /usr/local/sbin: a PATH without it finds an
    # old CRIU (Debian 12 ships 3.17; a stand-in here, as a bare host has none) or none.
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "podman").symlink_to("/usr/bin/podman")
    if criu:
        (bindir / "criu").write_text(f"#!/bin/sh\necho 'Version: {criu}'\n")
        (bindir / "criu").chmod(0o755)
    env = {**os.environ, "PATH": f"{bindir}:/nonexistent"}
    token = born(counter)
    res = run([GPUSNAP, "checkpoint", counter, "--export", str(tmp_path / "x.tar.zst")], env=env)
    found = f"CRIU {criu} at {bindir}/criu" if criu else "no criu on PATH"
    hint = _refused(res, "CRIU 4.0 or newer", found, "nothing was changed")
    assert "PATH" in hint
    assert not (tmp_path / "x.tar.zst").exists()
    _still_counting(counter, token)


@pytest.fixture
def export(counter, tmp_path) -> Path:
    """A real export of the counter (which keeps running)."""
    archive = tmp_path / "good.tar.zst"
    gpusnap_json("checkpoint", counter, "--export", str(archive), "--leave-running")
    return archive


def _bad_archives(export: Path, tmp_path: Path) -> dict[str, tuple[Path, str]]:
    random = tmp_path / "random.bin"
    random.write_bytes(os.urandom(4096))
    plain = tmp_path / "plain.tar"
    (tmp_path / "hello.txt").write_text("hello")
    with tarfile.open(plain, "w") as tar:
        tar.add(tmp_path / "hello.txt", arcname="hello.txt")
    half = tmp_path / "half.tar.zst"
    data = export.read_bytes()
    half.write_bytes(data[: len(data) // 2])
    return {"missing": (tmp_path / "nope.tar.zst", "no such"),
            "random": (random, "not a readable checkpoint archive"),
            "not a checkpoint": (plain, "not a Podman checkpoint archive"),
            "truncated": (half, "truncated")}


def test_bad_archives_restore_nothing(export, tmp_path):
    for label, (path, words) in _bad_archives(export, tmp_path).items():
        for verb in ("restore", "inspect"):
            res = gpusnap(verb, str(path), *(["--name", "gpusnap-bad"] if verb == "restore" else []))
            _refused(res)
            assert words in res.stderr.lower() or words in res.stderr, (label, verb, res.stderr)
            # nothing half-restored is left under the name (other tests may run beside this one)
            assert podman("container", "exists", "gpusnap-bad", check=False).returncode == 1, label


def test_restore_onto_an_existing_name(counter, export):
    token = born(counter)
    res = gpusnap("restore", str(export))
    _refused(res, f"a container named {counter} already exists", "--name")
    _still_counting(counter, token)


@pytest.fixture
def small_disk(tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], check=True)
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)])


def test_export_to_a_full_disk(counter, small_disk):
    target = small_disk / "x.tar.zst"
    token = born(counter)
    # Refused before anything is touched when the space visibly cannot hold it...
    res = gpusnap("checkpoint", counter, "--export", str(target))
    _refused(res, "not enough disk space", "keeps running")
    _still_counting(counter, token)
    # ...and when it runs out during the export, the dump stays restorable.
    before = read_counter(counter)
    podman("exec", counter, "sh", "-c", "dd if=/dev/urandom of=/tmp/fill bs=1M count=4 2>/dev/null")
    res = gpusnap("checkpoint", counter, "--export", str(target), "--skip-space-check")
    hint = _refused(res, "the disk is full", "No space left on device", "kept locally")
    assert f"gpusnap restore {counter}" in hint
    assert sorted(os.listdir(small_disk)) == []  # no partial archive, no FIFO left
    assert _status(counter) == "exited"
    # `podman start` would lose the dumped state: a second checkpoint says so.
    assert f"gpusnap restore {counter}" in _refused(gpusnap("checkpoint", counter), "not running")
    gpusnap_json("restore", counter)
    assert_continued(counter, before, token)


def test_export_to_a_full_disk_leave_running(counter, small_disk):
    token = born(counter)
    (small_disk / "fill").write_bytes(b"\0" * (1000 << 10))  # a few KiB stay free
    res = gpusnap("checkpoint", counter, "--export", str(small_disk / "x.tar.zst"),
                  "--skip-space-check", "--leave-running")
    _refused(res, "the disk is full", "still running")
    assert sorted(os.listdir(small_disk)) == ["fill"]
    _still_counting(counter, token)
    userdata = podman("container", "inspect", counter, "--format", "{{.StaticDir}}").stdout.strip()
    assert not (Path(userdata) / "checkpoint").exists(), "a stale dump of a running container"


def test_plain_export_for_a_push_to_a_full_disk(counter, small_disk):
    """The plain tar a push follows is written by Podman itself (no FIFO): a
    full disk is one clear error, no partial file, and the dump restorable."""
    from gpusnap.errors import GpusnapError
    from gpusnap.ops import checkpoint as ops

    podman("exec", counter, "sh", "-c", "dd if=/dev/urandom of=/tmp/fill bs=1M count=4 2>/dev/null")
    before, token = read_counter(counter), born(counter)
    target = small_disk / "checkpoint.tar"
    plan = ops.plan(counter, str(target), False, False, 10_000, skip_space_check=True,
                    export_level=0)
    with pytest.raises(GpusnapError) as err:
        ops.run(plan)
    assert "the disk is full" in err.value.message and "kept locally" in err.value.message
    assert sorted(os.listdir(small_disk)) == []
    gpusnap_json("restore", counter)
    assert_continued(counter, before, token)


def test_cli_killed_mid_checkpoint_leaves_it_restorable(counter, tmp_path):
    podman("exec", counter, "sh", "-c", "dd if=/dev/urandom of=/dev/shm/fill bs=1M count=48 2>/dev/null")
    before, token = read_counter(counter), born(counter)
    archive = tmp_path / "killed.tar.zst"
    cli = subprocess.Popen([GPUSNAP, "checkpoint", counter, "--export", str(archive)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not _podman_exporting(tmp_path):
        time.sleep(0.01)
    assert _podman_exporting(tmp_path), "podman never started the export"
    cli.send_signal(signal.SIGKILL)
    cli.wait()
    deadline = time.monotonic() + 60  # Podman and the FIFO pump go on without the CLI
    while time.monotonic() < deadline and referenced(str(tmp_path)):
        time.sleep(0.2)
    assert not referenced(str(tmp_path)), "Podman or the pump hangs after the CLI died"
    assert not archive.exists(), "a half-written archive under the export's name"
    if _status(counter) != "running":
        gpusnap_json("restore", counter)
    assert_continued(counter, before, token)
    doctor = json.loads(gpusnap("doctor", "--fix", "--json").stdout)
    assert doctor["stuck"] == []
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "leftovers not removed"
    # And the next checkpoint works.
    gpusnap_json("checkpoint", counter, "--export", str(archive), "--leave-running")
    assert archive.stat().st_size > 0


def _counter_holding_half_a_gib(name: str) -> int:
    """The counter with half a GiB of anonymous memory beside it in the container's
    tree (a dump and a restore long enough to land a kill in); its init's pid."""
    podman("run", "-d", "--name", name, "--network", "none", DEMO_IMAGE, "sh", "-c",
           'busybox awk \'BEGIN { s = "x"; while (length(s) < 5e8) s = s s; '
           'while (1) system("sleep 1") }\' & ' + COUNTER)
    wait_counter(name, 3)
    pid = int(podman("inspect", name, "--format", "{{.State.Pid}}").stdout)
    deadline = time.monotonic() + 60
    while rss_bytes(process_tree(pid)) < 400 << 20 and time.monotonic() < deadline:
        time.sleep(0.1)
    return pid


def _names_criu_log(stderr: str) -> None:
    """The line names a copy of CRIU's log that outlives the container."""
    found = re.search(r"CRIU's log is kept in (\S+?\.log)", stderr)
    assert found, stderr
    assert "CRIU run id" in Path(found.group(1)).read_text(errors="replace")


def test_criu_killed_mid_dump_leaves_the_container_running(name, tmp_path):
    """CRIU SIGKILLed once it seized the container: one line says what happened,
    and the container counts on (had the cgroup stayed frozen, as CRIU froze it
    to seize, gpusnap thaws it: no runtime does)."""
    from tests.faults.conftest import kill_criu_mid_dump

    counter = name
    pid = _counter_holding_half_a_gib(counter)
    token = born(counter)
    cli = subprocess.Popen([GPUSNAP, "checkpoint", counter, "--export", str(tmp_path / "x.tar.zst")],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    kill_criu_mid_dump(pid, cli)
    out, err = cli.communicate(timeout=300)
    res = subprocess.CompletedProcess(cli.args, cli.returncode, out, err)
    assert_one_line_error(res, "CRIU stopped before the dump", "still running")
    _names_criu_log(res.stderr)
    assert not (tmp_path / "x.tar.zst").exists()
    _still_counting(counter, token)
    assert json.loads(gpusnap("doctor", "--json").stdout)["stuck"] == []
    gpusnap_json("checkpoint", counter, "--export", str(tmp_path / "x.tar.zst"), "--leave-running")
    _still_counting(counter, token)


def _yards() -> set[str]:
    """The CRIU cgroup yards mounted on this host now (mount points)."""
    return {line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()
            if "/.criu.cgyard." in line}


def test_criu_killed_mid_restore_restores_nothing_and_says_so(name, tmp_path):
    """CRIU SIGKILLed once it forked the container's tasks: one line says CRIU
    stopped (not runc's "read unixpacket: EOF"), nothing half-restored is left,
    and the archive restores on the next try, as the line says."""
    from tests.faults.conftest import kill_criu_mid_restore

    counter = name
    _counter_holding_half_a_gib(counter)
    token, archive = born(counter), tmp_path / "x.tar.zst"
    before = read_counter(counter)
    gpusnap_json("checkpoint", counter, "--export", str(archive))
    podman("rm", counter)
    yards_before = _yards()
    cli = subprocess.Popen([GPUSNAP, "restore", str(archive)],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    kill_criu_mid_restore(cli)
    out, err = cli.communicate(timeout=300)
    res = subprocess.CompletedProcess(cli.args, cli.returncode, out, err)
    assert_one_line_error(res, "CRIU stopped before the restore", "nothing was restored",
                          f"{archive} is unchanged", hint="run the same restore again")
    _names_criu_log(res.stderr)
    assert podman("container", "exists", counter, check=False).returncode == 1, \
        "a half-restored container was left"
    # CRIU's cgroup yard (the host's cgroups, under the container's userdata) went
    # with it: unmounted by gpusnap before Podman's removal (criu/yard.py) or by Podman
    assert not _yards() - yards_before, _yards() - yards_before
    gpusnap_json("restore", str(archive))
    assert_continued(counter, before, token)


def test_pump_of_a_cli_killed_before_podman_starts_ends(tmp_path):
    """The CLI can die between starting its FIFO pump and starting Podman (a window
    of milliseconds): the pump, whose FIFO no one will ever open, must end by itself."""
    fifo, partial, pidfile = tmp_path / "archive.tar", tmp_path / ".x.tar.zst.partial", tmp_path / "pid"
    os.mkfifo(fifo)
    # A stand-in CLI that starts the pump as gpusnap does and dies at once.
    subprocess.run([sys.executable, "-c", "import os; from gpusnap.runtime.stream import _pump; "
                    f"p = _pump('export', {str(fifo)!r}, {str(partial)!r}, '1'); "
                    f"open({str(pidfile)!r}, 'w').write(str(p.pid)); os._exit(0)"],
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    pid = int(pidfile.read_text())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and Path(f"/proc/{pid}").exists():
        time.sleep(0.1)
    if Path(f"/proc/{pid}").exists():
        os.kill(pid, signal.SIGKILL)
        pytest.fail("the FIFO pump of a dead CLI waits for ever")
    assert not partial.exists()


def _podman_exporting(where: Path) -> bool:
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        if b"checkpoint" in args and any(str(where).encode() in a for a in args) and \
                any(a.endswith(b"podman") for a in args[:1]):
            return True
    return False


def test_gpu_checkpoint_refused_on_a_host_without_that_gpu(counter, export, tmp_path):
    token = born(counter)
    archive = with_gpu_manifest(export, tmp_path)
    assert gpusnap_json("inspect", str(archive))["gpu"]["gpus"][0]["name"] == "NVIDIA H100 80GB HBM3"
    names = (f"{counter}-gpu", f"{counter}-gpu2")
    try:
        res = gpusnap("restore", str(archive), "--name", names[0])
        assert "gpusnap inspect" in _refused(res, "cannot restore here", "NVIDIA GPU")
        # Unchanged Podman: the OCI hook refuses it at restore.
        res = podman("container", "restore", "--import", str(archive), "--name", names[1],
                     check=False)
        assert res.returncode != 0 and "gpusnap: cannot restore here" in res.stderr, res.stderr
        for name in names:
            state = podman("ps", "-a", "--filter", f"name=^{name}$", "--format", "{{.Status}}").stdout
            assert "Up" not in state, (name, state)
    finally:
        for name in names:
            run(["podman", "rm", "-f", "-t", "0", name])
    _still_counting(counter, token)
