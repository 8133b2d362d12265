"""A containerd checkpoint image (`ctr c checkpoint --task --rw`) exported as a directory and restored in another namespace.

The directory is what gpusnap's registry format carries (gpusnap.ops.containerd_checkpoint);
the restore makes the container again from its image, spec and read-write
layer in a second namespace of the same private containerd and restores its
task under the shim: the counter goes on and a file written before the
checkpoint is there.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from gpusnap.ops.containerd_api import Client, ContainerdError
from gpusnap.ops.containerd_checkpoint import FORMAT, export_image, import_dir
from tests.conftest import DEMO_IMAGE, run
from tests.integration.shim_containerd import (
    RUNTIME, STAMPED_COUNTER, ctr_checkpoint, private_containerd, read_tmp_c, remove, tasks,
    wait_counter)


@pytest.fixture(scope="module")
def containerd():
    with private_containerd() as c:
        yield c


def _ctr_ns(c, namespace: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    res = subprocess.run(["ctr", "--address", c.address, "--namespace", namespace, *args],
                         capture_output=True, text=True, env=c.env, timeout=60)
    if check and res.returncode != 0:
        raise AssertionError(f"ctr -n {namespace} {' '.join(args)}: {res.stderr}")
    return res


def _counts_on(c, ns: str, name: str, pid: int, before: int) -> None:
    assert f"{name} {pid} RUNNING" in " ".join(_ctr_ns(c, ns, "tasks", "ls").stdout.split())
    first = read_tmp_c(pid)
    assert before <= first < before + 50000, (before, first)  # restored, not started afresh
    deadline = time.monotonic() + 10
    while read_tmp_c(pid) <= first:  # and counting
        assert time.monotonic() < deadline, f"{name} stopped counting at {first}"
        time.sleep(0.05)
    assert Path(f"/proc/{pid}/root/marker").read_text() == "kept\n"  # the rw layer came along


def _cleanup_ns(c, namespace: str, name: str) -> None:
    _ctr_ns(c, namespace, "tasks", "kill", "-s", "KILL", name, check=False)
    deadline = time.monotonic() + 10
    while "RUNNING" in _ctr_ns(c, namespace, "tasks", "ls", check=False).stdout and time.monotonic() < deadline:
        time.sleep(0.1)
    _ctr_ns(c, namespace, "tasks", "delete", name, check=False)
    _ctr_ns(c, namespace, "containers", "delete", name, check=False)
    for image in _ctr_ns(c, namespace, "images", "ls", "-q", check=False).stdout.split():
        _ctr_ns(c, namespace, "images", "rm", image, check=False)
    _ctr_ns(c, namespace, "namespaces", "rm", namespace, check=False)
    with contextlib.suppress(OSError):
        os.rmdir(f"/run/containerd/runc/{namespace}")  # the shim's runc root, empty once the task is gone


def test_checkpoint_image_exported_and_restored_in_another_namespace(containerd, tmp_path: Path):
    c = containerd
    c.ctr("run", "-d", "--runtime", RUNTIME, DEMO_IMAGE, "mg1", "sh", "-c", STAMPED_COUNTER)
    wait_counter(c, "mg1", 0)
    c.ctr("tasks", "exec", "--exec-id", "mark", "mg1", "sh", "-c", "echo kept > /marker")
    before = read_tmp_c(tasks(c)["mg1"][0])
    ctr_checkpoint(c, "mg1", "localhost/mg1:ckpt")
    with Client(c.address, c.namespace) as api:
        meta = export_image(api, "localhost/mg1:ckpt", tmp_path / "exp")
        with pytest.raises(ContainerdError, match=f"{DEMO_IMAGE} is not a containerd checkpoint image"):
            export_image(api, DEMO_IMAGE, tmp_path / "not")
    assert meta == {"format": FORMAT, "image": DEMO_IMAGE, "runtime": RUNTIME, "snapshotter": "overlayfs",
                    "rw_media_type": meta["rw_media_type"], "source": "localhost/mg1:ckpt"}
    assert meta["rw_media_type"].startswith("application/vnd.oci.image.layer.v1.tar")
    assert (tmp_path / "exp" / "checkpoint" / "inventory.img").is_file()
    assert json.loads((tmp_path / "exp" / "spec.json").read_text())["process"]["args"][-1] == STAMPED_COUNTER
    remove(c, "mg1")
    time.sleep(1.0)  # a fresh start would now stamp a later second

    other = f"gpusnap-test-b-{uuid.uuid4().hex[:6]}"
    tar = tmp_path / "image.tar"
    try:
        with Client(c.address, other) as api:
            with pytest.raises(ContainerdError, match=f"image {DEMO_IMAGE} is not in namespace {other}"):
                import_dir(api, tmp_path / "exp", "mg1")
            run(["podman", "save", "--format", "docker-archive", "-o", str(tar), DEMO_IMAGE], check=True)
            _ctr_ns(c, other, "images", "import", str(tar))
            pid = import_dir(api, tmp_path / "exp", "mg1", stdout=f"file://{tmp_path}/out.log")
        _counts_on(c, other, "mg1", pid, before)
        info = json.loads(_ctr_ns(c, other, "containers", "info", "mg1").stdout)
        assert info["Runtime"]["Name"] == RUNTIME and info["Spec"]["linux"]["cgroupsPath"] == f"/{other}/mg1"
    finally:
        _cleanup_ns(c, other, "mg1")
        tar.unlink(missing_ok=True)
