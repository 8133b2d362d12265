"""Real Podman + runc + CRIU: checkpoint, export, remove, restore; state continues."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from gpusnap.procs import process_tree
from gpusnap.runtime import kept_checkpoint, podman as rt_podman
from tests.conftest import (DEMO_IMAGE, GPUSNAP, RENAMING_HOLDER, assert_continued,
                            journal_mark, journal_since,
                            assert_one_line_error, born, gpusnap, gpusnap_json, podman,
                            read_counter, run, wait_counter)

from gpusnap import MANIFEST_NAME


def _members(path) -> set[str]:
    """Archive member names, with pids and ids made generic (the counter's
    short-lived `sleep` child differs between two dumps)."""
    out = run(["tar", "-I", "zstd", "-tf", str(path)], check=True).stdout.split()
    return {re.sub(r"-\d+\.img$", "-N.img", m.removeprefix("./")) for m in out}


def test_gpusnap_checkpoint_export_restore_continues(counter, tmp_path):
    before, token = read_counter(counter), born(counter)
    archive = tmp_path / "ctr.tar.zst"
    result = gpusnap_json("checkpoint", counter, "--export", str(archive))
    assert result["export"] == str(archive) and archive.stat().st_size > 0
    assert result["criu"]["processes"] >= 1  # sh, and its sleep if one runs at that moment
    assert result["gpu"] is None  # no GPU: nothing added
    assert podman("container", "inspect", counter, "--format", "{{.State.Status}}").stdout.strip() == "exited"
    podman("rm", counter)

    restored = gpusnap_json("restore", str(archive))
    assert restored["container"]["name"] == counter
    assert restored["container"]["status"] == "running"
    assert_continued(counter, before, token)
    value = read_counter(counter)
    assert wait_counter(counter, value) > value


def test_plain_podman_checkpoint_export_import_continues(counter, tmp_path):
    before, token = read_counter(counter), born(counter)
    archive = tmp_path / "plain.tar.zst"
    podman("container", "checkpoint", "--export", str(archive), counter)
    podman("rm", counter)
    podman("container", "restore", "--import", str(archive))
    assert_continued(counter, before, token)


def test_leave_running_keeps_counting(counter, tmp_path):
    archive = tmp_path / "live.tar.zst"
    token = born(counter)
    result = gpusnap_json("checkpoint", counter, "--export", str(archive), "--leave-running")
    assert result["leave_running"] is True
    v = read_counter(counter)
    assert wait_counter(counter, v) > v
    # The archive restores as a second container beside the running one.
    other = counter + "-copy"
    try:
        gpusnap_json("restore", str(archive), "--name", other)
        assert_continued(other, 0, token)
    finally:
        run(["podman", "rm", "-f", "-t", "0", other])


def test_a_shell_caught_in_vfork_by_the_freeze_is_checkpointed_all_the_same(name):
    """busybox 1.38's sh (the demo image of the sid matrix legs) runs a command
    through vfork(): a freeze that lands while it waits for its child's exec
    leaves it uninterruptible, and CRIU gives up on it after 10 s (the sid legs'
    "freeze timeout"; plain Podman failed 2 of 25 such dumps). gpusnap takes
    such a dump again: ten checkpoints of a shell that spawns all the time all
    succeed. Where sh forks (busybox 1.37 and older) no dump meets the race."""
    podman("run", "-d", "--name", name, "--network", "none", DEMO_IMAGE, "sh", "-c",
           "while true; do /bin/sleep 0; done")
    for _ in range(10):
        gpusnap_json("checkpoint", name, "--leave-running")
        assert podman("container", "inspect", name, "--format",
                      "{{.State.Status}}").stdout.strip() == "running"


def test_a_leave_running_export_restores_or_is_refused_in_one_line(name, tmp_path):
    """A process holds /tmp/hN open and renames it every ~10 ms: a --leave-running
    export then misses the name it had at the dump (Podman writes the root
    filesystem after the container ran on) and would not restore, unless CRIU
    caught the rename itself (it then keeps a link of its own). gpusnap takes
    the checkpoint again, up to three times: what it exports restores beside the
    running original, or it exports nothing and says so in one line, and the
    hint's way (without --leave-running) gives an export that restores."""
    podman("run", "-d", "--name", name, "--network", "none", DEMO_IMAGE, "sh", "-c",
           RENAMING_HOLDER)
    wait_counter(name, 3)
    token, archive = born(name), tmp_path / "live.tar.zst"
    for _ in range(3):
        res = gpusnap("checkpoint", name, "--export", str(archive), "--leave-running")
        if res.returncode == 0 or "could not seize" not in res.stderr:
            break
        # every try caught the loop's shell in vfork (the freeze holds its child):
        # the line says so, and to take it again, which the test does as printed
        assert_one_line_error(res, "still running", hint="checkpoint it again")
    if res.returncode == 0:  # a try CRIU saw through, or one that missed no rename
        tries = re.search(r"taken (\d) times", res.stdout)
        tries = tries.group(1) if tries else 1
        other = f"{name}-copy"
        try:
            gpusnap_json("restore", str(archive), "--name", other)
            assert_continued(other, 0, token)
        finally:
            run(["podman", "rm", "-f", "-t", "0", other])
        print(f"exported on try {tries}, restored beside the original")
        return
    assert_one_line_error(res, f"the checkpoint of {name} would not restore",
                          "3 tries", "still running", hint="without --leave-running")
    assert re.search(r"/tmp/(h\d+|c\.new) \(gone\)", res.stderr), res.stderr  # both renamed
    assert not archive.exists()
    before = read_counter(name)
    assert wait_counter(name, before) > before  # running on
    gpusnap_json("checkpoint", name, "--export", str(archive))
    podman("rm", name)
    gpusnap_json("restore", str(archive))
    assert_continued(name, before, token)
    print("refused after 3 tries; the hint's export restored")


