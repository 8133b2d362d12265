"""`gpusnap push --format podman`: a checkpoint image that Podman itself pulls and
restores, shaped as `podman container checkpoint --create-image` makes it."""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path

from tests.conftest import DEMO_IMAGE, assert_continued, assert_one_line_error, born, podman, \
    read_counter, run, wait_counter
from tests.integration.oci_registry import PASSWORD, USER, Registry
from tests.integration.test_registry import fetch_manifest, gs, gs_json

PREFIX = "io.podman.annotations.checkpoint."


def podman_pull(registry: Registry, ref: str, tmp_path: Path) -> None:
    """As a target host would: Podman's own TLS check against the registry's CA."""
    certs = tmp_path / "certs"
    certs.mkdir(exist_ok=True)
    shutil.copy(registry.ca, certs / "ca.crt")
    podman("pull", "-q", "--cert-dir", str(certs), "--creds", f"{USER}:{PASSWORD}", ref)


def annotations(image: str) -> dict[str, str]:
    return json.loads(podman("image", "inspect", image, "--format",
                             "{{json .Annotations}}").stdout)


def test_podman_restores_a_format_podman_push(registry, counter, tmp_path, cache_dir):
    ref = registry.ref(f"ckpt/podman-{uuid.uuid4().hex[:8]}:v1")
    before, token = read_counter(counter), born(counter)
    runtime = podman("inspect", "-f", "{{.OCIRuntime}}", counter).stdout.strip()
    pushed = gs_json("push", counter, ref, "--format", "podman", "--stop", *registry.flags())
    assert pushed["format"] == "podman" and pushed["source_kind"] == "container"
    manifest = fetch_manifest(registry, ref)
    assert [layer["mediaType"] for layer in manifest["layers"]] == \
        ["application/vnd.oci.image.layer.v1.tar+zstd"]
    assert manifest["annotations"][PREFIX + "name"] == counter
    assert manifest["annotations"][PREFIX + "runtime.name"] == runtime  # runc, crun (matrix)
    podman("rm", counter)  # checkpointed and stopped by the push: gone from this host

    podman_pull(registry, ref, tmp_path)
    try:
        podman("container", "restore", ref)  # unchanged Podman, no gpusnap involved
        assert podman("container", "inspect", counter, "--format",
                      "{{.State.Status}}").stdout.strip() == "running"
        assert_continued(counter, before, token)
        value = read_counter(counter)
        assert wait_counter(counter, value) > value
    finally:
        run(["podman", "rm", "-f", "-t", "0", counter])
        run(["podman", "rmi", "-f", ref])


def test_same_shape_as_podman_create_image(registry, counter, tmp_path, cache_dir):
    """Annotation keys, runtime and one layer, as Podman's own checkpoint image has them."""
    own = f"localhost/gpusnap-ckimg-{uuid.uuid4().hex[:8]}:latest"
    ref = registry.ref(f"ckpt/podman-{uuid.uuid4().hex[:8]}:v1")
    try:
        podman("container", "checkpoint", "--leave-running", "--create-image", own, counter)
        gs_json("push", counter, ref, "--format", "podman", "--leave-running", *registry.flags())
        podman_pull(registry, ref, tmp_path)
        theirs, ours = annotations(own), annotations(ref)
        podman_keys = {k for k in theirs if k.startswith(PREFIX)}
        assert podman_keys and podman_keys == {k for k in ours if k.startswith(PREFIX)}
        for key in ("name", "runtime.name", "rootfsImageName", "rootfsImageID", "host.arch",
                    "podman.version", "criu.version"):
            assert ours[PREFIX + key] == theirs[PREFIX + key], key
        layers = "{{len .RootFS.Layers}}"
        assert podman("image", "inspect", own, "--format", layers).stdout.strip() == "1"
        assert podman("image", "inspect", ref, "--format", layers).stdout.strip() == "1"
    finally:
        run(["podman", "rmi", "-f", own, ref])


def test_gpusnap_describes_a_podman_image_and_sends_restore_to_podman(registry, counter,
                                                                     tmp_path, cache_dir):
    ref = registry.ref(f"ckpt/podman-{uuid.uuid4().hex[:8]}:v1")
    gs_json("push", counter, ref, "--format", "podman", "--leave-running", *registry.flags())
    info = gs_json("inspect", ref, *registry.flags())
    assert info["format"] == "podman" and info["container"]["name"] == counter
    runtime = podman("inspect", "-f", "{{.OCIRuntime}}", counter).stdout.strip()
    assert info["container"]["image"] == DEMO_IMAGE and info["runtime"] == runtime
    human = gs("inspect", ref, *registry.flags())
    assert human.returncode == 0 and "Podman checkpoint image" in human.stdout
    for args in (("restore", ref), ("pull", ref, "-o", str(tmp_path / "x.tar.zst"))):
        res = gs(*args, *registry.flags())
        assert_one_line_error(res, "is a Podman checkpoint image", "podman container restore")
    assert not list(tmp_path.glob("*x.tar.zst*"))
