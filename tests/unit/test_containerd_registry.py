"""The containerd registry path without a containerd: containerd:// names, engine refusals,
the containerd checkpoint layout as a registry bundle describes it, and the directory writer
that stages a pulled checkpoint."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from gpusnap import archive
from gpusnap.errors import GpusnapError
from gpusnap.oci import bundle as fmt
from gpusnap.oci.bundle import FileEntry
from gpusnap.oci.dirfiles import DirectoryWriter
from gpusnap.ops.containerd_registry import (
    Location, _container_of, parse_uri, target_location)
from gpusnap.ops.engines import refuse_engine

RUNTIME = "io.containerd.gpusnap.v1"


@pytest.fixture(autouse=True)
def no_namespace_env(monkeypatch):
    monkeypatch.delenv("CONTAINERD_NAMESPACE", raising=False)


def test_uri_first_segment_is_the_namespace(monkeypatch):
    assert parse_uri("containerd://a/ctr") == Location("a", "ctr")
    assert parse_uri("containerd://a/localhost/app:ckpt") == Location("a", "localhost/app:ckpt")
    assert parse_uri("containerd://ctr") == Location("default", "ctr")  # as ctr, without -n
    monkeypatch.setenv("CONTAINERD_NAMESPACE", "k8s.io")
    assert parse_uri("containerd://ctr") == Location("k8s.io", "ctr")
    with pytest.raises(GpusnapError, match="'-a' is not a containerd namespace"):
        parse_uri("containerd://-a/ctr")


def test_restore_target_names_namespace_and_id():
    assert target_location("containerd://b/x", None) == Location("b", "x")
    assert target_location("containerd://b", None) == Location("b", "")  # the checkpoint's name
    assert target_location("containerd://b/", None) == Location("b", "")
    assert target_location("containerd://b/", "y") == Location("b", "y")
    assert target_location("containerd://", None) == Location("default", "")
    with pytest.raises(GpusnapError, match="--to names container x, --name y"):
        target_location("containerd://b/x", "y")
    with pytest.raises(GpusnapError, match="not a containerd target"):
        target_location("podman://x", None)
    with pytest.raises(GpusnapError, match="not containerd://NAMESPACE"):
        target_location("containerd://b/x/y", None)


def test_engines_are_not_crossed():
    podman_summary = {"container": {"name": "p"}, "runtime": "runc"}
    containerd_summary = {"engine": "containerd", "container": {"name": "c1"},
                          "containerd": {"runtime": RUNTIME, "namespace": "a"}}
    refuse_engine(podman_summary, "r/p:1", "podman")
    refuse_engine(containerd_summary, "r/c:1", "containerd")
    with pytest.raises(GpusnapError, match="r/p:1 is a Podman checkpoint; containerd cannot") as e:
        refuse_engine(podman_summary, "r/p:1", "containerd", "containerd://b/x")
    assert "nothing was downloaded" in e.value.hint
    with pytest.raises(GpusnapError, match=f"r/c:1 is a containerd checkpoint \\(runtime {RUNTIME}\\)") as e:
        refuse_engine(containerd_summary, "r/c:1", "podman")
    assert "--to containerd://a/c1" in e.value.hint


def test_container_id_from_the_cgroup_path():
    assert _container_of({"linux": {"cgroupsPath": "/ns/ctr1"}}) == "ctr1"
    assert _container_of({"linux": {"cgroupsPath": "system.slice:cri-containerd:abc"}}) == "abc"
    assert _container_of({}) == ""


def _layout(root: Path) -> Path:
    (root / "checkpoint").mkdir(parents=True)
    (root / "checkpoint" / "inventory.img").write_bytes(b"\0" * 10)
    (root / "checkpoint" / "mm-1.img").write_bytes(b"\0" * 20)
    (root / "checkpoint" / "pages-1.img").write_bytes(b"\0" * 4096)
    (root / "rw.layer").write_bytes(b"\0" * 1024)
    (root / "spec.json").write_text(json.dumps({"linux": {"cgroupsPath": "/a/ctr1", "devices": [
        {"path": "/dev/fuse", "type": "c", "major": 10, "minor": 229}]}}))
    (root / "containerd.json").write_text(json.dumps({
        "format": "gpusnap.containerd-checkpoint.v1", "image": "localhost/app:1", "runtime": RUNTIME,
        "snapshotter": "overlayfs", "rw_media_type": "application/vnd.oci.image.layer.v1.tar+gzip",
        "source": "localhost/gpusnap-checkpoint/ctr1:x", "namespace": "a", "container": "ctr1"}))
    return root


def test_containerd_layout_is_summarised_as_containerd(tmp_path):
    contents = archive.read_directory(_layout(tmp_path / "ck"))
    assert contents.is_containerd_checkpoint and not contents.is_podman_checkpoint
    s = contents.summary()
    assert s["engine"] == "containerd" and s["runtime"] == RUNTIME
    assert s["containerd"] == {"image": "localhost/app:1", "runtime": RUNTIME, "snapshotter": "overlayfs",
                               "namespace": "a", "source": "localhost/gpusnap-checkpoint/ctr1:x"}
    assert s["container"]["name"] == "ctr1" and s["container"]["image"] == "localhost/app:1"
    assert s["devices"] == ["/dev/fuse"] and s["rootfs_diff_bytes"] == 1024
    assert s["criu"]["processes"] == 1 and s["criu"]["memory_pages_bytes"] == 4096
    b = fmt.Bundle(files=[], summary=s, gpu_manifest=None, chunking={}, compression={})
    notes = fmt.annotations(b, None, "x86_64")
    assert notes["io.gpusnap.engine"] == "containerd" and notes["io.gpusnap.runtime"] == RUNTIME
    assert notes["io.gpusnap.containerd.snapshotter"] == "overlayfs"


def test_podman_summary_has_no_engine_annotation(tmp_path):
    root = tmp_path / "p"
    (root / "checkpoint").mkdir(parents=True)
    (root / "checkpoint" / "inventory.img").write_bytes(b"\0")
    (root / "config.dump").write_text(json.dumps({"name": "p", "runtime": "runc"}))
    (root / "spec.dump").write_text("{}")
    s = archive.read_directory(root).summary()
    assert "engine" not in s
    b = fmt.Bundle(files=[], summary=s, gpu_manifest=None, chunking={}, compression={})
    assert "io.gpusnap.engine" not in fmt.annotations(b, None, "x86_64")


def test_directory_writer_keeps_modes_and_times(tmp_path):
    w = DirectoryWriter(tmp_path / "out")
    w.add(FileEntry("checkpoint", "dir", mode=0o711, mtime=1000), [])
    w.add(FileEntry("checkpoint/a.img", "file", mode=0o600, size=5, mtime=2000), [b"he", b"llo"])
    w.add(FileEntry("checkpoint/l", "symlink", linkname="a.img"), [])
    w.commit()
    a = tmp_path / "out" / "checkpoint" / "a.img"
    assert a.read_bytes() == b"hello" and (a.stat().st_mode & 0o777) == 0o600
    assert a.stat().st_mtime == 2000 and (a.parent.stat().st_mode & 0o777) == 0o711
    assert a.parent.stat().st_mtime == 1000
    assert os.readlink(tmp_path / "out" / "checkpoint" / "l") == "a.img"


def test_directory_writer_refuses_paths_outside(tmp_path):
    w = DirectoryWriter(tmp_path / "out")
    for bad in ("../x", "/etc/x", "a/../../x", ""):
        with pytest.raises(GpusnapError, match="outside the checkpoint"):
            w.add(FileEntry(bad, "file", size=0), [])
    w.add(FileEntry("esc", "symlink", linkname=str(tmp_path)), [])
    with pytest.raises(GpusnapError, match="behind a symlink"):
        w.add(FileEntry("esc/x", "file", size=1), [b"x"])
    assert not (tmp_path / "x").exists()
    with pytest.raises(GpusnapError, match="its chunks hold 1 bytes, the file list says 3"):
        w.add(FileEntry("short", "file", size=3), [b"x"])