def test_restore_from_local_checkpoint(counter):
    before, token = read_counter(counter), born(counter)
    gpusnap_json("checkpoint", counter)
    info = gpusnap_json("inspect", counter)
    assert info["criu"]["processes"] >= 1  # sh (its sleep comes and goes)
    restored = gpusnap_json("restore", counter)
    assert restored["container"]["status"] == "running"
    assert_continued(counter, before, token)


def test_a_checkpoint_kept_at_a_failed_restore_restores_after_podman_dropped_it(counter):
    """Where post-resume fails, the action script keeps the checkpoint aside
    (runtime/kept_checkpoint.py): here kept by that same call, then a real
    `podman container restore` (without --keep) removes what it removes; the
    kept copy survives it. doctor names it; stopped, `gpusnap restore NAME`
    puts it back, and Podman restores the process that counted, not a fresh
    start. (post-resume failing for real on a GPU: G15.)"""
    before, token = read_counter(counter), born(counter)
    gpusnap_json("checkpoint", counter)
    ctr = rt_podman.inspect(counter)
    assert kept_checkpoint.keep_aside(ctr.checkpoint_dir, "post-resume: refused") is not None
    podman("container", "restore", counter)
    assert not ctr.checkpoint_dir.exists(), "Podman kept its checkpoint: nothing tested"
    assert kept_checkpoint.why_kept(ctr.userdata) is not None
    podman("stop", "-t", "0", counter)

    def doctor_says() -> dict:
        return next(c for c in json.loads(gpusnap("doctor", "--json").stdout)["checks"]
                    if c["name"] == "restores off the gpu")
    said = doctor_says()
    assert said["level"] == "warning" and f"{counter}: post-resume: refused" in said["detail"]
    assert "`gpusnap restore NAME`" in said["fix"]
    mark = journal_mark()
    restored = gpusnap_json("restore", counter)
    assert restored["container"]["status"] == "running"
    assert_continued(counter, before, token)
    assert [e["event"] for e in journal_since(mark) if "kept" in e["event"]] == \
        ["kept-checkpoint-put-back"]
    assert kept_checkpoint.why_kept(ctr.userdata) is None
    assert doctor_says()["level"] == "ok"


def test_a_kept_checkpoint_goes_when_its_container_is_started_afresh(counter):
    """`podman start` after the failed restore gives the kept state up (the OCI
    hook at create): a later `gpusnap restore NAME` must not go back to it."""
    gpusnap_json("checkpoint", counter)
    ctr = rt_podman.inspect(counter)
    kept_checkpoint.keep_aside(ctr.checkpoint_dir, "post-resume: refused")
    rt_podman.drop_checkpoint(ctr)
    podman("start", counter)
    assert kept_checkpoint.why_kept(ctr.userdata) is None
    podman("stop", "-t", "0", counter)
    res = gpusnap("restore", counter)
    assert_one_line_error(res, f"container {counter} has no checkpoint to restore")


