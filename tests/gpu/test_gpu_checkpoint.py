"""On an NVIDIA GPU: real Podman + runc + CRIU 4 + the driver's checkpoint API."""

from __future__ import annotations

import json
import subprocess
import threading
import time

import pytest

from gpusnap.gpu.cuda import CudaDriver, ProcessState
from gpusnap.gpu.quiesce import states
from tests.conftest import (assert_one_line_error, gpusnap, gpusnap_json, journal_mark,
                            journal_since, podman)
from tests.gpu import harness
from tests.unit import turn_holder

HOLD_S = 8.0  # a guardian's hold, long beside the second checkpoint's start

GIB = 1 << 30


def _status(name: str) -> str:
    return podman("inspect", name, "--format", "{{.State.Status}}").stdout.strip()


def podman_export_import(ctr: harness.CudaContainer, archive) -> None:
    """Unchanged Podman commands on a 2 GiB CUDA container: checkpoint --export
    (the GPU freed, the manifest written by gpusnap's action script), rm,
    restore --import (its GPU memory back, every element compared)."""
    used_running = harness.gpu_memory_used()
    podman("container", "checkpoint", "--export", str(archive), ctr.name)
    used_checkpointed = harness.gpu_memory_used()
    assert used_running - used_checkpointed >= 2 * GIB, (used_running, used_checkpointed)
    gpu = gpusnap_json("inspect", str(archive))["gpu"]
    assert gpu["quiesced_by"] == "gpusnap" and len(gpu["gpus"]) == 1
    assert gpu["gpu_memory_bytes"] >= 2 * GIB
    assert gpu["processes"][0]["comm"].startswith("python")
    podman("rm", ctr.name)
    its = ctr.iterations()
    podman("container", "restore", "--import", str(archive))
    ctr.wait_running(above=its)
    ctr.verify()
    assert harness.gpu_memory_used() - used_checkpointed >= 2 * GIB


def test_podman_export_import_restores_gpu_memory(cuda_ctr, tmp_path):
    podman_export_import(cuda_ctr, tmp_path / "cuda.tar.zst")


def test_a_restarted_container_fails_the_restore_checks(cuda_ctr):
    """What the restore tests check catches a container started afresh in place of
    a restore: its workers drew another seed, and their GPU data differs from the
    tensors the original run made."""
    its, seeds = cuda_ctr.iterations(), cuda_ctr.seeds
    podman("restart", "-t", "0", cuda_ctr.name)
    deadline = time.monotonic() + 120
    while cuda_ctr.born() == seeds and time.monotonic() < deadline:
        time.sleep(0.1)
    with pytest.raises(AssertionError, match="started afresh"):
        cuda_ctr.assert_restored(seeds, its)
    with pytest.raises(AssertionError, match="contents differ"):
        cuda_ctr.verify()


def test_gpusnap_checkpoint_restore_two_processes(cuda_ctr2, tmp_path):
    archive = tmp_path / "two.tar.zst"
    result = gpusnap_json("checkpoint", cuda_ctr2.name, "--export", str(archive))
    gpu = result["gpu"]
    assert len(gpu["processes"]) == 2
    assert set(gpu["timing"]) >= {"lock", "checkpoint"}
    podman("rm", cuda_ctr2.name)
    its = cuda_ctr2.iterations()
    restored = gpusnap_json("restore", str(archive))
    assert [p["state"] for p in restored["gpu_processes"]] == ["RUNNING", "RUNNING"], restored
    cuda_ctr2.wait_running(above=its)
    cuda_ctr2.verify()


def test_leave_running_gives_the_gpu_back(cuda_ctr, tmp_path):
    archive = tmp_path / "live.tar.zst"
    result = gpusnap_json("checkpoint", cuda_ctr.name, "--export", str(archive),
                          "--leave-running")
    # The guardian restores the GPU state once CRIU has let the container go, and
    # the command returns only once it has (ops/gpu_back.py): back as it returns.
    assert result["gpu_back"] is True and "gpu_back_detail" not in result, result
    assert 0 <= result["gpu_back_seconds"] < 180, result
    driver = CudaDriver()
    assert all(driver.state(p) == ProcessState.RUNNING for p in harness.host_pids(cuda_ctr.name))
    cuda_ctr.wait_running(above=cuda_ctr.iterations(), timeout=60)
    cuda_ctr.verify()


