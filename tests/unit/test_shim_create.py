"""shim/service.py Create: a checkpoint containerd 1.7 unpacked for a restore
(a ctrd-checkpoint* directory, GBs for a GPU task) is removed when Create
fails: the container is never registered, so no Delete would remove it."""

from __future__ import annotations

import errno
from types import SimpleNamespace

import grpc
import pytest
from google.protobuf import any_pb2

from gpusnap.shim import mounts
from gpusnap.shim.service import TaskService


class Context:
    def abort(self, code, details):
        raise grpc.RpcError(f"{code}: {details}")


def _fail_mount(*args) -> None:
    raise mounts.MountError(errno.EINVAL, "mount overlay: invalid argument")


@pytest.mark.parametrize("name, removed", [("ctrd-checkpoint123", True), ("kept-images", False)])
def test_a_failed_create_removes_the_checkpoint_containerd_unpacked(tmp_path, monkeypatch, name, removed):
    monkeypatch.setenv("GPUSNAP_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setattr(mounts, "mount", _fail_mount)
    monkeypatch.setattr(mounts, "unmount_all", lambda target: None)
    checkpoint = tmp_path / name
    checkpoint.mkdir()
    (checkpoint / "pages-1.img").write_bytes(b"GBs")
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    svc = TaskService("ns", SimpleNamespace(publish=lambda e: None), None, lambda: None)
    req = SimpleNamespace(id="c1", bundle=str(bundle), options=any_pb2.Any(), stdin="", stdout="", stderr="",
                          terminal=False, checkpoint=str(checkpoint), parent_checkpoint="",
                          rootfs=[SimpleNamespace(type="overlay", source="overlay", target="", options=[])])
    with pytest.raises(grpc.RpcError, match="invalid argument"):
        svc.Create(req, Context())
    assert "c1" not in svc.containers
    assert checkpoint.exists() is not removed  # a checkpoint of the client's own stays
