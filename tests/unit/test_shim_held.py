"""shim/service.py: a CUDA task its client paused is thawed for the driver's
lock, dumped, and paused again for the client (a Go client diffs the rw layer
after Checkpoint and then resumes it, or not, if it was paused before);
requests.HELD keeps the action script's guardian from giving the GPUs back
until the client's Resume. Where the pause again fails the task runs and the
shim says so; a task thawed under the shim can still be resumed."""

from __future__ import annotations

import os

import grpc
import pytest
from google.protobuf import any_pb2

from gpusnap import requests
from gpusnap.shim import checkpoint as shim_checkpoint
from gpusnap.shim import service
from gpusnap.shim.process import Container, Proc
from gpusnap.shim.runc import RuncError
from gpusnap.shim.service import TaskService
from gpusnap.shim.stdio import Paths

INIT = os.getpid()  # a live process: the shim looks for it in /proc


class Events:
    def __init__(self) -> None:
        self.names: list[str] = []

    def publish(self, event) -> None:
        self.names.append(type(event).__name__)


class Runc:
    """runc against the cgroup's real state ``frozen``; ``pause_fails``: as a
    freeze that cannot complete."""

    def __init__(self, frozen: bool, pause_fails: bool = False) -> None:
        self.frozen, self.pause_fails, self.calls = frozen, pause_fails, []

    def pause(self, cid: str) -> None:
        self.calls.append("pause")
        if self.pause_fails:
            raise RuncError("runc pause: unable to freeze")
        self.frozen = True

    def resume(self, cid: str) -> None:
        self.calls.append("resume")
        if not self.frozen:
            raise RuncError("runc resume: container not paused")
        self.frozen = False

    def state(self, cid: str) -> dict:
        return {"status": "paused" if self.frozen else "running"}


class Context:
    def abort(self, code, details):
        raise grpc.RpcError(f"{code}: {details}")


class Request:
    id = "c1"
    path = "/nonexistent/image"
    options = any_pb2.Any()


