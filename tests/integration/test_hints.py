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
from tests.conftest import (GPUSNAP, assert_continued, assert_one_line_error, born, gpusnap,
                            gpusnap_json, podman, read_counter, run, wait_counter)
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


@pytest.mark.parametrize("verb", ["push", "migrate"])
def test_ctrl_c_during_a_push_is_said_to_be_the_users(plain_registry, counter, verb):
    """Ctrl-C reaches the whole process group, Podman with it: the line says the
    user interrupted, not that Podman failed. A push's container runs on; a
    migrate's runs on or is stopped with its checkpoint kept, and the line
    says which (it said only "Interrupted" before) and its way back works."""
    ref = plain_registry.ref(f"hints/int-{uuid.uuid4().hex[:6]}:v1")
    proc = subprocess.Popen([GPUSNAP, verb, counter, ref, "--plain-http"], text=True,
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
    assert "interrupted (ctrl-c)" in err.lower() and "podman failed" not in err, err
    assert "Traceback" not in err, err
    if verb == "migrate":
        state = podman("container", "inspect", counter, "--format", "{{.State.Status}}").stdout.strip()
        assert ("still running" in err) == (state == "running"), (state, err)
        if state != "running":  # stopped by the dump: the line says where it is and how back
            assert f"gpusnap restore {counter}" in err, err
            gpusnap_json("restore", counter)
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
    """`push --format podman` to a plain-HTTP registry: its line, and the one
    `gpusnap restore` gives to send the user to Podman, carry --tls-verify=false,
    and --name where the container's name is taken; each restores as printed."""
    ref = plain_registry.ref(f"hints/podman-{uuid.uuid4().hex[:6]}:v1")
    before, token = read_counter(counter), born(counter)
    pushed = gpusnap_json("push", counter, ref, "--format", "podman", "--stop", "--plain-http")
    command = pushed["restore_command"]
    assert "--tls-verify=false" in command and f"--name {counter}-2" in command, command
    try:
        assert shell(command).returncode == 0, command  # beside the stopped original
        assert_continued(f"{counter}-2", before, token)
        podman("rm", "-f", "-t", "0", counter, f"{counter}-2")
        res = gpusnap("restore", ref, "--plain-http")
        assert_one_line_error(res, "is a Podman checkpoint image")
        [command] = re.findall(r"`(podman pull [^`]+)`", res.stderr)
        assert command == pushed["restore_command"].replace(f" --name {counter}-2", "")
        assert shell(command).returncode == 0, command
        assert_continued(counter, before, token)
    finally:
        run(["podman", "rm", "-f", "-t", "0", f"{counter}-2"])
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


# -- The README's examples, as a user types them ------------------------------

README = Path(__file__).resolve().parents[2] / "README.md"
README_REF = "reg.example.com/ckpt/app:v1"


def readme_examples() -> list[str]:
    """Every command line of the README's "Use" section, its comment cut off."""
    use = README.read_text().split("\n## Use\n", 1)[1].split("\n## ", 1)[0]
    return [re.sub(r"\s+#.*", "", line).strip()
            for block in re.findall(r"```sh\n(.*?)```", use, re.S)
            for line in block.splitlines() if line.strip()]


def as_typed(example: str, ctr: str, ref: str) -> str:
    """The example with its placeholders filled in: the container, the loopback
    registry (plain HTTP, so --plain-http as the README says), the fuller form
    of [optional] parts, the first of alternatives; the archive keeps its name."""
    typed = example.replace("CTR|ctr.tar.zst|DIR", "CTR")
    typed = re.sub(r"\[([^\]]+)\]", r"\1", typed)
    typed = typed.replace(README_REF, f"{ref} --plain-http")
    typed = re.sub(r"\bNEW\b", f"{ctr}-new", typed)
    return re.sub(r"\bCTR\b", ctr, typed)


def status(name: str) -> str:
    return podman("inspect", "-f", "{{.State.Status}}", name).stdout.strip()


class Example:
    """One README line run in ``cwd`` against the running container ``ctr``."""

    def __init__(self, line: str, ctr: str, ref: str, cwd: Path):
        self.typed, self.ctr, self.ref, self.cwd = as_typed(line, ctr, ref), ctr, ref, cwd
        self.before, self.token = read_counter(ctr), born(ctr)

    def run(self) -> subprocess.CompletedProcess:
        res = run(["bash", "-c", self.typed], cwd=self.cwd)
        assert "Traceback" not in res.stdout + res.stderr, (self.typed, res)
        return res

    def ok(self) -> subprocess.CompletedProcess:
        res = self.run()
        assert res.returncode == 0, (self.typed, res.stdout, res.stderr)
        return res

    def archived(self, leave_running: bool = False) -> None:
        """ctr.tar.zst of the container, its name then free unless ``leave_running``."""
        gpusnap_json("checkpoint", self.ctr, "--export", str(self.cwd / "ctr.tar.zst"),
                     *(["--leave-running"] if leave_running else []))
        if not leave_running:
            podman("rm", self.ctr)

    def pushed(self) -> None:
        """The container in the registry, moved there (its name free here)."""
        gpusnap_json("push", self.ctr, self.ref, "--plain-http", "--stop")
        podman("rm", self.ctr)

    def continued(self, name: str | None = None) -> None:
        assert_continued(name or self.ctr, self.before, self.token)


def _podman_checkpoint(ex: Example) -> None:
    ex.ok()
    assert (ex.cwd / "ctr.tar.zst").stat().st_size > 0 and status(ex.ctr) == "exited"


def _podman_restore(ex: Example) -> None:
    ex.archived()
    ex.ok()
    ex.continued()


def _checkpoint(ex: Example) -> None:
    ex.ok()
    assert (ex.cwd / "ctr.tar.zst").stat().st_size > 0
    ex.continued()  # --leave-running


def _restore_new_name(ex: Example) -> None:
    ex.archived(leave_running=True)
    ex.ok()
    ex.continued(f"{ex.ctr}-new")  # a copy beside the original, which runs on
    assert status(ex.ctr) == "running"


def _dry_run(ex: Example) -> None:
    ex.archived()
    res = ex.ok()
    assert "checks passed" in res.stdout, res.stdout
    assert podman("container", "exists", ex.ctr, check=False).returncode == 1


def _gpu_map_without_gpus(ex: Example) -> None:  # the GPU path is proven in tests/gpu
    ex.archived()
    assert_one_line_error(ex.run(), "the checkpoint holds no GPU state", hint="drop --gpu-map")


def _gpu_verb_without_gpus(ex: Example) -> None:
    res = ex.run()
    verbs = re.findall(r"`gpusnap (\w+)` applies to containers that use an NVIDIA GPU", res.stderr)
    assert res.returncode == 1 and verbs == re.findall(r"gpusnap (\w+)", ex.typed), res.stderr
    ex.continued()


def _inspect_archive(ex: Example) -> None:
    ex.archived()
    assert ex.ctr in ex.ok().stdout


def _gpus(ex: Example) -> None:
    assert "GPU" in ex.ok().stdout


def _doctor(ex: Example) -> None:
    assert "No errors" in ex.ok().stdout


def _push(ex: Example) -> None:
    assert f"container {ex.ctr}: checkpointed and still running" in ex.ok().stdout
    ex.continued()


def _inspect_ref(ex: Example) -> None:
    ex.pushed()
    assert ex.ctr in ex.ok().stdout


def _pull(ex: Example) -> None:
    ex.pushed()
    ex.ok()
    res = run(["podman", "container", "restore", "--import", "ctr.tar.zst"], cwd=ex.cwd)
    assert res.returncode == 0, res  # "an archive Podman imports"
    ex.continued()


def _restore_ref(ex: Example) -> None:
    ex.pushed()
    ex.ok()
    ex.continued()


def _migrate(ex: Example) -> None:
    res = ex.ok()
    assert status(ex.ctr) == "exited"
    [command] = re.findall(r"^\s*(gpusnap restore .+)$", res.stdout, re.M)
    podman("rm", ex.ctr)  # the target host has no such container
    assert run(["bash", "-c", command]).returncode == 0, command
    ex.continued()


def _push_podman_image(ex: Example) -> None:
    res = ex.ok()
    [command] = re.findall(r"restore with: (podman pull .+)$", res.stdout, re.M)
    try:
        restored = run(["bash", "-c", command])
        assert restored.returncode == 0, (command, restored)
        ex.continued(re.search(r"--name (\S+)", command).group(1))  # beside the original
    finally:
        run(["podman", "rmi", "-f", ex.ref])


EXAMPLES = {
    "podman container checkpoint --export ctr.tar.zst CTR": _podman_checkpoint,
    "podman container restore --import ctr.tar.zst": _podman_restore,
    "gpusnap checkpoint CTR --export ctr.tar.zst [--leave-running]": _checkpoint,
    "gpusnap restore ctr.tar.zst [--name NEW]": _restore_new_name,
    "gpusnap restore ctr.tar.zst --dry-run": _dry_run,
    "gpusnap restore ctr.tar.zst --gpu-map 0=1": _gpu_map_without_gpus,
    "gpusnap move CTR --gpu 1": _gpu_verb_without_gpus,
    "gpusnap inspect ctr.tar.zst": _inspect_archive,
    "gpusnap freeze CTR; gpusnap thaw CTR": _gpu_verb_without_gpus,
    "gpusnap gpus": _gpus,
    "gpusnap doctor [--fix]": _doctor,
    f"gpusnap push CTR|ctr.tar.zst|DIR {README_REF}": _push,
    f"gpusnap inspect {README_REF}": _inspect_ref,
    f"gpusnap pull {README_REF} -o ctr.tar.zst": _pull,
    f"gpusnap restore {README_REF}": _restore_ref,
    f"gpusnap migrate CTR {README_REF}": _migrate,
    f"gpusnap push --format podman CTR {README_REF}": _push_podman_image,
}


@pytest.mark.parametrize("line", readme_examples())
def test_the_readme_example_works_as_typed(line, plain_registry, counter, tmp_path):
    """Each example of the README's Use section, run through a shell as typed
    (placeholders filled in), does what its comment says; on this host without
    GPUs the GPU verbs give their one line."""
    assert line in EXAMPLES, f"a README example no test runs: add it to EXAMPLES: {line}"
    ref = plain_registry.ref(f"readme/app-{uuid.uuid4().hex[:6]}:v1")
    try:
        EXAMPLES[line](Example(line, counter, ref, tmp_path))
    finally:
        for extra in ("-new", "-2"):
            run(["podman", "rm", "-f", "-t", "0", counter + extra])


def test_every_readme_example_has_its_test():
    assert set(readme_examples()) == set(EXAMPLES)