def test_container_without_gpu_is_checkpointed_as_podman_would(counter, name, tmp_path):
    """The action script leaves a GPU-less container alone: same archive members,
    no manifest, nothing quiesced in the journal."""
    with_gpusnap = tmp_path / "with.tar.zst"
    podman("container", "checkpoint", "--leave-running", "--export", str(with_gpusnap), counter)
    conf = "/etc/criu/runc.conf"
    saved = open(conf).read()
    try:
        open(conf, "w").write("")  # CRIU as it is without gpusnap
        without = tmp_path / "without.tar.zst"
        podman("container", "checkpoint", "--leave-running", "--export", str(without), counter)
    finally:
        open(conf, "w").write(saved)
    assert _members(with_gpusnap) == _members(without)
    assert f"checkpoint/{MANIFEST_NAME}" not in _members(with_gpusnap)


def test_inspect_archive(counter, tmp_path):
    archive = tmp_path / "i.tar.zst"
    gpusnap_json("checkpoint", counter, "--export", str(archive), "--leave-running")
    info = gpusnap_json("inspect", str(archive))
    assert info["container"]["name"] == counter
    assert info["container"]["image"] == "localhost/gpusnap-demo:latest"
    # the runtime the container ran under (runc here; crun in the version matrix)
    ran = podman("container", "inspect", counter, "--format", "{{.OCIRuntime}}").stdout.strip()
    assert ran in ("runc", "crun") and info["runtime"] == ran
    assert info["criu"]["memory_pages_bytes"] > 0
    human = gpusnap("inspect", str(archive), check=True).stdout
    assert counter in human and "GPU: none" in human


def _runtime_under(held: subprocess.Popen, timeout: float = 120.0) -> int:
    """The OCI runtime's `checkpoint` (runc or crun) that Podman starts under
    ``held`` once it has the container's lock, as soon as it is there: stopped,
    it keeps Podman and the lock waiting whichever step it is at, and it lives
    from before CRIU starts until after CRIU ends, so no dump is too fast to
    catch. A checkpoint that ends first fails here with Podman's own words."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if held.poll() is not None:
            raise AssertionError(f"the other checkpoint ended (exit {held.returncode}) before "
                                 f"its runtime was found: {held.stderr.read().strip()}")
        for p in process_tree(held.pid)[1:]:
            try:
                args = Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"checkpoint" in args and Path(args[0].decode()).name in ("runc", "crun"):
                return p
        time.sleep(0.001)
    raise AssertionError("no runtime came under the checkpoint")


def _stop_runtime_under(held: subprocess.Popen, timeout: float = 120.0) -> int:
    """_runtime_under's runtime, stopped (SIGSTOP). One gone by then is looked for
    again (under runc 1.3.6 in the sid matrix, a runc found with `checkpoint` in
    its arguments was gone before the stop, CI 2026-11-30); a checkpoint that
    ended fails in _runtime_under's words."""
    deadline = time.monotonic() + timeout
    while True:
        runtime = _runtime_under(held, max(0.1, deadline - time.monotonic()))
        try:
            os.kill(runtime, signal.SIGSTOP)
            return runtime
        except ProcessLookupError:
            continue