@pytest.fixture
def shim(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUSNAP_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setattr(requests, "start_time", lambda pid: 1000)
    monkeypatch.setattr(shim_checkpoint, "cuda_processes", lambda pid: ["a CUDA process"])
    seen: dict = {}

    def dump(runc, cid, opts, log, frozen_by_client):  # what CRIU finds
        seen.update(frozen=runc.frozen, held=requests.bound(INIT, requests.HELD),
                    frozen_by_client=frozen_by_client)
        if seen.get("fail"):
            raise RuncError("criu failed")
    monkeypatch.setattr(service.shim_checkpoint, "dump", dump)
    events = Events()
    svc = TaskService("ns", events, None, lambda: None)  # type: ignore[arg-type]
    p = Proc(id="c1", paths=Paths(), pid=INIT, status="paused")
    svc.containers["c1"] = Container(id="c1", bundle=str(tmp_path), init=p)
    return svc, p, events, seen


def _runc(svc: TaskService, frozen: bool = True, pause_fails: bool = False) -> Runc:
    runc = Runc(frozen, pause_fails)
    svc.runcs["c1"] = runc  # type: ignore[assignment]
    return runc


def test_a_paused_cuda_task_is_dumped_running_paused_again_and_held_until_resume(shim):
    svc, p, events, seen = shim
    runc = _runc(svc)
    svc.Checkpoint(Request(), Context())
    held = seen.pop("held")
    assert seen == {"frozen": False, "frozen_by_client": False}
    assert held["started"] == 1000 and held["holder"] == os.getpid()  # this shim holds it
    assert runc.calls == ["resume", "pause"] and runc.frozen and p.status == "paused"
    assert requests.bound(INIT, requests.HELD)  # the guardian waits
    svc.Resume(Request(), Context())
    assert not runc.frozen and p.status == "running"
    assert requests.bound(INIT, requests.HELD) == {}  # the GPUs may come back now


def test_a_task_the_client_quiesced_is_dumped_paused_and_not_held(shim):
    svc, p, _, seen = shim
    runc = _runc(svc)
    requests.put_bound(INIT, requests.QUIESCED, manifest={}, pids=[INIT])
    svc.Checkpoint(Request(), Context())
    assert seen == {"frozen": True, "held": {}, "frozen_by_client": True}
    assert runc.calls == [] and p.status == "paused"


def test_a_pause_again_that_fails_leaves_it_running_and_says_so(shim):
    svc, p, events, _ = shim
    runc = _runc(svc, pause_fails=True)
    svc.Checkpoint(Request(), Context())
    assert p.status == "running" and not runc.frozen and "TaskResumed" in events.names
    assert requests.bound(INIT, requests.HELD) == {}
    with pytest.raises(grpc.RpcError, match="not paused"):  # as runc.v2 answers; Go clients
        svc.Resume(Request(), Context())  # ignore their deferred Resume's error
    assert p.status == "running"


def test_a_failed_dump_pauses_it_again_too(shim):
    svc, p, _, seen = shim
    runc = _runc(svc)
    seen["fail"] = True
    with pytest.raises(grpc.RpcError, match="criu failed"):
        svc.Checkpoint(Request(), Context())
    assert runc.calls == ["resume", "pause"] and p.status == "paused"
    assert requests.bound(INIT, requests.HELD)


def test_a_task_thawed_under_the_shim_is_resumed_all_the_same(shim):
    svc, p, events, _ = shim
    _runc(svc, frozen=False)  # a guardian thawed its cgroup (gpusnap's client killed)
    svc.Resume(Request(), Context())
    assert p.status == "running" and events.names == ["TaskResumed"]


def test_resume_of_a_running_task_is_still_refused(shim):
    svc, p, _, _ = shim
    _runc(svc, frozen=False)
    p.status = "running"
    with pytest.raises(grpc.RpcError, match="not paused"):
        svc.Resume(Request(), Context())


def _exit_options(svc: TaskService) -> any_pb2.Any:
    opts = any_pb2.Any()
    opts.Pack(svc.pb.runc_options.CheckpointOptions(exit=True))
    return opts


def test_a_dump_with_exit_neither_pauses_again_nor_stays_held(shim):
    svc, p, _, _ = shim
    runc = _runc(svc)
    req = Request()
    req.options = _exit_options(svc)
    svc.Checkpoint(req, Context())
    assert runc.calls == ["resume"]  # CRIU killed the task: nothing to pause
    assert requests.bound(INIT, requests.HELD) == {}


def test_a_failed_dump_with_exit_is_paused_again_and_held(shim):
    svc, p, _, seen = shim
    runc = _runc(svc)
    seen["fail"] = True
    req = Request()
    req.options = _exit_options(svc)
    with pytest.raises(grpc.RpcError, match="criu failed"):
        svc.Checkpoint(req, Context())
    assert runc.calls == ["resume", "pause"] and p.status == "paused"
    assert requests.bound(INIT, requests.HELD)


def test_a_resume_during_the_dump_waits_for_its_end(shim, monkeypatch):
    svc, p, _, seen = shim
    runc = _runc(svc)
    answers = []

    def dump(runc_, cid, opts, log, frozen_by_client):
        with pytest.raises(grpc.RpcError, match="being checkpointed") as err:
            svc.Resume(Request(), Context())
        answers.append(str(err.value))
    monkeypatch.setattr(service.shim_checkpoint, "dump", dump)
    svc.Checkpoint(Request(), Context())
    assert answers and runc.frozen and requests.bound(INIT, requests.HELD)
    svc.Resume(Request(), Context())  # after it: as usual
    assert p.status == "running" and requests.bound(INIT, requests.HELD) == {}


def test_a_task_killed_while_paused_is_not_resumed_into_running(shim):
    # push --stop kills the paused task, then resumes it so it dies: its exit
    # may land first, and a "running" set after it would outlive the task.
    svc, p, _, _ = shim
    runc = _runc(svc, frozen=False)  # runc kill --all thawed it already
    runc.state = lambda cid: {"status": "running"}  # init still exiting
    p.set_exited(137, 1)
    p.status = "paused"  # as the shim had it when the Resume came
    p.exited.set()
    svc.Resume(Request(), Context())
    assert p.status == "paused" and p.exited.is_set()  # not "running": TaskExit has it
