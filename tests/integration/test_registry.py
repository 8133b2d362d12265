"""Checkpoints through a real OCI registry (docker-registry with TLS and htpasswd on
loopback): push, pull, restore, dedup of re-pushes, ORAS interop, failures."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest

from tests.conftest import (DEMO_IMAGE, GPUSNAP, COUNTER, RENAMING_HOLDER, assert_continued,
                            assert_one_line_error, born, gpusnap_json, journal_mark, journal_since,
                            podman, read_counter, run, wait_counter)
from tests.integration.oci_registry import PASSWORD, USER, Registry, make_registry


pytestmark = pytest.mark.usefixtures("cache_dir")  # each test its own chunk cache


def gs(*args: str, password: str = PASSWORD, **kw) -> subprocess.CompletedProcess:
    return run([GPUSNAP, *args], input=password + "\n", **kw)


def gs_json(*args: str, password: str = PASSWORD) -> dict:
    res = gs(*args, "--json", password=password)
    if res.returncode != 0:  # whole: pytest shortens a long assertion's tuple in the middle
        raise AssertionError(f"gpusnap {' '.join(args)} failed ({res.returncode}):\n"
                             f"{res.stdout}\n{res.stderr}")
    return json.loads(res.stdout)


def unique_ref(registry: Registry, tag: str = "v1") -> str:
    return registry.ref(f"ckpt/test-{uuid.uuid4().hex[:8]}:{tag}")


def test_a_leave_running_push_restores_or_is_refused_before_a_reference(name, registry):
    """push -R uploads Podman's export as Podman writes it, so a checkpoint whose
    open file was renamed before Podman wrote the root filesystem cannot be
    taken again under the upload: the push refuses it before the manifest and
    takes it all again, up to three times. What it tags restores beside the
    running original; else no tag exists, one line says so, the container runs
    on, and the hint's way (--stop: push keeps a container running by default)
    restores."""
    podman("run", "-d", "--name", name, "--network", "none", DEMO_IMAGE, "sh", "-c",
           RENAMING_HOLDER)
    wait_counter(name, 3)
    token, ref = born(name), unique_ref(registry)
    repo, tag = ref.split("/", 1)[1].rsplit(":", 1)
    res = gs("push", name, ref, "--leave-running", *registry.flags())
    if res.returncode == 0:  # a try CRIU saw through, or one that missed no rename
        other = f"{name}-copy"
        try:
            gs_json("restore", ref, "--name", other, *registry.flags())
            assert_continued(other, 0, token)
        finally:
            run(["podman", "rm", "-f", "-t", "0", other])
        tries = re.search(r"taken (\d) times", res.stdout)
        print(f"pushed on try {tries.group(1) if tries else 1}, restored beside the original")
        return
    assert_one_line_error(res, f"the checkpoint of {name} would not restore",
                          "3 tries", "still running", "no reference was pushed",
                          hint="push it with --stop")
    assert re.search(r"/tmp/(h\d+|c\.new) \(gone\)", res.stderr), res.stderr  # both renamed
    assert tag not in registry.tags(repo)
    before = read_counter(name)
    assert wait_counter(name, before) > before  # running on
    gs_json("push", name, ref, "--stop", *registry.flags())
    podman("rm", "-f", "-t", "0", name)
    gs_json("restore", ref, *registry.flags())
    assert_continued(name, before, token)
    print("refused after 3 tries; the hint's push restored")


def test_a_pre_copy_round_of_a_renaming_container_is_pushed_unchecked(name, registry):
    """A pre-copy round (migrate -P) only warms the target's cache and is never
    restored, so its open files are not checked: a container renaming what it
    holds open is pushed on the first try, not refused."""
    podman("run", "-d", "--name", name, "--network", "none", DEMO_IMAGE, "sh", "-c",
           RENAMING_HOLDER)
    wait_counter(name, 3)
    cid = podman("inspect", name, "--format", "{{.Id}}").stdout.strip()
    mark = journal_mark()
    gs_json("migrate", "-P", name, unique_ref(registry, "pre"), *registry.flags())
    checked = [e for e in journal_since(mark)
               if e["event"] == "checkpoint-stale" and e.get("container") == cid]
    assert not checked, checked
    before = read_counter(name)
    assert wait_counter(name, before) > before  # running on


def export(container: str, path: Path) -> Path:
    gpusnap_json("checkpoint", container, "--export", str(path), "--leave-running")
    return path


def fetch_manifest(registry: Registry, ref: str) -> dict:
    res = run(["oras", "manifest", "fetch", *registry.oras_flags(), ref], check=True)
    return json.loads(res.stdout)


def test_push_running_container_then_restore_from_the_registry_continues(registry, counter):
    ref = unique_ref(registry)
    before, token = read_counter(counter), born(counter)
    earlier = set(_staged())  # other runs' leftovers are not this test's
    pushed = gs_json("push", counter, ref, "--stop", *registry.flags())
    assert pushed["source_kind"] == "container" and pushed["container"] == counter
    assert pushed["digest"].startswith("sha256:") and pushed["bytes_sent"] > 0
    assert podman("container", "inspect", counter, "--format",
                  "{{.State.Status}}").stdout.strip() == "exited"
    podman("rm", counter)

    restored = gs_json("restore", ref, *registry.flags())
    assert restored["container"]["name"] == counter
    assert restored["container"]["status"] == "running"
    assert restored["source"] == ref
    assert restored["pull"]["bytes"] == pushed["bytes"]
    assert restored["pull"]["streamed"]  # Podman imported while the chunks arrived
    assert_continued(counter, before, token)
    value = read_counter(counter)
    assert wait_counter(counter, value) > value
    assert not set(_staged()) - earlier, _staged()


def test_migrate_takes_the_container_where_a_folder_of_its_name_lies_here(registry, counter,
                                                                          tmp_path):
    """`gpusnap push NAME` reads a file or folder NAME before a container of that
    name; migrate moves containers only: standing beside such a folder, it
    checkpoints the container (it pushed the folder before)."""
    (tmp_path / counter).mkdir()
    (tmp_path / counter / "notes.txt").write_text("not a checkpoint\n")
    res = gs("migrate", "-R", counter, unique_ref(registry), *registry.flags(), "--json",
             cwd=tmp_path)
    assert res.returncode == 0, (res.stdout, res.stderr)
    pushed = json.loads(res.stdout)
    assert pushed["source_kind"] == "container" and pushed["container"] == counter, pushed
    assert podman("container", "inspect", counter, "--format",
                  "{{.State.Status}}").stdout.strip() == "running"


def _staged() -> list[Path]:
    """Archives `gpusnap restore REF` staged and did not remove."""
    return [p for d in ("/var/tmp", "/var/lib/containers") for p in Path(d).glob(".gpusnap-pull-*")]


def test_pulled_archive_is_byte_identical_and_podman_imports_it(registry, counter, tmp_path):
    before, token = read_counter(counter), born(counter)
    original = export(counter, tmp_path / "orig.tar.zst")
    ref = unique_ref(registry)
    gs_json("push", str(original), ref, *registry.flags())
    pulled = tmp_path / "pulled.tar.zst"
    result = gs_json("pull", ref, "-o", str(pulled), *registry.flags())
    assert result["output"] == str(pulled) and pulled.is_file()

    for name, archive in (("a", original), ("b", pulled)):
        (tmp_path / name).mkdir()
        run(["tar", "-I", "zstd", "-xf", str(archive), "-C", str(tmp_path / name)], check=True)
    diff = run(["diff", "-r", str(tmp_path / "a"), str(tmp_path / "b")])
    assert diff.returncode == 0, diff.stdout

    podman("rm", "-f", "-t", "0", counter)
    podman("container", "restore", "--import", str(pulled))  # plain Podman takes it
    assert_continued(counter, before, token)


def test_push_checkpoint_directory_and_inspect_reads_only_manifest_and_config(registry, counter,
                                                                               tmp_path):
    archive = export(counter, tmp_path / "c.tar.zst")
    directory = tmp_path / "dir"
    directory.mkdir()
    run(["tar", "-I", "zstd", "-xf", str(archive), "-C", str(directory)], check=True)
    ref = unique_ref(registry)
    pushed = gs_json("push", str(directory), ref, *registry.flags())
    assert pushed["source_kind"] == "directory"

    info = gs_json("inspect", ref, *registry.flags())
    assert info["container"]["name"] == counter
    assert info["container"]["image"] == DEMO_IMAGE
    assert info["criu"]["processes"] >= 1
    reg = info["registry"]
    assert reg["digest"] == pushed["digest"]
    assert reg["artifact_type"] == "application/vnd.gpusnap.checkpoint.v1"
    notes = reg["annotations"]
    assert notes["io.gpusnap.container.name"] == counter
    assert notes["io.gpusnap.gpu.count"] == "0"
    assert notes["io.gpusnap.arch"] == os.uname().machine
    human = gs("inspect", ref, *registry.flags())
    assert human.returncode == 0 and counter in human.stdout and "registry: sha256:" in human.stdout


def test_oras_reads_the_artifact(registry, counter, tmp_path):
    ref = unique_ref(registry)
    gs_json("push", str(export(counter, tmp_path / "c.tar.zst")), ref, *registry.flags())
    manifest = fetch_manifest(registry, ref)
    assert manifest["artifactType"] == "application/vnd.gpusnap.checkpoint.v1"
    assert manifest["config"]["mediaType"] == "application/vnd.gpusnap.checkpoint.config.v1+json"
    assert all(layer["mediaType"] == "application/vnd.gpusnap.checkpoint.chunk.v1+zstd"
               for layer in manifest["layers"])

    out = tmp_path / "oras-out"
    run(["oras", "pull", *registry.oras_flags(), "--config", "config.json", "-o", str(out), ref],
        check=True)
    config = json.loads((out / "config.json").read_text())
    pulled = sorted(p for p in out.iterdir() if p.name != "config.json")
    assert len(pulled) == len(manifest["layers"])
    chunks = {c[2]: c for f in config["files"] for c in f.get("chunks", [])}
    one = pulled[0]  # each layer is a zstd frame of raw checkpoint bytes named by its chunk digest
    raw = subprocess.run(["zstd", "-dc", str(one)], capture_output=True, check=True).stdout
    blob = "sha256:" + hashlib.sha256(one.read_bytes()).hexdigest()
    assert "sha256:" + hashlib.sha256(raw).hexdigest() == chunks[blob][0]


def test_re_push_after_a_small_change_sends_few_bytes(registry, name, capsys):
    """64 MiB of random data in the container's /dev/shm (tmpfs, dumped with the
    checkpoint); 1% of it (640 KiB) rewritten between two pushes."""
    fill = "dd if=/dev/urandom of=/dev/shm/blob bs=1M count=64 2>/dev/null; "
    podman("run", "-d", "--name", name, "--network", "none", "--shm-size", "96m", DEMO_IMAGE,
           "sh", "-c", fill + COUNTER)
    wait_counter(name, 3, timeout=30)
    ref = unique_ref(registry)
    first = gs_json("push", name, ref, "--leave-running", *registry.flags())
    assert first["bytes"] > 64 << 20
    # /dev/shm's tar was chunked as Podman wrote it, not read again from the export
    assert first["prefetched_bytes"] > 64 << 20
    podman("exec", name, "dd", "if=/dev/urandom", "of=/dev/shm/blob", "bs=64k", "count=10",
           "seek=300", "conv=notrunc")
    second = gs_json("push", name, ref.replace(":v1", ":v2"), "--leave-running", *registry.flags())
    # against the checkpoint's size: a first push whose snapshot was taken again
    # (the counter's file changed under the export) sent its chunks in the try
    # before, and its last try only what changed since (CI127: 29124 bytes)
    ratio = second["bytes_sent"] / first["bytes"]
    with capsys.disabled():
        print(f"\n  re-push after 1% change: {second['bytes_sent']} of {first['bytes']} bytes "
              f"({100 * ratio:.2f}%), {second['chunks_sent']} of {second['chunks']} chunks"
              + (f"; the first push taken {first['retaken']['tries']} times"
                 if first.get("retaken") else ""))
    assert ratio <= 0.05
    # The re-push stands on its own: restored from it, the container has the changed data.
    expected = hashlib.sha256(_shm_blob(name)).hexdigest()
    podman("rm", "-f", "-t", "0", name)
    gs_json("restore", ref.replace(":v1", ":v2"), *registry.flags())
    assert hashlib.sha256(_shm_blob(name)).hexdigest() == expected


def _shm_blob(name: str) -> bytes:
    return subprocess.run(["podman", "exec", name, "cat", "/dev/shm/blob"], capture_output=True,
                          check=True).stdout


def test_repeated_pull_is_served_by_the_chunk_cache(registry, counter, tmp_path, cache_dir):
    ref = unique_ref(registry)
    gs_json("push", str(export(counter, tmp_path / "c.tar.zst")), ref, *registry.flags())
    first = gs_json("pull", ref, "-o", str(tmp_path / "1.tar.zst"), *registry.flags())
    assert first["bytes_fetched"] > 0 and first["bytes_from_cache"] == 0
    assert oct(cache_dir.stat().st_mode & 0o777) == "0o700"
    second = gs_json("pull", ref, "-o", str(tmp_path / "2.tar"), *registry.flags())
    assert second["bytes_fetched"] == 0 and second["bytes_from_cache"] == first["bytes_fetched"]
    no_cache = gs_json("pull", ref, "-o", str(tmp_path / "3.tar"), "--no-cache", *registry.flags())
    assert no_cache["bytes_fetched"] == first["bytes_fetched"]


def test_credentials_from_podman_auth_json(registry, counter, tmp_path):
    ref = unique_ref(registry)
    gs_json("push", str(export(counter, tmp_path / "c.tar.zst")), ref, *registry.flags())
    auth = tmp_path / "auth.json"
    token = base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
    auth.write_text(json.dumps({"auths": {registry.host: {"auth": token}}}))
    res = run([GPUSNAP, "inspect", ref, "--ca-file", str(registry.ca), "--json"],
              env={**os.environ, "REGISTRY_AUTH_FILE": str(auth)})
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["registry"]["digest"].startswith("sha256:")


def test_wrong_or_missing_credentials_are_one_line(registry, counter, tmp_path):
    archive = export(counter, tmp_path / "c.tar.zst")
    ref = unique_ref(registry)
    res = gs("push", str(archive), ref, *registry.flags(), password="wrong")
    assert_one_line_error(res, "refused the credentials", USER,
                          hint=f"log in again with `podman login {registry.host}`")
    # --detach says it in the foreground, before a background upload exists
    uploads_before = gs_json("status")["uploads"]
    for verb in ("push", "migrate"):
        res = gs(verb, "-d", counter, ref, *registry.flags(), password="wrong")
        assert_one_line_error(res, "refused the credentials", USER,
                              hint=f"log in again with `podman login {registry.host}`")
    assert gs_json("status")["uploads"] == uploads_before
    assert podman("container", "inspect", counter, "--format",
                  "{{.State.Status}}").stdout.strip() == "running"
    empty = tmp_path / "empty-auth.json"
    empty.write_text("{}")
    res = run([GPUSNAP, "pull", ref, "--ca-file", str(registry.ca), "--authfile", str(empty)])
    assert_one_line_error(res, "requires a login",
                          hint=f"pass --username and --password-stdin, or `podman login "
                               f"{registry.host}`")


def test_tls_flags(registry, counter, tmp_path):
    ref = unique_ref(registry)
    gs_json("push", str(export(counter, tmp_path / "c.tar.zst")), ref, *registry.flags())
    res = run([GPUSNAP, "inspect", ref])  # self-signed, and no --ca-file
    assert_one_line_error(res, "TLS", hint="pass --ca-file FILE (the registry's CA) or "
                                           "--tls-verify=false")
    assert gs_json("inspect", ref, "--ca-file", str(registry.ca), "--username", USER,
                   "--password-stdin")  # as the hint says
    assert gs_json("inspect", ref, "--tls-verify=false", "--username", USER, "--password-stdin")
    assert gs_json("inspect", ref, "--insecure", "--username", USER, "--password-stdin")
    res = gs("inspect", ref, "--plain-http", "--username", USER, "--password-stdin")
    assert_one_line_error(res, "serves HTTPS", hint="drop --plain-http")


def test_unknown_artifact_type_is_refused(registry, tmp_path):
    ref = unique_ref(registry)
    (tmp_path / "hello.txt").write_text("not a checkpoint\n")
    run(["oras", "push", *registry.oras_flags(), "--artifact-type", "application/x-other",
         ref, "hello.txt"], check=True, cwd=tmp_path)
    res = gs("pull", ref, "-o", str(tmp_path / "x.tar.zst"), *registry.flags())
    assert_one_line_error(res, "is not a gpusnap checkpoint", "application/x-other",
                          hint="`oras manifest fetch REF` shows what this one holds")
    assert not (tmp_path / "x.tar.zst").exists()
    assert fetch_manifest(registry, ref)["artifactType"] == "application/x-other"  # the hint's way
    res = gs("inspect", ref, *registry.flags())  # not another way: refused alike
    assert_one_line_error(res, "is not a gpusnap checkpoint")


def test_missing_tag_is_one_line(registry, counter, tmp_path):
    ref = unique_ref(registry)
    gs_json("push", str(export(counter, tmp_path / "c.tar.zst")), ref, *registry.flags())
    res = gs("restore", ref.replace(":v1", ":no-such-tag"), *registry.flags())
    repo = ref.rsplit(":", 1)[0]
    assert_one_line_error(res, "no such tag", hint=f"--username gpusnap --password-stdin {repo}`")
    [hint] = re.findall(r"`(oras repo tags [^`]+)`", res.stderr)
    # the hint's command, as printed (the password on stdin, as gpusnap read it), lists what there is
    tags = run(["bash", "-c", hint], input=PASSWORD + "\n", check=True).stdout.split()
    assert "v1" in tags and "no-such-tag" not in tags  # beside it, its signature's tag


def test_corrupted_blob_is_a_digest_error_and_nothing_is_restored(registry, counter, tmp_path):
    ref = unique_ref(registry)
    gs_json("push", str(export(counter, tmp_path / "c.tar.zst")), ref, *registry.flags())
    layer = max(fetch_manifest(registry, ref)["layers"], key=lambda l: l["size"])
    blob = registry.blob_file(layer["digest"])
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF
    blob.write_bytes(bytes(data))
    try:
        podman("rm", "-f", "-t", "0", counter)
        earlier = set(_staged())
        res = gs("restore", ref, *registry.flags())
        assert_one_line_error(res, "does not match its digest",
                              hint=f"the registry's copy of blob {layer['digest'][:19]} is damaged")
        assert podman("container", "exists", counter, check=False).returncode == 1
        assert not set(_staged()) - earlier, _staged()
        res = gs("pull", ref, "-o", str(tmp_path / "bad.tar.zst"), *registry.flags())
        assert_one_line_error(res, "does not match its digest")
        assert not list(tmp_path.glob("*bad.tar.zst*"))  # no archive, not even a partial one
    finally:
        data[len(data) // 2] ^= 0xFF
        blob.write_bytes(bytes(data))


def test_stopped_registry_is_one_line(counter, tmp_path):
    other = make_registry(tmp_path / "short-lived")
    try:
        ref = other.ref("ckpt/gone:v1")
        archive = export(counter, tmp_path / "c.tar.zst")
        gs_json("push", str(archive), ref, *other.flags())
    finally:
        other.stop()
    res = gs("pull", ref, "-o", str(tmp_path / "x.tar.zst"), *other.flags())
    assert_one_line_error(res, f"cannot reach registry {other.host}", "connection refused",
                          hint="check that the registry is up and the address is right")
    res = gs("push", str(archive), ref, *other.flags())
    assert_one_line_error(res, "cannot reach registry", hint="then push again: chunks the "
                          "registry already has are not sent again")


def test_failed_push_of_a_container_keeps_its_checkpoint(counter, tmp_path):
    """The export is all that is left of a checkpointed container: a push that
    fails after the checkpoint keeps it, and says where."""
    readonly = make_registry(tmp_path / "readonly", readonly=True)
    try:
        before, token = read_counter(counter), born(counter)
        res = gs("push", counter, readonly.ref("ckpt/ro:v1"), "--stop", *readonly.flags())
        assert_one_line_error(res, "is checkpointed and stopped", "kept in",
                              hint="brings it back here")  # followed below
        kept = Path(re.search(r"kept in (\S+)", res.stderr).group(1))
        try:
            podman("rm", counter)
            gpusnap_json("restore", str(kept))
            assert_continued(counter, before, token)
        finally:
            shutil.rmtree(kept.parent, ignore_errors=True)
    finally:
        readonly.stop()


def test_reference_without_a_registry_is_not_taken_for_one(registry):
    res = run([GPUSNAP, "restore", "no-such-container-or-file"])
    assert_one_line_error(res, "neither a checkpoint archive nor a container",
                          hint="(`podman ps -a`)")
    res = run([GPUSNAP, "pull", "ckpt/app:v1"])
    assert_one_line_error(res, "names no registry",
                          hint="e.g. registry.example.com:5000/ckpt/app:v1")


def test_subject_is_the_container_image_when_it_lives_in_the_same_repository(registry, name):
    repo = registry.ref(f"app-{uuid.uuid4().hex[:6]}")
    creds = ["--tls-verify=false", "--creds", f"{USER}:{PASSWORD}"]
    podman("push", "-q", *creds, DEMO_IMAGE, f"{repo}:latest")
    try:
        podman("pull", "-q", *creds, f"{repo}:latest")  # the image now knows its digest there
        podman("run", "-d", "--name", name, "--network", "none", f"{repo}:latest", "sh", "-c", COUNTER)
        wait_counter(name, 1)
        gs_json("push", name, f"{repo}:ckpt", "--leave-running", *registry.flags())
        image = fetch_manifest(registry, f"{repo}:latest")
        subject = fetch_manifest(registry, f"{repo}:ckpt")["subject"]
        assert subject["digest"] in [d.split("@")[1] for d in json.loads(podman(
            "image", "inspect", f"{repo}:latest", "--format", "{{json .RepoDigests}}").stdout)]
        assert subject["mediaType"] == image.get("mediaType", subject["mediaType"])
    finally:
        run(["podman", "rm", "-f", "-t", "0", name])
        run(["podman", "untag", DEMO_IMAGE, f"{repo}:latest"])
