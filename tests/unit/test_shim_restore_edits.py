"""shim/service.py and shim/remap.py: a restore's GPU edits (config.json, the
/dev image, the plan) are undone when writing them fails half-way, an earlier
backup is put back rather than deleted (it may hold the only originals), and
a Delete is refused from the start of the restore, planning included."""

from __future__ import annotations

import errno
import json
import threading
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest

from gpusnap import PLAN_NAME
from gpusnap.gpu.nodes import DeviceRemap
from gpusnap.shim import remap
from gpusnap.shim.process import Container, Proc
from gpusnap.shim.service import TaskService
from gpusnap.shim.stdio import Paths
from tests.unit.test_shim_restore import _IO, Context

ORIGINAL = {"ociVersion": "1.0.2", "linux": {"devices": ["/dev/nvidia0"]}}
EDITED = {"ociVersion": "1.0.2", "linux": {"devices": ["/dev/nvidia1"]}}


class Runc:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def restore(self, cid, *args) -> None:
        self.calls.append("restore")

    def delete(self, cid: str, force: bool = False) -> None:
        self.calls.append("delete")


def _edits(images: Path) -> remap.Edits:
    return remap.Edits(EDITED, images / "dev.tar", b"edited /dev", {"remap": DeviceRemap().to_dict()})


@pytest.fixture
def bundle(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(ORIGINAL))
    images = tmp_path / "images"
    images.mkdir()
    (images / "dev.tar").write_bytes(b"original /dev")
    return tmp_path


def _service(bundle: Path, monkeypatch) -> tuple[TaskService, Runc]:
    monkeypatch.setenv("GPUSNAP_STATE_DIR", str(bundle / "state"))
    svc = TaskService("ns", SimpleNamespace(publish=lambda e: None), None, lambda: None)
    monkeypatch.setattr(svc, "_watch", lambda c, p: None)
    (bundle / "init.pid").write_text("4242")
    p = Proc(id="c1", paths=Paths(), io=_IO())  # type: ignore[arg-type]
    svc.containers["c1"] = Container(id="c1", bundle=str(bundle), init=p, checkpoint=str(bundle / "images"))
    runc = Runc()
    svc.runcs["c1"] = runc  # type: ignore[assignment]
    return svc, runc


def _originals(bundle: Path) -> bool:
    return (json.loads((bundle / "config.json").read_text()) == ORIGINAL
            and (bundle / "images" / "dev.tar").read_bytes() == b"original /dev")


def test_a_failure_writing_the_edits_is_undone(bundle, monkeypatch):
    svc, runc = _service(bundle, monkeypatch)
    monkeypatch.setattr(remap, "plan_edits", lambda b, c: _edits(Path(c)))
    replace = remap._replace

    def full_disk(path: Path, data: bytes) -> None:
        if path.name == PLAN_NAME:  # config.json and the /dev image are written by now
            raise OSError(errno.ENOSPC, "No space left on device")
        replace(path, data)

    monkeypatch.setattr(remap, "_replace", full_disk)
    with pytest.raises(grpc.RpcError, match="No space left"):
        svc.Start(SimpleNamespace(id="c1", exec_id=""), Context())
    assert _originals(bundle) and not (bundle / remap.BACKUP).exists()
    assert "restore" not in runc.calls and not svc.containers["c1"].init.restoring


def test_an_earlier_backup_is_put_back_not_deleted(bundle):
    images = bundle / "images"
    remap.apply(bundle, images, _edits(images))  # a Start whose undo never ran
    remap.apply(bundle, images, _edits(images))  # the retry
    remap.undo(bundle)
    assert _originals(bundle) and not (images / PLAN_NAME).exists()


def test_a_backup_cut_short_is_no_backup(bundle):
    (bundle / remap.BACKUP).mkdir()
    (bundle / remap.BACKUP / "config.json").write_text("{\"ociVer")  # ENOSPC copying it
    remap.undo(bundle)
    assert _originals(bundle) and not (bundle / remap.BACKUP).exists()


def test_a_delete_while_the_restore_plans_is_refused(bundle, monkeypatch):
    svc, runc = _service(bundle, monkeypatch)
    planning, go_on = threading.Event(), threading.Event()

    def slow_plan(b, c):
        planning.set()
        assert go_on.wait(10)

    monkeypatch.setattr(remap, "plan_edits", slow_plan)
    req = SimpleNamespace(id="c1", exec_id="")
    start = threading.Thread(target=lambda: svc.Start(req, Context()))
    start.start()
    try:
        assert planning.wait(10)
        with pytest.raises(grpc.RpcError, match="cannot delete running process c1"):
            svc.Delete(req, Context())
        assert "c1" in svc.containers
    finally:
        go_on.set()
        start.join(10)
    assert svc.containers["c1"].init.status == "running" and runc.calls == ["restore"]