def test_a_checkpoint_while_a_guardian_holds_the_turn_waits_for_it(cuda_ctr, tmp_path):
    """A leave-running checkpoint's guardian restores the GPU memory after CRIU is
    done, holding the container's turn (gpu/turn.py). Under Podman the export
    usually outlasts it (run of 2026-11-29: the guardian was done 7 s before the
    first command returned), so the second checkpoint starts here while a
    process holds that turn as the guardian does, for HOLD_S: pre-dump waits for
    it, then quiesces the processes itself. Without the wait it quiesced
    nothing, and the guardian unlocked them under the second dump
    (tests/unit/test_turn.py has that race with pre-dump's real guardian). The
    second archive restores with the GPU data as it was."""
    first, second = tmp_path / "first.tar.zst", tmp_path / "second.tar.zst"
    mark = journal_mark()
    gpusnap_json("checkpoint", cuda_ctr.name, "--export", str(first), "--leave-running")
    init = int(podman("inspect", "-f", "{{.State.Pid}}", cuda_ctr.name).stdout.strip())
    holder = turn_holder.start(init, "guardian")
    threading.Timer(HOLD_S, turn_holder.stop, [holder]).start()
    gpusnap_json("checkpoint", cuda_ctr.name, "--export", str(second), "--leave-running")
    cuda_ctr.wait_running(above=cuda_ctr.iterations(), timeout=60)
    cuda_ctr.verify()  # the source runs on with its GPU back
    deadline = time.monotonic() + 30  # the second guardian records once its resume returned
    while True:
        events = [e for e in journal_since(mark)
                  if e.get("event") in ("quiesced", "guardian-resumed", "guardian-failed")]
        if len(events) >= 4 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    kinds = [e["event"] for e in events]
    assert kinds[:4] == ["quiesced", "guardian-resumed", "quiesced", "guardian-resumed"], events
    assert events[2]["turn_waited_s"] >= HOLD_S / 2, events[2]  # it waited for the holder
    podman("rm", "-f", cuda_ctr.name)
    its = cuda_ctr.iterations()
    restored = gpusnap_json("restore", str(second))
    assert [p["state"] for p in restored["gpu_processes"]] == ["RUNNING"], restored
    cuda_ctr.wait_running(above=its)
    cuda_ctr.verify()


def test_freeze_releases_gpu_memory_and_thaw_brings_it_back(cuda_ctr):
    before = harness.gpu_memory_used()
    frozen = gpusnap_json("freeze", cuda_ctr.name)
    assert len(frozen["pids"]) == 1
    during = harness.gpu_memory_used()
    assert before - during >= 2 * GIB, (before, during)
    stalled = cuda_ctr.iterations()
    time.sleep(1.0)
    assert cuda_ctr.iterations() == stalled  # blocked in CUDA, not running on
    assert _status(cuda_ctr.name) == "running"
    # off its GPU on purpose: doctor --fix leaves it (it restored a freeze before),
    # and a checkpoint or a freeze again is refused until the thaw
    doctor = json.loads(gpusnap("doctor", "--fix", "--json").stdout)
    shown = [c for c in doctor["checks"] if c["name"] == "gpu processes"][0]
    assert f"frozen by `gpusnap freeze`: {cuda_ctr.name}" in shown["detail"], shown
    assert not doctor["fixed"] and harness.gpu_memory_used() - during < GIB, doctor
    assert_one_line_error(gpusnap("checkpoint", cuda_ctr.name), "is frozen",
                          hint=f"`gpusnap thaw {cuda_ctr.name}` first")
    assert_one_line_error(gpusnap("freeze", cuda_ctr.name), "is frozen")
    gpusnap_json("thaw", cuda_ctr.name)
    cuda_ctr.wait_running(above=stalled)
    cuda_ctr.verify()
    assert harness.gpu_memory_used() - during >= 2 * GIB


def test_a_thaw_with_its_gpu_memory_taken_is_refused_and_the_container_stays_frozen(cuda_ctr):
    """Driver 580 refuses a process for good once its restore failed for memory,
    and a frozen container has no checkpoint to come back from: a thaw the GPU
    has no room for is refused before the driver is asked, and works once the
    memory is free again."""
    frozen = gpusnap_json("freeze", cuda_ctr.name)
    stalled = cuda_ctr.iterations()
    hog = harness.hold_memory(0, max(harness.gpu_memory_free(0) / GIB - 1.0, 1.0))
    try:
        assert_one_line_error(gpusnap("thaw", cuda_ctr.name), "frozen processes need",
                              "it stays frozen", hint=f"`gpusnap thaw {cuda_ctr.name}`")
        assert cuda_ctr.iterations() == stalled
        managed = states(CudaDriver(), frozen["pids"])
        assert set(managed.values()) == {ProcessState.CHECKPOINTED}, managed
    finally:
        hog.remove()
    gpusnap_json("thaw", cuda_ctr.name)
    cuda_ctr.wait_running(above=stalled)
    cuda_ctr.verify()


