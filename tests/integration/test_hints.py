"""Every hint works as printed: each command gpusnap prints after a misuse is
taken from its output and run through a shell exactly as printed, and must do
what the hint says. Misuses that print no command get one true line naming
the real cause (the verb asked for, the reference typed, root, Ctrl-C).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from gpusnap.cli.main import VERBS
from gpusnap.procs import process_tree
from tests.conftest import (GPUSNAP, assert_one_line_error, gpusnap, gpusnap_json, podman,
                            read_counter, run, wait_counter)
from tests.integration.oci_registry import make_registry

pytestmark = pytest.mark.usefixtures("cache_dir")  # each test its own chunk cache


def printed_commands(text: str, first_word: str) -> list[str]:
    """The commands in backticks that start with ``first_word`` (`podman rm -f X`)."""
    return [c for c in re.findall(r"`([^`]+)`", text) if c.split()[0] == first_word]


def shell(command: str) -> subprocess.CompletedProcess:
    """The printed command, run as a user would paste it."""
    return run(["bash", "-c", command])


@pytest.fixture(scope="module")
def plain_registry(tmp_path_factory):
    """HTTP, no login: as `make demo` runs one."""
    reg = make_registry(tmp_path_factory.mktemp("plain-registry"), plain=True)
    yield reg
    reg.stop()


def test_the_name_taken_hint_removes_a_running_container_as_printed(counter, tmp_path):
    archive = tmp_path / "c.tar.zst"
    gpusnap_json("checkpoint", counter, "--export", str(archive), "--leave-running")
    for dry in ([], ["--dry-run"]):  # the dry run makes the check the restore makes
        res = gpusnap("restore", str(archive), *dry)
        assert_one_line_error(res, f"a container named {counter} already exists")
    [remove] = printed_commands(res.stderr, "podman")
    assert shell(remove).returncode == 0, remove  # running, it is removed all the same
    gpusnap_json("restore", str(archive))
    wait_counter(counter, read_counter(counter))


def test_the_missing_tag_hint_lists_the_tags_as_printed(plain_registry, counter):
    repo = plain_registry.ref(f"hints/tags-{uuid.uuid4().hex[:6]}")
    gpusnap_json("push", counter, f"{repo}:v1", "--plain-http")
    res = gpusnap("restore", f"{repo}:v2", "--plain-http")
    assert_one_line_error(res, "no such tag")
    [tags] = printed_commands(res.stderr, "oras")
    listed = shell(tags)
    assert listed.returncode == 0 and "v1" in listed.stdout.split(), (tags, listed)


@pytest.mark.parametrize("typed,why", [
    ("{host}/nc/counter@sha256:1234", "bad digest"),
    ("{host}/NC/Counter:v1", "bad repository name"),
])
@pytest.mark.parametrize("verb", ["restore", "inspect"])
def test_a_malformed_reference_is_named_as_one_not_as_a_missing_file(plain_registry, verb,
                                                                      typed, why):
    res = gpusnap(verb, typed.format(host=plain_registry.host), "--plain-http")
    assert_one_line_error(res, "is not a registry reference", why)
    assert "no such file" not in res.stderr


@pytest.mark.parametrize("verb,args", [("move", ["--gpu", "1"]), ("thaw", []), ("freeze", [])])
def test_a_gpu_verb_on_a_cpu_container_names_itself(counter, verb, args):
    res = gpusnap(verb, counter, *args)
    assert_one_line_error(res, f"{counter} has no CUDA processes",
                          hint=f"`gpusnap {verb}` applies to containers that use an NVIDIA GPU")


def test_a_gpu_map_for_a_checkpoint_without_gpus_is_refused(counter, tmp_path):
    archive = tmp_path / "c.tar.zst"
    gpusnap_json("checkpoint", counter, "--export", str(archive), "--leave-running")
    podman("rm", "-f", "-t", "0", counter)
    res = gpusnap("restore", str(archive), "--gpu-map", "0=1")
    assert_one_line_error(res, "--gpu-map names GPUs, but the checkpoint holds no GPU state",
                          hint="drop --gpu-map")
    assert podman("container", "exists", counter, check=False).returncode == 1


def test_ctrl_c_during_a_push_is_said_to_be_the_users(plain_registry, counter):
    """Ctrl-C reaches the whole process group, Podman with it: the line says the
    user interrupted, not that Podman failed, and the container runs on."""
    ref = plain_registry.ref(f"hints/int-{uuid.uuid4().hex[:6]}:v1")
    proc = subprocess.Popen([GPUSNAP, "push", counter, ref, "--plain-http"], text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)  # its own group, as a terminal's job
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not _runs_podman_checkpoint(proc.pid):
            time.sleep(0.02)
        assert _runs_podman_checkpoint(proc.pid), "the push never started its checkpoint"
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, (proc.returncode, err)
    assert "Interrupted (Ctrl-C)" in err and "podman failed" not in err, err
    assert "Traceback" not in err, err
    wait_counter(counter, read_counter(counter))  # it runs on


def _runs_podman_checkpoint(pid: int) -> bool:
    for child in process_tree(pid):
        try:
            argv = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"checkpoint" in argv and any(a.endswith(b"podman") for a in argv[:1]):
            return True
    return False


# Each verb with arguments that would make it act (so only the root check stops it).
VERB_ARGS = {"checkpoint": ["ctr"], "restore": ["ctr"], "inspect": ["ctr"],
             "push": ["ctr", "127.0.0.1:5000/a/b:v1"], "pull": ["127.0.0.1:5000/a/b:v1"],
             "migrate": ["ctr", "127.0.0.1:5000/a/b:v1"], "move": ["ctr", "--gpu", "1"],
             "freeze": ["ctr"], "thaw": ["ctr"], "doctor": [], "status": []}
UNPRIVILEGED = {"gpus", "key"}  # read NVML, write key files: no root needed


def test_every_verb_as_a_non_root_user_says_root_in_one_line(tmp_path):
    assert set(VERB_ARGS) | UNPRIVILEGED == set(VERBS)
    nobody = ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups"]
    for verb, args in VERB_ARGS.items():
        res = run([*nobody, GPUSNAP, verb, *args], cwd=tmp_path)
        assert_one_line_error(res, "gpusnap needs root: CRIU", hint="sudo gpusnap")
    res = run([*nobody, GPUSNAP, "gpus"], cwd=tmp_path)
    assert "Traceback" not in res.stdout + res.stderr and "needs root" not in res.stderr, res
    # a key where nobody may write: one line (it was a traceback)
    res = run([*nobody, GPUSNAP, "key", "generate", "-o", str(tmp_path / "k")])
    assert_one_line_error(res, "cannot write the key pair", hint="a folder you can write")
    res = run([*nobody, GPUSNAP, "key", "generate", "-o", "/tmp/gpusnap-hint-key"], cwd="/tmp")
    try:
        assert res.returncode == 0 and "Generated an ed25519 key pair" in res.stdout, res
    finally:
        for suffix in (".key", ".pub"):
            Path("/tmp/gpusnap-hint-key" + suffix).unlink(missing_ok=True)


def test_a_pre_copy_round_says_what_it_did(plain_registry, counter):
    ref = plain_registry.ref(f"hints/pre-{uuid.uuid4().hex[:6]}:pre")
    res = run([GPUSNAP, "migrate", "-P", counter, ref, "--plain-http"])
    assert res.returncode == 0, res
    assert f"container {counter}: checkpointed and still running: a pre-copy round" in res.stdout
    assert "push copies" not in res.stdout, res.stdout
    wait_counter(counter, read_counter(counter))


def test_a_podman_image_restore_hint_carries_the_registry_flags(plain_registry, counter):
    """`push --format podman` to a plain-HTTP registry: `gpusnap restore` sends the
    user to Podman with --tls-verify=false, and that line restores as printed."""
    ref = plain_registry.ref(f"hints/podman-{uuid.uuid4().hex[:6]}:v1")
    pushed = gpusnap_json("push", counter, ref, "--format", "podman", "--stop", "--plain-http")
    assert "--tls-verify=false" in pushed["restore_command"], pushed["restore_command"]
    podman("rm", counter)
    res = gpusnap("restore", ref, "--plain-http")
    assert_one_line_error(res, "is a Podman checkpoint image")
    [command] = re.findall(r"`(podman pull [^`]+)`", res.stderr)
    assert command == pushed["restore_command"]
    try:
        restored = shell(command)
        assert restored.returncode == 0, restored
        wait_counter(counter, read_counter(counter))
    finally:
        run(["podman", "rmi", "-f", ref])


def test_the_pull_hint_restores_beside_the_running_original_as_printed(plain_registry, counter,
                                                                       tmp_path):
    ref = plain_registry.ref(f"hints/pull-{uuid.uuid4().hex[:6]}:v1")
    gpusnap_json("push", counter, ref, "--plain-http")  # a copy: the original runs on
    res = run([GPUSNAP, "pull", ref, "--plain-http", "-o", str(tmp_path / "c.tar.zst")])
    assert res.returncode == 0, res
    command = re.search(r"restore with: (.+?)(?:  \(|$)", res.stdout, re.M).group(1).strip()
    assert f"--name {counter}-2" in command, command
    try:
        assert shell(command).returncode == 0, command
        wait_counter(f"{counter}-2", 0)
    finally:
        run(["podman", "rm", "-f", "-t", "0", f"{counter}-2"])


def test_a_damaged_blob_is_repaired_the_way_the_hint_says(registry, counter, tmp_path):
    """A blob the registry serves damaged: pushing again alone sends nothing (the
    registry has that digest); the hint's registry-side step, then a push, does."""
    from tests.integration.oci_registry import PASSWORD

    ref = registry.ref(f"hints/damaged-{uuid.uuid4().hex[:6]}:v1")
    archive = tmp_path / "c.tar.zst"
    gpusnap_json("checkpoint", counter, "--export", str(archive), "--leave-running")
    podman("rm", "-f", "-t", "0", counter)

    def gs(*args: str) -> subprocess.CompletedProcess:
        return run([GPUSNAP, *args, *registry.flags()], input=PASSWORD + "\n")

    assert gs("push", str(archive), ref).returncode == 0
    manifest = json.loads(run(["oras", "manifest", "fetch", *registry.oras_flags(), ref],
                              check=True).stdout)
    layer = max(manifest["layers"], key=lambda l: l["size"])
    blob = registry.blob_file(layer["digest"])
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF
    blob.write_bytes(bytes(data))
    res = gs("restore", ref)
    assert_one_line_error(res, "does not match its digest", hint="push the checkpoint again")
    folder = re.search(r"the folder (\S+) in its storage", res.stderr).group(1)
    assert folder == str(blob.parent.relative_to(registry.storage)), folder
    # the step, as the registry's operator takes it; then the push sends that blob alone
    shutil.rmtree(registry.storage / folder)
    pushed = run([GPUSNAP, "push", str(archive), ref, *registry.flags(), "--json"],
                 input=PASSWORD + "\n")
    assert pushed.returncode == 0, pushed
    assert json.loads(pushed.stdout)["chunks_sent"] == 1
    assert gs("restore", ref).returncode == 0
    wait_counter(counter, read_counter(counter))
