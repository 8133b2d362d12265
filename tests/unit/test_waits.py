"""gpusnap/waits.py: a program past its bound is stopped, and the line says what ran out."""

from __future__ import annotations

import sys
from pathlib import Path
import time

import pytest

from gpusnap import waits
from gpusnap.errors import GpusnapError


def test_a_program_that_never_ends_stalls_until_its_bound(monkeypatch):
    monkeypatch.setenv("GPUSNAP_WAIT_PODMAN", "1")
    started = time.monotonic()
    with pytest.raises(waits.WaitExpired) as failed:
        waits.run(["sleep", "600"], "podman container inspect", waits.Bound.of("PODMAN"))
    assert time.monotonic() - started < 20
    assert failed.value.message == "podman container inspect: no answer within 1 s"
    assert "GPUSNAP_WAIT_PODMAN=SECONDS" in failed.value.hint


def test_a_program_that_ignores_sigterm_is_killed(monkeypatch):
    monkeypatch.setenv("GPUSNAP_WAIT_PODMAN", "1")
    monkeypatch.setenv("GPUSNAP_WAIT_STOP", "1")
    stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
    started = time.monotonic()
    with pytest.raises(waits.WaitExpired):
        waits.run([sys.executable, "-c", stubborn], "podman info", waits.Bound.of("PODMAN"))
    assert time.monotonic() - started < 20


def test_a_watch_that_raises_stops_the_program_at_once():
    calls = []

    def watch() -> None:
        calls.append(1)
        if len(calls) == 3:
            raise GpusnapError("the stream died")

    started = time.monotonic()
    with pytest.raises(GpusnapError, match="the stream died"):
        waits.run(["sleep", "600"], "podman container restore", waits.Bound.of("PODMAN"), watch,
                  tick=0.05)
    assert time.monotonic() - started < 20


def test_a_bound_restarts_while_progress_moves(monkeypatch):
    """A restore that reads a slow download: not hung while bytes come."""
    monkeypatch.setenv("GPUSNAP_WAIT_PODMAN", "1")
    started = time.monotonic()
    moving = lambda: int((time.monotonic() - started) * 4)  # noqa: E731 -- moves every 0.25 s
    res = waits.run(["sleep", "2.5"], "podman container restore", waits.Bound.of("PODMAN"),
                    progress=moving)
    assert res.returncode == 0
    with pytest.raises(waits.WaitExpired):  # the same, once the bytes stop
        waits.run(["sleep", "600"], "podman container restore", waits.Bound.of("PODMAN"),
                  progress=lambda: 7)


def test_output_larger_than_a_pipe_never_blocks_the_program():
    chatty = "import sys; sys.stdout.write('x' * (4 << 20)); sys.stderr.write('y' * (1 << 20))"
    res = waits.run([sys.executable, "-c", chatty], "chatty", waits.Bound.of("PODMAN"))
    assert res.returncode == 0 and len(res.stdout) == 4 << 20 and len(res.stderr) == 1 << 20


def test_a_bound_grows_with_the_bytes_and_a_bad_override_keeps_the_default(monkeypatch):
    assert waits.Bound.for_bytes("PODMAN_RESTORE", 20 << 30).seconds == 600 + 1024
    monkeypatch.setenv("GPUSNAP_WAIT_PODMAN", "soon")
    assert waits.Bound.of("PODMAN").seconds == 120


def test_a_runc_the_shim_runs_that_never_ends_is_killed_at_its_bound(tmp_path):
    """The shim's runc (a checkpoint whose CRIU is stuck, say): killed at
    GPUSNAP_WAIT_RUNC, so the shim answers containerd. In a Python of its own:
    the shim's reaper waits for every child of its process."""
    import os
    import subprocess

    fake = tmp_path / "runc"
    fake.write_text("#!/bin/sh\nexec sleep 600\n")
    fake.chmod(0o755)
    shim = ("from gpusnap.shim.reaper import Reaper; from gpusnap.shim.runc import Runc, RuncError\n"
            "r = Reaper(); r.start()\n"
            f"runc = Runc(r, {str(tmp_path)!r}, {str(tmp_path / 'log.json')!r}, {str(fake)!r})\n"
            "try:\n    runc._run(['checkpoint', 'x'])\nexcept RuncError as e:\n    print(e)\n")
    started = time.monotonic()
    res = subprocess.run([sys.executable, "-c", shim], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "GPUSNAP_WAIT_RUNC": "1"})
    assert time.monotonic() - started < 30
    assert res.stdout.strip() == ("runc checkpoint: no answer within 1 s (GPUSNAP_WAIT_RUNC="
                                  "SECONDS, or RUNC=SECONDS in /etc/gpusnap/waits.conf raises "
                                  "the bound)"), res.stderr


def _scripts() -> dict[str, str]:
    import tomllib
    with open(Path(__file__).parents[2] / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]["scripts"]


