"""A user's first hour (issue 19): what push, migrate, restore and doctor say and
do by default, against real Podman, CRIU and a docker-registry on loopback.

The lines a user copies are run as printed (through a shell), and every hint
of the error paths here is asserted and, where it names a command, followed."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import uuid
from pathlib import Path

import pytest

from tests.conftest import (GPUSNAP, assert_continued, assert_one_line_error, born, gpusnap_json,
                            podman, read_counter, run, wait_counter)
from tests.integration.oci_registry import Registry, make_registry

pytestmark = pytest.mark.usefixtures("cache_dir")


@pytest.fixture(scope="module")
def plain_registry(tmp_path_factory) -> Registry:
    """HTTP, no login: the registry `make demo` starts."""
    reg = make_registry(tmp_path_factory.mktemp("plain-registry"), plain=True)
    yield reg
    reg.stop()


@pytest.fixture
def also_removed():
    """Names of containers a test makes beside its counter: removed afterwards."""
    names: list[str] = []
    yield names
    for n in names:
        run(["podman", "rm", "-f", "-t", "0", n])


def ref_in(registry: Registry) -> str:
    return registry.ref(f"first-hour/c-{uuid.uuid4().hex[:8]}:v1")


def dead_ref() -> str:
    """A reference to a port nothing listens on: a registry that is down."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"127.0.0.1:{port}/first-hour/gone:v1"


def status(name: str) -> str:
    return podman("container", "inspect", name, "--format", "{{.State.Status}}").stdout.strip()


def printed(out: str, label: str) -> str:
    """The command after ``label`` in human output (on its line, or the next)."""
    lines = out.splitlines()
    for i, line in enumerate(lines):
        if line.strip().startswith(label):
            rest = line.strip()[len(label):].strip()
            return rest or lines[i + 1].strip()
    raise AssertionError(f"no {label!r} line in:\n{out}")