def test_lock_timeout_leaves_the_container_running(cuda_ctr):
    (cuda_ctr.status / "busy").write_text("1")
    deadline = time.monotonic() + 30
    while not (cuda_ctr.status / "w0.busy").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    res = gpusnap("freeze", cuda_ctr.name, "--timeout", "300")
    assert_one_line_error(res, "freeze of", "nothing changed")
    assert _status(cuda_ctr.name) == "running"
    driver = CudaDriver()
    assert all(driver.state(p) == ProcessState.RUNNING for p in harness.host_pids(cuda_ctr.name))
    cuda_ctr.wait_running(above=cuda_ctr.iterations(), timeout=60)
    cuda_ctr.verify()


def test_checkpoint_aborted_by_lock_timeout_keeps_container_running(cuda_ctr, tmp_path):
    """The CRIU action script fails the dump; Podman reports it; nothing is lost."""
    (cuda_ctr.status / "busy").write_text("1")
    deadline = time.monotonic() + 30
    while not (cuda_ctr.status / "w0.busy").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    res = gpusnap("checkpoint", cuda_ctr.name, "--export", str(tmp_path / "x.tar.zst"),
                  "--lock-timeout", "300")
    assert_one_line_error(res, "still running")
    assert _status(cuda_ctr.name) == "running"
    cuda_ctr.wait_running(above=cuda_ctr.iterations(), timeout=60)
    cuda_ctr.verify()


def test_a_child_forked_from_a_cuda_process_is_refused_before_anything(cuda_ctr, tmp_path):
    """torch.compile's compile workers (and DataLoader workers forked after CUDA
    started) are children that hold the driver's files: the driver cannot
    checkpoint them and CRIU cannot dump them. Refused in one line before the
    GPU is touched; once the child is gone the same checkpoint goes through."""
    fork = cuda_ctr.status / "fork"
    fork.write_text("1")
    forked = cuda_ctr.status / "w0.forked"
    deadline = time.monotonic() + 30
    while not forked.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    archive = tmp_path / "x.tar.zst"
    res = gpusnap("checkpoint", cuda_ctr.name, "--export", str(archive))
    assert_one_line_error(res, "forked from a CUDA process", "nothing was quiesced",
                          "still running", hint="shutdown_compile_workers()")
    assert not archive.exists()
    assert _status(cuda_ctr.name) == "running"
    managed = states(CudaDriver(), harness.host_pids(cuda_ctr.name))  # the child: not managed
    assert list(managed.values()) == [ProcessState.RUNNING], managed
    fork.unlink()
    deadline = time.monotonic() + 30
    while forked.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    gpusnap_json("checkpoint", cuda_ctr.name, "--export", str(archive))
    podman("rm", cuda_ctr.name)
    its = cuda_ctr.iterations()
    gpusnap_json("restore", str(archive))
    cuda_ctr.wait_running(above=its)
    cuda_ctr.verify()


def test_doctor_finds_and_fixes_a_process_left_checkpointed(cuda_ctr):
    """As if gpusnap had been killed between quiesce and CRIU's dump."""
    pid = harness.host_pids(cuda_ctr.name)[0]
    driver = CudaDriver()
    driver.lock(pid, 10_000)
    driver.checkpoint(pid)
    res = gpusnap("doctor", "--json")
    report = json.loads(res.stdout)
    assert res.returncode == 1 and [s["pid"] for s in report["stuck"]] == [pid]
    fixed = json.loads(gpusnap("doctor", "--fix", "--json").stdout)
    assert fixed["fixed"] == [pid]
    assert driver.state(pid) == ProcessState.RUNNING
    cuda_ctr.verify()


