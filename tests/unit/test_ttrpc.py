"""The shim's ttrpc server (containerd 2.x) against its own client: frames,
status codes, concurrent calls on one connection, unknown methods."""

from __future__ import annotations

import socket
import threading

import grpc
import pytest
from google.protobuf import empty_pb2

from gpusnap.proto import load
from gpusnap.shim import ttrpc


class Servicer:
    def __init__(self) -> None:
        self.pb = load().shim
        self.release = threading.Event()

    def State(self, request, context):
        return self.pb.StateResponse(id=request.id, pid=42)

    def Wait(self, request, context):  # holds its worker, as a real Wait does
        self.release.wait(10)
        return self.pb.WaitResponse(exit_status=7)

    def Kill(self, request, context):
        context.abort(grpc.StatusCode.NOT_FOUND, f"container {request.id} not found")


@pytest.fixture
def server(tmp_path):
    pb = load().shim
    servicer = Servicer()
    service = pb.DESCRIPTOR.services_by_name["Task"]
    for m in service.methods:  # the server takes one callable per method
        if not hasattr(Servicer, m.name):
            setattr(servicer, m.name, lambda req, ctx: ctx.abort(grpc.StatusCode.UNIMPLEMENTED, "no"))
    srv = ttrpc.TtrpcServer(service, servicer)
    path = str(tmp_path / "s.sock")
    assert srv.listen(path)
    yield path, servicer, service
    srv.stop()


def test_a_call_answers_and_an_abort_is_its_status(server):
    path, _, service = server
    pb = load().shim
    resp = ttrpc.call(path, service.full_name, "State", pb.StateRequest(id="c1"), pb.StateResponse)
    assert (resp.id, resp.pid) == ("c1", 42)
    with pytest.raises(ttrpc.TtrpcError) as err:
        ttrpc.call(path, service.full_name, "Kill", pb.KillRequest(id="c2"), empty_pb2.Empty)
    assert err.value.code == grpc.StatusCode.NOT_FOUND.value[0]
    assert "container c2 not found" in str(err.value)
    with pytest.raises(ttrpc.TtrpcError) as err:
        ttrpc.call(path, "containerd.task.v2.Task", "State", pb.StateRequest(id="c1"), pb.StateResponse)
    assert err.value.code == grpc.StatusCode.UNIMPLEMENTED.value[0]


def test_a_blocked_wait_does_not_hold_up_other_streams_on_the_connection(server):
    path, servicer, service = server
    pb = load().ttrpc
    shim = load().shim
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(path)
        for stream, method, req in ((1, "Wait", shim.WaitRequest(id="c1")), (3, "State", shim.StateRequest(id="c9"))):
            body = pb.Request(service=service.full_name, method=method,
                              payload=req.SerializeToString()).SerializeToString()
            s.sendall(ttrpc.HEADER.pack(len(body), stream, ttrpc.REQUEST, 0) + body)
        order = []
        for _ in range(2):
            length, stream, kind, _ = ttrpc.HEADER.unpack(ttrpc._read(s, ttrpc.HEADER.size))
            resp = pb.Response.FromString(ttrpc._read(s, length))
            order.append(stream)
            assert kind == ttrpc.RESPONSE and resp.status.code == 0
            if stream == 3:
                assert shim.StateResponse.FromString(resp.payload).id == "c9"
                servicer.release.set()  # only now may Wait answer
            else:
                assert shim.WaitResponse.FromString(resp.payload).exit_status == 7
    assert order == [3, 1]