def shell(command: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """As a user pastes it into bash."""
    return run(["bash", "-c", command], env=env)


def env_without_policy() -> dict:
    """This host as `make install` leaves it: no GPUSNAP_POLICY, no policy file."""
    assert not Path("/etc/gpusnap/policy.json").exists(), \
        "this test needs the state after install: no /etc/gpusnap/policy.json"
    return {k: v for k, v in os.environ.items() if k != "GPUSNAP_POLICY"}


# -- 1. push says what it did to the container; 2. its restore line works as printed --


def test_push_copies_by_default_says_so_and_its_restore_line_works_as_printed(
        plain_registry, counter, also_removed):
    ref = ref_in(plain_registry)
    before, token = read_counter(counter), born(counter)
    res = run([GPUSNAP, "push", counter, ref, "--plain-http"])
    assert res.returncode == 0, res.stderr
    assert f"container {counter}: checkpointed and still running" in res.stdout, res.stdout
    assert status(counter) == "running"  # a copy, as `podman push` is
    assert wait_counter(counter, before) > before
    command = printed(res.stdout, "restore with:")
    assert "--plain-http" in command and f"--name {counter}-2" in command, command
    assert "would refuse" not in res.stdout  # the session's policy accepts anything

    also_removed.append(f"{counter}-2")
    restored = shell(command)
    assert restored.returncode == 0, restored.stderr
    assert f"Restored {counter}-2" in restored.stdout and "running" in restored.stdout
    assert_continued(f"{counter}-2", before, token)  # the copy went on, not from 0
    assert status(counter) == "running"  # the original still runs beside it


def test_push_stop_says_stopped_and_its_restore_line_works_as_printed(
        plain_registry, counter, also_removed):
    ref = ref_in(plain_registry)
    before, token = read_counter(counter), born(counter)
    pushed = gpusnap_json("push", counter, ref, "--plain-http", "--stop")
    state = pushed["container_state"]
    assert (state["name"], state["status"], state["stopped"]) == (counter, "exited", True)
    assert status(counter) == "exited"
    assert pushed["restore_command"].startswith(f"gpusnap restore {pushed['pinned']} --plain-http")
    also_removed.append(f"{counter}-2")
    restored = shell(pushed["restore_command"])
    assert restored.returncode == 0, restored.stderr
    assert_continued(f"{counter}-2", before, token)

    res = run([GPUSNAP, "push", counter, ref_in(plain_registry), "--stop", "--leave-running",
               "--plain-http"])
    assert_one_line_error(res, "contradict", hint="pass --stop to move the container")


def test_migrate_prints_one_command_and_it_restores_once_the_container_is_gone(
        plain_registry, counter):
    ref = ref_in(plain_registry)
    before, token = read_counter(counter), born(counter)
    res = run([GPUSNAP, "migrate", counter, ref, "--plain-http"])
    assert res.returncode == 0, res.stderr
    assert "restore with:" not in res.stdout  # one command, not two that differ
    assert f"container {counter}: checkpointed and stopped (exited)" in res.stdout
    command = printed(res.stdout, "On the target host run:")
    assert "--plain-http" in command and "--name" not in command
    podman("rm", counter)
    restored = shell(command)
    assert restored.returncode == 0, restored.stderr
    assert_continued(counter, before, token)


def test_a_push_is_signed_by_this_host_and_its_restore_line_works_here_as_printed(
        plain_registry, counter, tmp_path, also_removed):
    """Trust out of the box: `make install` made this host's key and trusts it,
    push signs with it, and the restore it prints works here with no setup.
    Another host (GPUSNAP_KEYS_DIR stands in for its /etc/gpusnap/keys) refuses
    it, naming two commands; run as printed, they make it restore there too."""
    env = env_without_policy()
    before, token = read_counter(counter), born(counter)
    res = run([GPUSNAP, "push", counter, ref_in(plain_registry), "--plain-http"], env=env)
    assert res.returncode == 0, res.stderr
    assert "would refuse" not in res.stdout, res.stdout
    command = printed(res.stdout, "restore with:")
    name = re.search(r"--name (\S+)", command).group(1)
    also_removed.append(name)
    restored = shell(command, env=env)
    assert restored.returncode == 0, restored.stderr
    assert "signature: verified" in restored.stdout, restored.stdout
    assert_continued(name, before, token)
    podman("rm", "-f", "-t", "0", name)

    other = {**env, "GPUSNAP_KEYS_DIR": str(tmp_path / "other-host-keys")}
    # as `make install` leaves the other host: its own key made, and trusted there
    run([GPUSNAP, "key", "export", "-o", str(tmp_path / "its-own.pub")], env=other, check=True)
    refused = shell(command, env=other)
    assert_one_line_error(refused, "signed only by keys this host does not trust",
                          hint="gpusnap key trust signer.pub")
    export, trust = re.findall(r"`(gpusnap key [^`]+)`", refused.stderr)
    assert shell(f"cd {tmp_path} && {export}", env=env).returncode == 0  # on the pushing host
    assert shell(f"cd {tmp_path} && {trust}", env=other).returncode == 0  # on the other
    restored = shell(command, env=other)
    assert restored.returncode == 0, restored.stderr
    assert_continued(name, before, token)
    podman("rm", "-f", "-t", "0", name)

    # --no-sign: the push warns that this host would refuse it, and it is true
    res = run([GPUSNAP, "push", counter, ref_in(plain_registry), "--plain-http", "--no-sign"],
              env=env)
    assert res.returncode == 0, res.stderr
    assert "Warning: this host would refuse that restore" in res.stdout, res.stdout
    assert "is not signed" in res.stdout
    refused = shell(printed(res.stdout, "restore with:"), env=env)
    assert_one_line_error(refused, "is not signed")


def test_a_policy_file_decides_over_the_trusted_keys(plain_registry, counter, tmp_path):
    env = env_without_policy()
    # Signed with a key the policy trusts: no warning, and the line restores.
    run([GPUSNAP, "key", "generate", "--output", str(tmp_path / "signer")], check=True)
    policy = tmp_path / "policy.json"
    policy.write_text(json.dumps({"default": {"type": "reject"}, "scopes": {
        f"{plain_registry.host}/first-hour": {"type": "signedBy",
                                              "keyPaths": [str(tmp_path / "signer.pub")]}}}))
    policy.chmod(0o644)
    trusted = {**env, "GPUSNAP_POLICY": str(policy)}
    before, token = read_counter(counter), born(counter)
    res = run([GPUSNAP, "push", counter, ref_in(plain_registry), "--plain-http", "--json",
               "--sign-key", str(tmp_path / "signer.key")], env=trusted)
    pushed = json.loads(res.stdout)
    assert pushed["restore_refused"] is None, pushed["restore_refused"]
    restored = shell(pushed["restore_command"], env=trusted)
    assert restored.returncode == 0, restored.stderr
    assert "signature: verified" in restored.stdout
    name = re.search(r"--name (\S+)", pushed["restore_command"]).group(1)
    try:
        assert_continued(name, before, token)
    finally:
        run(["podman", "rm", "-f", "-t", "0", name])
    # signed by this host's key alone: the policy, not the trusted keys, decides
    res = run([GPUSNAP, "push", counter, ref_in(plain_registry), "--plain-http"], env=trusted)
    assert res.returncode == 0, res.stderr
    assert "Warning: this host would refuse that restore" in res.stdout, res.stdout
    assert "signed only by keys the policy does not trust" in res.stdout


# -- 3. one naming scheme: Podman's --tls-verify, ORAS's --plain-http and --ca-file ----


def test_tls_and_trust_flags_follow_podman_old_spellings_work_and_say_so(registry, counter,
                                                                          tmp_path):
    archive = tmp_path / "c.tar.zst"
    gpusnap_json("checkpoint", counter, "--export", str(archive), "--leave-running")
    ref = registry.ref(f"first-hour/tls-{uuid.uuid4().hex[:8]}:v1")
    login = ["--username", "gpusnap", "--password-stdin"]
    pw = "s3cret-pass\n"
    res = run([GPUSNAP, "push", str(archive), ref, *registry.flags()], input=pw)
    assert res.returncode == 0, res.stderr
    assert f"--ca-file {registry.ca}" in printed(res.stdout, "restore with:")

    res = run([GPUSNAP, "inspect", ref, *login], input=pw)  # self-signed, no --ca-file
    assert_one_line_error(res, "TLS", hint="--tls-verify=false")
    res = run([GPUSNAP, "inspect", ref, "--tls-verify=false", *login, "--json"], input=pw)
    assert res.returncode == 0 and res.stderr == "", res.stderr  # the hint's flag works
    res = run([GPUSNAP, "inspect", ref, "--insecure", *login, "--json"], input=pw)
    assert res.returncode == 0, res.stderr
    assert "--insecure is deprecated, use --tls-verify=false" in res.stderr
    res = run([GPUSNAP, "inspect", ref, "--insecure", "--tls-verify=true", *login], input=pw)
    assert res.returncode == 2 and "contradicts" in res.stderr

    for command in ("push", "pull", "restore", "inspect", "migrate"):
        text = run([GPUSNAP, command, "--help"], check=True).stdout
        assert "--tls-verify BOOL" in text and "--plain-http" in text and "--ca-file" in text
        assert re.search(r"--insecure\s+DEPRECATED: use --tls-verify=false", text), text
        if command in ("pull", "restore"):
            assert "--insecure-policy" in text
            assert re.search(r"--insecure-skip-verify\s+DEPRECATED: use --insecure-policy", text)


# -- 4. hints that are true ------------------------------------------------------------


def test_a_registry_that_is_down_gets_true_hints(counter, tmp_path):
    archive = tmp_path / "c.tar.zst"
    gpusnap_json("checkpoint", counter, "--export", str(archive), "--leave-running")
    ref = dead_ref()
    for args in (["inspect", ref], ["restore", ref], ["pull", ref, "-o", str(tmp_path / "x.tar")]):
        res = run([GPUSNAP, *args, "--plain-http"])
        assert_one_line_error(res, "cannot reach registry", "connection refused",
                              hint="check that the registry is up and the address is right")
        assert "resume" not in res.stderr  # nothing resumes for these
    res = run([GPUSNAP, "push", str(archive), ref, "--plain-http"])
    assert_one_line_error(res, "cannot reach registry",
                          hint="push again: chunks the registry already has are not sent again")


def test_a_mistyped_container_is_named_before_the_registry_is_asked():
    with socket.socket() as registry:  # listens and never answers: an ask would queue here
        registry.bind(("127.0.0.1", 0))
        registry.listen(8)
        registry.setblocking(False)
        ref = f"127.0.0.1:{registry.getsockname()[1]}/nc/counter:v1"
        res = run([GPUSNAP, "push", "no-such-ctr-x1", ref, "--plain-http"], timeout=120)
        assert_one_line_error(res, "no-such-ctr-x1: no such file, directory or container",
                              hint="`podman ps`")
        assert "registry" not in res.stderr
        res = run([GPUSNAP, "migrate", "no-such-ctr-x1", ref, "--plain-http"], timeout=120)
        assert_one_line_error(res, "no such container: no-such-ctr-x1", hint="`podman ps`")
        with pytest.raises(BlockingIOError):  # no connection came
            registry.accept()


def test_bad_paths_are_one_line_before_anything_is_done(counter, tmp_path):
    # A folder as the export: found out after the dump until it was checked first.
    res = run([GPUSNAP, "checkpoint", counter, "--export", str(tmp_path)])
    assert_one_line_error(res, "it is a folder; the container keeps running",
                          hint=f"pass a file, e.g. {tmp_path / counter}.tar.zst")
    assert status(counter) == "running" and not list(tmp_path.iterdir())
    # A name with brackets is said as typed (rich took "[/x]" for markup: a traceback).
    res = run([GPUSNAP, "restore", str(tmp_path / "a[/x].tar")])
    assert_one_line_error(res, f"no such file: {tmp_path}/a[/x].tar")


def test_skipped_verification_is_announced_only_when_it_was_skipped(
        plain_registry, counter, tmp_path, also_removed):
    env = env_without_policy()  # nothing would be trusted: only the skip lets it through
    archive = tmp_path / "c.tar.zst"
    gpusnap_json("checkpoint", counter, "--export", str(archive), "--leave-running")
    ref = ref_in(plain_registry)
    gpusnap_json("push", str(archive), ref, "--plain-http")

    # refused for other reasons: no word of a skipped verification
    res = run([GPUSNAP, "restore", ref, "--plain-http", "--insecure-policy"], env=env)
    assert_one_line_error(res, f"a container named {counter} already exists",
                          hint="restore with --name NEW")
    res = run([GPUSNAP, "restore", ref, "--name", counter, "--plain-http", "--insecure-policy"],
              env=env)  # --name's check runs beside the registry's
    assert_one_line_error(res, f"a container named {counter} already exists",
                          hint="restore with --name NEW")
    res = run([GPUSNAP, "pull", ref, "--plain-http", "--insecure-policy", "-o",
               str(tmp_path / "no-such-dir" / "x.tar.zst")], env=env)
    assert_one_line_error(res, "does not exist", hint="create that folder, or pass -o FILE")
    res = run([GPUSNAP, "restore", dead_ref(), "--plain-http", "--insecure-policy"], env=env)
    assert_one_line_error(res, "cannot reach registry")

    # skipped, and restored: said loudly, with the new and the old spelling
    for i, flag in enumerate(("--insecure-policy", "--insecure-skip-verify")):
        new = f"{counter}-skip{i}"
        also_removed.append(new)
        res = run([GPUSNAP, "restore", ref, "--plain-http", flag, "--name", new], env=env)
        assert res.returncode == 0, res.stderr
        assert "WARNING: signature verification skipped (--insecure-policy)" in res.stderr
        assert (flag == "--insecure-skip-verify") == ("deprecated" in res.stderr), res.stderr
        assert f"Restored {new}" in res.stdout and status(new) == "running"


# -- 5. small mismatches -----------------------------------------------------------------


def test_restore_help_says_name_works_for_registry_references():
    text = run([GPUSNAP, "restore", "--help"], check=True).stdout
    assert "archives only" not in text
    assert re.search(r"--name TEXT\s+Name of the restored container.*registry\s+reference",
                     text, re.S), text
    # (test_push_copies_by_default... runs a printed `restore REF --name NEW`)


def test_restore_name_of_a_local_checkpoint_says_what_to_do(counter, also_removed):
    gpusnap_json("checkpoint", counter)  # a local checkpoint: the container itself comes back
    res = run([GPUSNAP, "restore", counter, "--name", f"{counter}-2"])
    assert_one_line_error(res, "--name applies only", hint="drop --name")
    restored = gpusnap_json("restore", counter)  # as the hint says
    assert restored["container"]["status"] == "running"


def _nvidia_driver() -> bool:
    return shutil.which("nvidia-smi") is not None and run(["nvidia-smi", "-L"]).returncode == 0


def test_doctor_levels_ok_warning_error():
    res = run([GPUSNAP, "doctor", "--json"])
    report = json.loads(res.stdout)
    levels = {c["name"]: c["level"] for c in report["checks"]}
    assert set(levels.values()) <= {"ok", "warning", "error"}
    assert report["errors"] == sum(v == "error" for v in levels.values())
    assert res.returncode == (1 if report["errors"] else 0)
    assert report["errors"] == 0, report  # `make install` set this host up
    driver = next(c for c in report["checks"] if c["name"] == "nvidia driver")
    human = run([GPUSNAP, "doctor"]).stdout
    if _nvidia_driver():
        assert driver["level"] == "ok"
        return
    # no GPU driver: a warning that names what is off, not "ok"
    assert driver["level"] == "warning" and report["warnings"] >= 1
    for feature in ("GPU memory in checkpoints", "gpusnap move", "gpusnap freeze"):
        assert feature in driver["detail"]
    assert re.search(r"^warning  nvidia driver .*off on this host", human, re.M), human
    assert re.search(r"^No errors, \d+ warnings?\.$", human, re.M), human
