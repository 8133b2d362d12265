"""containerd-shim-gpusnap-v1 under a real containerd 1.7 on a private socket.

Each module run starts its own containerd (config, root, state, socket and the
shims' socket directory in a fresh directory under /run), imports the demo
image from Podman, and drives tasks through `ctr --runtime io.containerd.gpusnap.v1`
(and the shim's own socket for Update, which ctr 1.7 lacks). Cleanup kills
this containerd, its shims and their zygote.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest
from google.protobuf import any_pb2

from tests.conftest import DEMO_IMAGE, run
from tests.integration.shim_containerd import (
    RUNTIME, SHIM, STAMPED_COUNTER, VENV_BIN, counter_value, ctr_checkpoint, private_containerd,
    read_tmp_c, remove, run_counter, shim_call, tasks, wait_counter, wait_status)
from tests.integration.shim_containerd import PrivateContainerd  # noqa: F401 (bench/shim_startup.py imports it here)


@pytest.fixture(scope="module")
def containerd():
    with private_containerd() as c:
        yield c


def _event_lines(proc: subprocess.Popen) -> list[str]:
    """`ctr events`' lines as they come (a thread reads them: no read blocks the test)."""
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")),
                     daemon=True).start()
    return lines


def _until_seen(lines: list[str], needle: str, poke=None, timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    while not any(needle in line for line in list(lines)):
        assert time.monotonic() < deadline, f"no {needle!r} event in {lines}"
        if poke:
            poke()
        time.sleep(0.05)


@contextlib.contextmanager
def _events(containerd) -> Iterator[list[str]]:
    """`ctr events`' lines as they come, subscribed before the block runs."""
    events = subprocess.Popen(["ctr", "--address", containerd.address, "events"], stdout=subprocess.PIPE,
                              text=True, env=containerd.env)
    lines = _event_lines(events)
    try:
        # subscribed before the task exists: a label change of the namespace comes back as an event
        _until_seen(lines, "/namespaces/update", poke=lambda: containerd.ctr(
            "namespaces", "label", containerd.namespace, f"probe={time.monotonic_ns()}"))
        yield lines
    finally:
        events.terminate()
        events.wait(timeout=10)


def test_run_rm_stdio_exit_code_and_events(containerd):
    with _events(containerd) as lines:
        res = containerd.ctr("run", "--rm", "--runtime", RUNTIME, DEMO_IMAGE, "io1",
                             "sh", "-c", "read line; echo out:$line; echo err >&2; exit 3",
                             check=False, input="from-stdin\n")
        _until_seen(lines, " /tasks/delete ")
    out = "".join(lines)
    assert res.returncode == 3, res.stderr
    assert res.stdout == "out:from-stdin\n"
    assert res.stderr.strip() == "err"
    assert "io1" not in containerd.ctr("containers", "ls", "-q").stdout.split()
    containerd.wait_no_shims()  # the shim exited after Shutdown

    seen = _task_events(out.splitlines(), containerd.namespace, "io1")
    assert list(seen) == ["/tasks/create", "/tasks/start", "/tasks/exit", "/tasks/delete"], out
    assert seen["/tasks/exit"]["exit_status"] == 3
    assert seen["/tasks/start"]["pid"] == seen["/tasks/exit"]["pid"] > 0


def _task_events(lines: list[str], namespace: str, task: str) -> dict[str, dict]:
    """The first event of each /tasks/ topic of TASK, from `ctr events`' lines
    (date time zone zone namespace topic json), in the order they came."""
    seen: dict[str, dict] = {}
    for line in lines:
        parts = line.split(" ", 6)
        if len(parts) == 7 and parts[4] == namespace and parts[5].startswith("/tasks/"):
            body = json.loads(parts[6])
            if body.get("container_id") == task:
                seen.setdefault(parts[5], body)
    return seen


# containerd's own cgroup v1 monitor says /tasks/oom for every task too (on v2
# only the shim does): left out, so that what is seen is the shim's.
CGROUPS_MONITOR = "io.containerd.monitor.v1.cgroups"


def test_a_task_the_oom_killer_ends_is_said_as_tasks_oom():
    """A task over its memory limit is killed by the kernel: the shim says
    /tasks/oom (CRI's "OOMKilled"), and its exit is 137 (SIGKILL). A task
    that ends on its own says no such thing (the test above)."""
    with private_containerd(disabled=(CGROUPS_MONITOR,)) as containerd, _events(containerd) as lines:
        # 512 MiB of string under a 32 MiB limit (ctr sets no swap limit: a host with
        # swap would page it out, and these have none)
        res = containerd.ctr("run", "--rm", "--memory-limit", str(32 << 20), "--runtime", RUNTIME,
                             DEMO_IMAGE, "oom1", "busybox", "awk",
                             'BEGIN { s = "x"; while (length(s) < 5e8) s = s s; print length(s) }',
                             check=False, timeout=60)
        _until_seen(lines, " /tasks/delete ")
    seen = _task_events(lines, containerd.namespace, "oom1")
    assert res.returncode == 137, (res.returncode, res.stdout, res.stderr)
    assert "/tasks/oom" in seen, "".join(lines)
    assert seen["/tasks/exit"]["exit_status"] == 137, seen


def test_stdin_piped_in_reaches_the_process_whole(containerd):
    # ctr sends CloseIO once its own stdin is at EOF, with a pipe's worth still in
    # the FIFO: the process must read all of it (983,040 of 1,000,000 before)
    data = "x" * 999_999 + "\n"
    res = containerd.ctr("run", "--rm", "--runtime", RUNTIME, DEMO_IMAGE, "io2", "busybox", "wc", "-c",
                         input=data)
    assert res.stdout.split() == ["1000000"], res


def test_terminal(containerd):
    # ctr sends its window size (ResizePty) only after Start: wait for it in the container.
    script = "tty; n=0; until busybox stty -a 2>/dev/null | grep -q \"rows [1-9]\" || [ $n -gt 50 ]; do " \
             "n=$((n+1)); sleep 0.1; done; busybox stty -a"
    cmd = (f"ctr --address {containerd.address} --namespace {containerd.namespace} run -t --rm "
           f"--runtime {RUNTIME} {DEMO_IMAGE} tty1 sh -c '{script}'")
    res = run(["script", "-qec", f"stty rows 33 cols 77; {cmd}", "/dev/null"], env=containerd.env)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "/dev/pts/" in res.stdout, res.stdout  # the process has a pty
    assert "rows 33; columns 77;" in res.stdout, res.stdout  # ctr's ResizePty reached it


def memory_limit(pid: int) -> int:
    """The memory cgroup limit of PID (cgroup v1 or v2)."""
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return int(Path(f"/sys/fs/cgroup/memory{path}/memory.limit_in_bytes").read_text())
        if controllers == "" and Path("/sys/fs/cgroup/cgroup.controllers").exists():
            return int(Path(f"/sys/fs/cgroup{path}/memory.max").read_text())
    raise AssertionError(f"no memory cgroup for {pid}")


def test_exec_ls_ps_update_pause_resume_kill(containerd):
    c = containerd
    run_counter(c, "ctr1")
    pid, status = tasks(c)["ctr1"]
    assert status == "RUNNING" and pid > 0
    assert os.path.exists(f"/proc/{pid}")

    res = c.ctr("tasks", "exec", "--exec-id", "e1", "ctr1", "sh", "-c", "echo exec-out; exit 7", check=False)
    assert res.returncode == 7 and res.stdout == "exec-out\n"

    c.ctr("tasks", "exec", "-d", "--exec-id", "sleeper", "ctr1", "sleep", "300")
    ps = c.ctr("tasks", "ps", "ctr1").stdout
    assert str(pid) in ps and "sleeper" in ps  # exec'd pids carry their exec id

    # ctr 1.7 has no `tasks update`: call the shim's Update as containerd's Tasks.Update would.
    shim_call(c, "ctr1", "Update", id="ctr1", resources=any_pb2.Any(
        type_url="types.containerd.io/opencontainers/runtime-spec/1/LinuxResources",
        value=json.dumps({"memory": {"limit": 96 << 20}}).encode()))
    assert memory_limit(pid) == 96 << 20

    c.ctr("tasks", "pause", "ctr1")
    wait_status(c, "ctr1", "PAUSED")
    frozen = int((Path(f"/proc/{pid}/root/tmp/c")).read_text())
    time.sleep(0.5)
    assert int((Path(f"/proc/{pid}/root/tmp/c")).read_text()) == frozen
    c.ctr("tasks", "resume", "ctr1")
    wait_status(c, "ctr1", "RUNNING")
    wait_counter(c, "ctr1", frozen)

    c.ctr("tasks", "kill", "-s", "KILL", "ctr1")
    wait_status(c, "ctr1", "STOPPED")
    assert not os.path.exists(f"/proc/{pid}")
    c.ctr("tasks", "delete", "ctr1")
    assert "ctr1" not in tasks(c)
    c.ctr("containers", "delete", "ctr1")


# Counts from start-time-in-seconds * 100000: a fresh start after the checkpoint
# would begin at least 100000 higher, a restored one goes on where it stopped.

def test_checkpoint_then_restore_continues(containerd):
    c = containerd
    c.ctr("run", "-d", "--runtime", RUNTIME, DEMO_IMAGE, "ck1", "sh", "-c", STAMPED_COUNTER)
    wait_counter(c, "ck1", 0)
    before = read_tmp_c(tasks(c)["ck1"][0])
    ctr_checkpoint(c, "ck1", "localhost/ck1:ckpt")
    assert tasks(c)["ck1"][1] == "RUNNING"  # no --exit: the task goes on
    assert "localhost/ck1:ckpt" in c.ctr("images", "ls", "-q").stdout.split()
    remove(c, "ck1")
    time.sleep(1.0)  # a fresh start would now stamp a later second

    c.ctr("containers", "restore", "--live", "--rw", "ck1", "localhost/ck1:ckpt")
    wait_status(c, "ck1", "RUNNING")
    pid = tasks(c)["ck1"][0]
    first = read_tmp_c(pid)
    assert before <= first < before + 50000, (before, first)
    assert wait_counter(c, "ck1", first) > first  # and it keeps counting
    remove(c, "ck1")


def test_containerd_restart_keeps_task(containerd):
    c = containerd
    run_counter(c, "rs1")
    pid, _ = tasks(c)["rs1"]
    shim = c.server_of("rs1")["pid"]
    c.restart()
    assert c.server_of("rs1")["pid"] == shim and Path(f"/proc/{shim}").exists()  # the same shim serves on
    assert tasks(c)["rs1"] == (pid, "RUNNING")
    value = counter_value(c, "rs1")
    wait_counter(c, "rs1", value)
    c.ctr("tasks", "kill", "-s", "KILL", "rs1")
    wait_status(c, "rs1", "STOPPED")  # the exit is seen through the reconnected shim
    c.ctr("tasks", "delete", "rs1")
    c.ctr("containers", "delete", "rs1")


def test_killed_shim_is_cleaned_up_by_delete(containerd):
    c = containerd
    run_counter(c, "dead1")
    pid, _ = tasks(c)["dead1"]
    os.kill(c.server_of("dead1")["pid"], signal.SIGKILL)
    # containerd sees the connection drop and runs `SHIM delete`: runc force-deletes the container.
    deadline = time.monotonic() + 15
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not os.path.exists(f"/proc/{pid}")
    assert "dead1" not in tasks(c)
    root = f"/run/containerd/runc/{c.namespace}"
    assert run(["runc", "--root", root, "state", "dead1"]).returncode != 0
    assert [p.name for p in c.shim_dir.glob("*.sock") if p.name != "zygote.sock"] == []  # `delete` removed it
    assert not [d for d in c.shim_servers().values() if d["bundle"].endswith("/dead1")]
    c.ctr("containers", "delete", "dead1")


def test_task_metrics_are_the_containers_own_cgroup_counters(containerd):
    """`ctr task metrics` (nerdctl stats, the CRI's stats) decodes the shim's
    Stats: this task's cgroup, its memory limit as `ctr run` set it."""
    c = containerd
    c.ctr("run", "-d", "--memory-limit", str(64 << 20), "--runtime", RUNTIME, DEMO_IMAGE, "met1",
          "sh", "-c", "while :; do i=$((i+1)); done")
    try:
        time.sleep(0.5)  # its loop has run a while: CPU time to see
        first = json.loads(c.ctr("tasks", "metrics", "--format", "json", "met1").stdout)
        time.sleep(0.5)
        later = json.loads(c.ctr("tasks", "metrics", "--format", "json", "met1").stdout)
        table = c.ctr("tasks", "metrics", "met1").stdout
    finally:
        remove(c, "met1")
    memory = first["memory"]
    if "usage_limit" in memory:  # cgroup v2
        assert memory["usage_limit"] == 64 << 20 and memory["usage"] > 0, first
        assert later["cpu"]["usage_usec"] > first["cpu"]["usage_usec"] > 0, (first, later)
    else:
        assert memory["usage"]["limit"] == 64 << 20 and memory["usage"]["usage"] > 0, first
        assert later["cpu"]["usage"]["total"] > first["cpu"]["usage"]["total"] > 0, (first, later)
        assert f"memory.limit_in_bytes    {64 << 20}" in table, table
    assert first["pids"]["current"] >= 1
    res = c.ctr("tasks", "metrics", "met1", check=False)  # gone: said, no traceback
    assert res.returncode != 0 and "Traceback" not in res.stderr


def test_bad_invocation_is_one_line():
    res = run([f"{VENV_BIN}/{SHIM}", "-namespace", "x", "frobnicate"])
    assert res.returncode == 2
    assert res.stderr.count("\n") == 1 and "unknown action 'frobnicate'" in res.stderr
    assert "Traceback" not in res.stderr


def test_delete_of_an_empty_bundle_answers_a_delete_response(tmp_path):
    from gpusnap.proto import load

    res = subprocess.run([f"{VENV_BIN}/{SHIM}", "-namespace", "x", "-address", "/nonexistent/c.sock", "-id", "gone",
                          "-bundle", str(tmp_path), "delete"], capture_output=True)
    assert res.returncode == 0, res.stderr
    msg = load().shim.DeleteResponse.FromString(res.stdout)
    assert msg.exit_status == 137
    assert abs(msg.exited_at.ToNanoseconds() - time.time_ns()) < 10e9


def test_delete_after_a_shim_died_mid_restore_releases_criu_s_yard_and_the_unpacked_checkpoint(tmp_path):
    """A shim SIGKILLed while runc restored leaves CRIU's cgroup yard mounted
    in its work folder and containerd 1.7's ctrd-checkpoint* copy: `SHIM
    delete` (containerd runs it for a dead shim) takes both away, and asks
    runc as the shim ran it (SystemdCgroup: --systemd-cgroup)."""
    from gpusnap.shim import bundle as bundle_state

    bundle, work = tmp_path / "bundle", tmp_path / "bundle" / "criu-work"
    yard = work / ".criu.cgyard.AbC123"
    yard.mkdir(parents=True)
    unpacked = tmp_path / "ctrd-checkpoint123"
    (unpacked / "criu").mkdir(parents=True)
    (unpacked / "criu" / "pages-1.img").write_bytes(b"x" * 4096)
    runc_args = tmp_path / "runc-args"
    fake_runc = tmp_path / "runc"
    fake_runc.write_text(f'#!/bin/sh\necho "$@" > {runc_args}\n')
    fake_runc.chmod(0o755)
    bundle_state.write_state(str(bundle), "/run/r/ns", str(fake_runc), True, str(unpacked), str(work))
    try:
        run(["mount", "-t", "tmpfs", "yard", str(yard)], check=True)
        (yard / "unified").mkdir()
        run(["mount", "-t", "tmpfs", "cg", str(yard / "unified")], check=True)  # as CRIU stacks host cgroups
        (work / "restore.log").write_text("Error (criu/cr-restore.c:1): the restore's own words\n")
        state = tmp_path / "state"
        res = subprocess.run([f"{VENV_BIN}/{SHIM}", "-namespace", "ns", "-id", "r1", "-bundle", str(bundle),
                              "delete"], capture_output=True, timeout=60,
                             env={**os.environ, "GPUSNAP_STATE_DIR": str(state)})
        assert res.returncode == 0, res.stderr
        kept = list((state / "logs").glob("restore-r1-*.log"))  # runc's error named it: kept, not lost
        assert len(kept) == 1 and "the restore's own words" in kept[0].read_text(), kept
        assert not work.exists()
        assert runc_args.read_text().split() == ["--root", "/run/r/ns", "--systemd-cgroup", "delete", "--force", "r1"]
        assert not os.path.ismount(yard) and not yard.exists()
        assert not unpacked.exists()
        assert _delete_status(res.stdout) == 137
    finally:
        for point in (yard / "unified", yard):
            if os.path.ismount(point):
                run(["umount", "-l", str(point)])


def _delete_status(out: bytes) -> int:
    from gpusnap.proto import load
    return load().shim.DeleteResponse.FromString(out).exit_status


def test_zygote_forks_later_shims_and_retires_on_code_change(containerd):
    c = containerd
    c.ctr("run", "--rm", "--runtime", RUNTIME, DEMO_IMAGE, "z0", "sh", "-c", ":")  # makes sure one runs
    zygote = c.zygote_pid()
    assert zygote is not None
    c.ctr("run", "-d", "--runtime", RUNTIME, DEMO_IMAGE, "z1", "sleep", "300")
    assert c.server_of("z1")["origin"] == "zygote"
    remove(c, "z1")

    # The shim's code changes on disk (an upgrade): the old zygote must not serve it.
    # The installed package's file (an editable install points at this tree, make test's does not).
    installed = run([f"{VENV_BIN}/python", "-I", "-c",  # -I: not this tree from the cwd
                     "import gpusnap.shim; print(gpusnap.shim.__file__)"])
    marker = Path(installed.stdout.strip())
    assert marker.is_file(), installed.stderr
    os.utime(marker)
    c.ctr("run", "-d", "--runtime", RUNTIME, DEMO_IMAGE, "z2", "sleep", "300")
    assert c.server_of("z2")["origin"] == "cold"
    assert not Path(f"/proc/{zygote}").exists() or Path(f"/proc/{zygote}/status").read_text().find("zombie") > 0
    deadline = time.monotonic() + 15
    while c.zygote_pid() in (None, zygote) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert c.zygote_pid() not in (None, zygote)  # a fresh one took over
    remove(c, "z2")


def test_failed_create_reports_runc_error_and_leaves_nothing(containerd):
    c = containerd
    res = c.ctr("run", "--rm", "--runtime", RUNTIME, DEMO_IMAGE, "bad1", "/no/such/binary", check=False)
    assert res.returncode != 0
    assert "/no/such/binary" in res.stderr and "no such file or directory" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr
    assert "bad1" not in tasks(c)
    assert run(["runc", "--root", f"/run/containerd/runc/{c.namespace}", "state", "bad1"]).returncode != 0
    assert not any(str(c.dir) in line and "bad1" in line for line in Path("/proc/self/mounts").read_text().splitlines())
    c.wait_no_shims()
    c.ctr("containers", "delete", "bad1", check=False)


def test_protos_build_from_scratch_with_containerd_wire_names(tmp_path):
    out = tmp_path / "pb"
    res = run([f"{VENV_BIN}/python", "-m", "gpusnap.proto.build", "--out", str(out)])
    assert res.returncode == 0, res.stderr
    probe = (
        "import sys; sys.path.insert(0, sys.argv[1]);"
        "from gpusnap_pb import shim_pb2, task_events_pb2, events_service_pb2;"
        "t = shim_pb2.DESCRIPTOR.services_by_name['Task'];"
        "print(t.full_name, ' '.join(m.name for m in t.methods));"
        "print(task_events_pb2.TaskExit.DESCRIPTOR.full_name,"
        " events_service_pb2.DESCRIPTOR.services_by_name['Events'].full_name)"
    )
    res = run([f"{VENV_BIN}/python", "-c", probe, str(out)], check=True)
    service, events = res.stdout.splitlines()
    assert service == ("containerd.task.v3.Task State Create Start Delete Pids Pause Resume Checkpoint Kill Exec "
                       "ResizePty CloseIO Update Wait Stats Connect Shutdown")
    assert events == "containerd.events.TaskExit containerd.services.events.v1.Events"