def test_a_clis_pages_links_dropped_by_a_plain_checkpoint_meanwhile_are_made_again(counter, tmp_path):
    """This process plays the CLI: its pages request and links are in place
    when someone's plain `podman container checkpoint` (not run by it) takes
    Podman's lock first. That dump drops the links, leaves the request and
    keeps its own pages there; the CLI's own dump replaces those by its links
    again and CRIU writes its pages aside."""
    from gpusnap import requests
    from gpusnap.criu.runtimes import runs_action_script
    from gpusnap.pages import pages_aside

    ctr = rt_podman.inspect(counter)
    if not runs_action_script(ctr.runtime):
        pytest.skip(f"{ctr.runtime} runs no CRIU action script: no pre-dump reads requests there")
    aside, images = tmp_path / "aside", ctr.checkpoint_dir
    aside.mkdir(mode=0o700)
    images.mkdir(mode=0o700, exist_ok=True)
    try:
        requests.put_for_dump(ctr.pid, "pages", images=str(images), aside=str(aside), prelink=8)
        assert pages_aside.prelink(images, aside, 8) == 8
        mark = journal_mark()
        done = tmp_path / "plain.rc"
        # reparented to init at once: this process is not its ancestor
        subprocess.run(["sh", "-c", f"(podman container checkpoint --leave-running --keep {counter}"
                        f" >{tmp_path}/plain.log 2>&1; echo $? >{done}) &"], check=True)
        deadline = time.monotonic() + 120
        while not done.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert done.read_text().strip() == "0", (tmp_path / "plain.log").read_text()
        plain = journal_since(mark)
        # left by its pre-dump and its post-dump alike
        assert [e["kind"] for e in plain if e["event"] == "request-left"] == ["pages"] * 2, plain
        assert any(e["event"] == "pages-links-dropped" for e in plain), plain
        assert not any(p.is_symlink() for p in images.glob("pages-*.img"))
        mark = journal_mark()
        podman("container", "checkpoint", "--leave-running", "--keep", counter)  # the CLI's own
        mine = journal_since(mark)
        made = [e for e in mine if e["event"] == "pages-links-made-again"]
        # the plain dump's own pages, which CRIU would have written over in place, gone first
        assert made and made[0]["links"] == 8 and made[0]["replaced"], mine
        aside_said = [e for e in mine if e["event"] == "pages-aside"]
        assert aside_said and aside_said[0]["bytes"] > 0, mine
        assert sum(f.stat().st_size for f in aside.glob("pages-*.img")) > 0
        assert rt_podman.inspect(counter).running
    finally:
        pages_aside.drop_links(images, aside)  # no link left into a folder that goes
        requests.drop(ctr.pid, "pages")


def test_a_second_gpusnap_command_on_a_container_is_refused_and_touches_nothing(
        counter, tmp_path, registry):
    """One gpusnap command at a time checkpoints a container: a push holds it
    (this process, as the push would), and `gpusnap checkpoint`, `gpusnap
    push` and the background ones (`--detach`) are refused in one line that
    names it, leaving no background upload behind; the container runs on."""
    from gpusnap.ops.container_busy import only_command
    from tests.integration.oci_registry import PASSWORD

    ctr = rt_podman.inspect(counter)
    export = tmp_path / "c.tar.zst"
    ref = registry.ref("busy/c:1")
    uploads_before = gpusnap_json("status")["uploads"]
    with only_command(ctr.id, ctr.name, "gpusnap push (the test)"):
        for argv in ([GPUSNAP, "checkpoint", "-R", "--export", str(export), counter],
                     [GPUSNAP, "push", "-R", counter, ref, *registry.flags()],
                     [GPUSNAP, "push", "-d", counter, ref, *registry.flags()],
                     [GPUSNAP, "migrate", "-dR", counter, ref, *registry.flags()]):
            res = run(argv, input=PASSWORD + "\n")
            assert res.returncode == 1, (res.stdout, res.stderr)
            assert f"pid {os.getpid()}: gpusnap push (the test)); nothing was done" in res.stderr
            assert "Traceback" not in res.stderr
    assert not export.exists() and rt_podman.inspect(counter).running
    assert not ctr.checkpoint_dir.exists() or not any(ctr.checkpoint_dir.iterdir())
    assert gpusnap_json("status")["uploads"] == uploads_before, "a refused --detach left one"
    res = gpusnap("checkpoint", "-R", "--export", str(export), counter)  # let go: it runs
    assert res.returncode == 0, (res.stdout, res.stderr)


