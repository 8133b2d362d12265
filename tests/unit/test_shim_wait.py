"""shim/service.py Wait and shim/ttrpc.py: a Wait whose caller went away (Ctrl-C
on `ctr task wait`, a client timeout, containerd restarting) gives its worker
back, so abandoned waits cannot use up the server's fixed pool and leave
State, Kill and Delete queued for ever."""

from __future__ import annotations

import socket
import threading
import time
from types import SimpleNamespace

import grpc
import pytest

from gpusnap.proto import load
from gpusnap.shim import ttrpc
from gpusnap.shim.process import Container, Proc
from gpusnap.shim.service import TaskService
from gpusnap.shim.stdio import Paths


class Context:
    def __init__(self, active: bool) -> None:
        self.active = active

    def is_active(self) -> bool:
        return self.active

    def abort(self, code, details):
        raise grpc.RpcError(f"{code}: {details}")


@pytest.fixture
def svc(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUSNAP_STATE_DIR", str(tmp_path / "state"))
    s = TaskService("ns", SimpleNamespace(publish=lambda e: None), None, lambda: None)
    p = Proc(id="c1", paths=Paths(), pid=4242, status="running")
    s.containers["c1"] = Container(id="c1", bundle=str(tmp_path), init=p)
    return s


def test_a_wait_whose_caller_left_gives_up(svc):
    answers: list = []
    t = threading.Thread(target=lambda: answers.append(_try(svc.Wait, Context(active=False))), daemon=True)
    t.start()
    t.join(5)
    svc.containers["c1"].init.set_exited(3, 1)  # a Wait still held lets go now
    assert answers and isinstance(answers[0], grpc.RpcError) and "CANCELLED" in str(answers[0])
    assert svc.Wait(SimpleNamespace(id="c1", exec_id=""), Context(active=True)).exit_status == 3


def _try(fn, context):
    try:
        return fn(SimpleNamespace(id="c1", exec_id=""), context)
    except Exception as exc:  # noqa: BLE001 -- the test looks at it
        return exc


def _send(s: socket.socket, service, stream: int, method: str, req, timeout_nano: int = 0) -> None:
    body = load().ttrpc.Request(service=service.full_name, method=method, payload=req.SerializeToString(),
                                timeout_nano=timeout_nano).SerializeToString()
    s.sendall(ttrpc.HEADER.pack(len(body), stream, ttrpc.REQUEST, 0) + body)


@pytest.mark.parametrize("left", ["closed", "timed out"])
def test_an_abandoned_wait_frees_its_ttrpc_worker(svc, tmp_path, left):
    shim = load().shim
    service = shim.DESCRIPTOR.services_by_name["Task"]
    srv = ttrpc.TtrpcServer(service, svc, max_workers=1)  # one worker: a held one blocks all
    path = str(tmp_path / "s.sock")
    assert srv.listen(path)
    try:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(path)
        _send(s, service, 1, "Wait", shim.WaitRequest(id="c1"), timeout_nano=int(0.2e9) if left == "timed out" else 0)
        time.sleep(0.2)  # the Wait holds the one worker
        if left == "closed":
            s.close()
        t0 = time.monotonic()
        resp = ttrpc.call(path, service.full_name, "State", shim.StateRequest(id="c1"), shim.StateResponse,
                          timeout=5)
        assert resp.pid == 4242 and time.monotonic() - t0 < 3
        s.close()
        # and the Wait itself gave up: its thread (its own, not the pool's) ends
        deadline = time.monotonic() + 5
        while any(t.name == "ttrpc-wait" for t in threading.enumerate()) and \
                time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(t.name == "ttrpc-wait" for t in threading.enumerate())
    finally:
        svc.containers["c1"].init.set_exited(0, 1)  # a Wait still held lets go
        srv.stop()


def test_many_abandoned_waits_on_a_live_connection_leave_the_pool_free(svc, tmp_path):
    # containerd 2.x keeps its connection when `ctr task wait` is stopped and ttrpc
    # sends no cancel: each Wait runs on a thread of its own, never the pool's
    shim = load().shim
    service = shim.DESCRIPTOR.services_by_name["Task"]
    srv = ttrpc.TtrpcServer(service, svc, max_workers=1)
    path = str(tmp_path / "s.sock")
    assert srv.listen(path)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(path)
        for stream in range(1, 8, 2):
            _send(s, service, stream, "Wait", shim.WaitRequest(id="c1"))
        time.sleep(0.2)
        resp = ttrpc.call(path, service.full_name, "State", shim.StateRequest(id="c1"),
                          shim.StateResponse, timeout=5)
        assert resp.pid == 4242
    finally:
        svc.containers["c1"].init.set_exited(0, 1)
        s.close()
        srv.stop()