@pytest.mark.parametrize("name", ["gpusnap-criu-action", "gpusnap-hook"])
def test_criu_and_runc_scripts_exit_past_a_driver_call_in_flight(name, monkeypatch):
    # CRIU waits on its action script and runc on its hook: with a driver call
    # abandoned at its bound, sys.exit would sit in libcuda's exit handlers.
    import importlib
    from gpusnap.gpu import driver_calls
    module, func = _scripts()[name].split(":")
    entry = getattr(importlib.import_module(module), func)
    monkeypatch.setattr(importlib.import_module(module), "main", lambda: 3)
    monkeypatch.setattr(driver_calls, "driver_busy", lambda: True)
    left = []
    monkeypatch.setattr("os._exit", lambda code: left.append(code) or (_ for _ in ()).throw(SystemExit(code)))
    with pytest.raises(SystemExit):
        entry()
    assert left == [3]


def test_the_offline_install_writes_the_same_entry_points_as_pyproject():
    install = (Path(__file__).parents[2] / "packaging" / "install.sh").read_text()
    for name, target in _scripts().items():
        assert f"{name}:{target}" in install, name


def test_a_podman_checkpoint_at_its_bound_ends_with_the_runc_and_criu_it_ran(tmp_path, monkeypatch):
    # Podman runs runc, runc CRIU: a Podman stopped alone left them dumping a
    # container the failure path already thawed and called running.
    import os

    from gpusnap.runtime import podman

    child_pid = tmp_path / "criu.pid"
    fake = tmp_path / "podman"
    fake.write_text(f"#!/bin/sh\nsh -c 'echo $$ > {child_pid}; exec sleep 600' &\nwait\n")
    fake.chmod(0o755)
    monkeypatch.setattr(podman, "podman_binary", lambda: str(fake))
    monkeypatch.setenv("GPUSNAP_WAIT_PODMAN_CHECKPOINT", "1")
    monkeypatch.setenv("GPUSNAP_WAIT_STOP", "1")
    with pytest.raises(waits.WaitExpired) as info:
        podman.checkpoint("web", None, False, False)
    assert "runc and CRIU it ran were stopped" in info.value.hint
    pid = int(child_pid.read_text())
    for _ in range(50):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"the fake CRIU (pid {pid}) outlived the Podman stopped at its bound")


def test_a_bound_set_in_waits_conf_reaches_a_step_with_no_users_environment(tmp_path, monkeypatch):
    conf = tmp_path / "waits.conf"
    conf.write_text("# gpusnap's bounds\nRUNC = 7200  # a slow NFS\nAGENT=5\n")
    monkeypatch.setenv("GPUSNAP_WAITS_CONF", str(conf))
    monkeypatch.delenv("GPUSNAP_WAIT_RUNC", raising=False)
    assert waits.Bound.of("RUNC").seconds == 7200
    monkeypatch.setenv("GPUSNAP_WAIT_RUNC", "9")  # the variable wins
    assert waits.Bound.of("RUNC").seconds == 9
    assert str(conf) in waits.Bound.of("PODMAN").expired("podman x").hint


def test_criu_action_reads_its_agents_bound_from_waits_conf(tmp_path):
    import subprocess

    conf = tmp_path / "waits.conf"
    conf.write_text("AGENT = 7")  # its last line without a newline
    script = Path(__file__).parents[2] / "packaging/bin/criu-action"
    # what the script computes, before any step: its bound line, run alone
    text = script.read_text()
    start = text.index("CONF=${GPUSNAP_WAITS_CONF")
    end = text.index("\n", text.index("bound=${bound//[[:space:]]/}"))
    res = subprocess.run(["bash", "-c", text[start:end] + '\necho "$bound"'], capture_output=True,
                         text=True, env={"GPUSNAP_WAITS_CONF": str(conf), "PATH": "/usr/bin:/bin"})
    assert res.stdout.strip() == "7", res


def test_the_tree_kill_leaves_a_process_in_a_session_of_its_own(tmp_path, monkeypatch):
    # the guardian pre-dump starts with setsid outlives the dump on purpose
    import os

    from gpusnap.runtime import podman

    mine, own = tmp_path / "criu.pid", tmp_path / "guardian.pid"
    fake = tmp_path / "podman"
    fake.write_text(f"#!/bin/sh\nsh -c 'echo $$ > {mine}; exec sleep 600' &\n"
                    f"setsid sh -c 'echo $$ > {own}; exec sleep 600' &\nwait\n")
    fake.chmod(0o755)
    monkeypatch.setattr(podman, "podman_binary", lambda: str(fake))
    monkeypatch.setenv("GPUSNAP_WAIT_PODMAN_CHECKPOINT", "1")
    monkeypatch.setenv("GPUSNAP_WAIT_STOP", "1")
    with pytest.raises(waits.WaitExpired):
        podman.checkpoint("web", None, False, False)
    guardian = int(own.read_text())
    try:
        os.kill(guardian, 0)  # alive
        time.sleep(0.3)
        with pytest.raises(ProcessLookupError):
            for _ in range(20):
                os.kill(int(mine.read_text()), 0)
                time.sleep(0.05)
    finally:
        os.kill(guardian, 9)


def test_a_bound_that_is_not_a_number_keeps_its_default(monkeypatch):
    monkeypatch.setenv("GPUSNAP_WAIT_STOP", "nan")
    assert waits.Bound.of("STOP").seconds == 15