def test_a_restore_does_not_wait_for_another_containers_checkpoint(counter, tmp_path):
    """`podman info` counts containers by state, taking each one's lock, which a
    checkpoint holds until it ends: a restore that asked it each time waited for
    every other container's checkpoint or restore. Here another container's
    checkpoint is held (its runtime stopped) while this one restores."""
    from gpusnap.runtime import podman as podman_rt
    from tests.integration.test_segments import _start_big_memory

    before, token = read_counter(counter), born(counter)
    archive = tmp_path / "ctr.tar.zst"
    gpusnap_json("checkpoint", counter, "--export", str(archive))
    podman("rm", counter)
    assert podman_rt.host_facts().runtime  # Podman's answer kept, as any restore keeps it
    other = f"{counter}-other"
    _start_big_memory(other)
    held = subprocess.Popen(["podman", "container", "checkpoint", other],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    runtime = None
    try:
        runtime = _stop_runtime_under(held)
        started = time.monotonic()
        restored = run([GPUSNAP, "restore", str(archive), "--json"], timeout=120)
        assert restored.returncode == 0, restored.stderr
        assert held.poll() is None, "the other checkpoint ended: nothing was held"
        assert_continued(counter, before, token)
        print(f"restored in {time.monotonic() - started:.2f} s beside a held checkpoint")
    finally:
        if runtime is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(runtime, signal.SIGCONT)
        held.communicate(timeout=300)
        run(["podman", "rm", "-f", "-t", "0", other])


def test_a_plain_checkpoint_run_while_a_cli_waits_for_its_own_leaves_that_clis_requests(counter):
    """A `gpusnap checkpoint` waiting on Podman's lock while someone's plain
    `podman container checkpoint` holds it: that dump's pre-dump (no
    descendant of the CLI) neither obeys the CLI's requests nor drops them."""
    from gpusnap import requests
    from gpusnap.criu.runtimes import runs_action_script
    from gpusnap.procs import start_time

    ctr = rt_podman.inspect(counter)
    if not runs_action_script(ctr.runtime):
        pytest.skip(f"{ctr.runtime} runs no CRIU action script: no pre-dump reads requests there")
    waiting = subprocess.Popen(["sleep", "120"])  # the CLI, alive, not this dump's ancestor
    try:
        mine = {"writer": waiting.pid, "writer_started": start_time(waiting.pid),
                "init_started": start_time(ctr.pid)}
        requests.put(ctr.pid, lock_timeout_ms=1, **mine)
        mark = journal_mark()
        podman("container", "checkpoint", "--leave-running", "--keep", counter)
        events = journal_since(mark)
        assert [e["kind"] for e in events if e["event"] == "request-left"] == ["options"], events
        assert not [e for e in events if e["event"] == "request-dropped"], events
        assert requests.peek(ctr.pid)["writer"] == waiting.pid  # there for the CLI's own dump
        assert rt_podman.inspect(counter).running
    finally:
        waiting.kill()
        waiting.wait()
        requests.drop(ctr.pid)


def test_what_a_cli_killed_before_its_dump_left_is_not_obeyed_by_the_next_dump(counter, tmp_path):
    """A `gpusnap push` killed after it wrote its requests and linked the pages
    CRIU will write into its own folder, before its dump: a plain `podman
    container checkpoint` next obeys neither (requests.for_dump), and CRIU
    writes this dump's memory into the checkpoint, not through the dead push's
    link (pages_aside.drop_others)."""
    from gpusnap import requests
    from gpusnap.criu.runtimes import runs_action_script
    from gpusnap.procs import start_time

    token = born(counter)
    ctr = rt_podman.inspect(counter)
    if not runs_action_script(ctr.runtime):  # e.g. trixie's crun (the version matrix)
        # its CRIU runs no pre-dump of gpusnap's, and so gpusnap never leaves a
        # request or a pages link under it (podman_source: nothing set aside)
        pytest.skip(f"{ctr.runtime} runs no CRIU action script: no push leaves requests there")
    writer = subprocess.Popen(["sleep", "60"])
    writer_started = start_time(writer.pid)
    writer.kill()
    writer.wait()
    aside = tmp_path / "dead-push"
    aside.mkdir()
    ctr.checkpoint_dir.mkdir(mode=0o700, exist_ok=True)
    (ctr.checkpoint_dir / "pages-1.img").symlink_to(aside / "pages-1.img")
    dead = {"writer": writer.pid, "writer_started": writer_started,
            "init_started": start_time(ctr.pid)}
    requests.put(ctr.pid, lock_timeout_ms=1, **dead)
    requests.put(ctr.pid, "pages", images=str(ctr.checkpoint_dir), aside=str(aside), **dead)
    mark = journal_mark()
    podman("container", "checkpoint", "--leave-running", "--keep", counter)
    pages = ctr.checkpoint_dir / "pages-1.img"
    assert pages.is_file() and not pages.is_symlink() and pages.stat().st_size > 0
    assert not (aside / "pages-1.img").exists()
    events = journal_since(mark)
    assert sorted(e["kind"] for e in events if e["event"] == "request-dropped") == \
        ["options", "pages"], events
    assert [e["links"] for e in events if e["event"] == "pages-links-dropped"] == [["pages-1.img"]]
    assert rt_podman.inspect(counter).running and born(counter) == token
    wait_counter(counter, read_counter(counter))