def test_gpusnap_killed_mid_checkpoint_leaves_it_restorable(cuda_ctr, tmp_path):
    """SIGKILL the CLI once the GPU is quiesced and the dump under way."""
    archive = tmp_path / "killed.tar.zst"
    before = harness.gpu_memory_used()
    cli = subprocess.Popen(["/usr/local/bin/gpusnap", "checkpoint", cuda_ctr.name, "--export",
                            str(archive)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while harness.gpu_memory_used() > before - GIB and time.monotonic() < deadline:
        time.sleep(0.05)
    assert time.monotonic() < deadline, "the GPU was never quiesced"
    cli.kill()
    cli.wait()
    # Podman and CRIU run on without the CLI; the export loses its reader and fails.
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and podman("ps", "-q", "--filter", "status=running",
                                                 "--filter", f"name=^{cuda_ctr.name}$").stdout.strip():
        if all(s == ProcessState.RUNNING for s in _driver_states(cuda_ctr)):
            break  # still running: the dump had not started
        time.sleep(0.2)
    assert not archive.exists(), "a half-written archive was left under the export's name"
    if _status(cuda_ctr.name) != "running":
        restored = gpusnap_json("restore", cuda_ctr.name)
        assert [p["state"] for p in restored["gpu_processes"]] == ["RUNNING"], restored
    report = json.loads(gpusnap("doctor", "--json").stdout)
    assert report["stuck"] == [], report
    cuda_ctr.wait_running(above=cuda_ctr.iterations(), timeout=60)
    cuda_ctr.verify()


def _driver_states(ctr: harness.CudaContainer) -> list[ProcessState]:
    driver = CudaDriver()
    return [driver.state(p) for p in harness.host_pids(ctr.name)]


def test_gpus_lists_the_gpu():
    inv = gpusnap_json("gpus")
    assert inv["error"] is None and inv["gpus"]
    g = inv["gpus"][0]
    assert g["uuid"].startswith("GPU-") and g["memory_total"] > 10 * GIB
    assert int(inv["driver_version"].split(".")[0]) >= 570


def _free_char_major() -> int:
    used = {int(line.split()[0]) for line in open("/proc/devices")
            if line.strip() and line.split()[0].isdigit()}
    return next(m for m in range(499, 240, -1) if m not in used)


def _as_if_uvm_were(major: int, src, dst) -> int:
    """SRC (a plain tar export) written to DST as a host whose nvidia-uvm had
    ``major`` would have written it: its entries in spec.dump and config.dump
    (devices and cgroup rules), and its nodes in CRIU's images of the
    container's tmpfs mounts. Returns this host's nvidia-uvm major."""
    import io
    import os
    import tarfile

    here = os.major(os.stat("/dev/nvidia-uvm").st_rdev)

    def spec_edit(spec: dict) -> None:
        linux = spec.get("linux") or {}
        for d in (linux.get("devices") or []) + ((linux.get("resources") or {}).get("devices") or []):
            if d.get("major") == here:
                d["major"] = major

    def member(out, info, data: bytes) -> None:
        info.size = len(data)
        out.addfile(info, io.BytesIO(data))

    with tarfile.open(src, "r|") as tin, tarfile.open(dst, "w", format=tarfile.PAX_FORMAT) as tout:
        for info in tin:
            if not info.isfile():
                tout.addfile(info)
                continue
            data = tin.extractfile(info).read()
            name = info.name.lstrip("./")
            if name == "spec.dump":
                spec = json.loads(data)
                spec_edit(spec)
                data = json.dumps(spec).encode()
            elif name == "config.dump":
                config = json.loads(data)
                spec_edit(config.get("spec") or {})
                data = json.dumps(config).encode()
            elif name.startswith("checkpoint/tmpfs-dev-") and name.endswith(".tar.gz.img"):
                inner_out = io.BytesIO()
                with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as a, \
                        tarfile.open(fileobj=inner_out, mode="w:gz") as b:
                    for i in a:
                        if i.ischr() and i.devmajor == here:
                            i.devmajor = major
                        b.addfile(i, a.extractfile(i) if i.isfile() else None)
                data = inner_out.getvalue()
            member(tout, info, data)
    return here


def test_a_checkpoint_from_a_host_that_numbered_nvidia_uvm_otherwise_restores(cuda_ctr, tmp_path):
    """nvidia-uvm's major is the driver's pick at module load: it differs between
    hosts (and across a reboot). `gpusnap restore` renumbers the checkpoint's
    shared GPU nodes to this host's (ops/gpu_plan.with_host_numbers): kept, the
    container's device rule allowed the old major and CRIU made the old node,
    and the restore failed. Another host is stood in for by rewriting a real
    export as that host would have written it."""
    packed, plain = tmp_path / "here.tar.zst", tmp_path / "here.tar"
    gpusnap_json("checkpoint", cuda_ctr.name, "--export", str(packed))
    subprocess.run(["zstd", "-dq", str(packed), "-o", str(plain)], check=True)
    packed.unlink()
    elsewhere = tmp_path / "elsewhere.tar"
    major = _free_char_major()
    here = _as_if_uvm_were(major, plain, elsewhere)
    podman("rm", cuda_ctr.name)
    its = cuda_ctr.iterations()
    gpusnap_json("restore", str(elsewhere))
    cuda_ctr.wait_running(above=its)
    cuda_ctr.verify()
    node = podman("exec", cuda_ctr.name, "ls", "-l", "/dev/nvidia-uvm").stdout.split()
    assert node[4] == f"{here},", node  # the node this host's driver answers on, not {major}
