"""shim/service.py: a task being restored (Start running `runc restore`) cannot
be deleted under CRIU (its rootfs unmounted, its images removed), and a
restore that failed leaves no runc state behind that would make the next
restore into the same id fail with "exists". runc is stood in for; the shim's
restores run against real containerd in tests/integration/test_shim*.py."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import grpc
import pytest

from gpusnap.shim import remap
from gpusnap.shim.process import Container, Proc
from gpusnap.shim.runc import RuncError
from gpusnap.shim.service import TaskService
from gpusnap.shim.stdio import Paths


class Runc:
    def __init__(self, fail: bool) -> None:
        self.fail, self.calls = fail, []
        self.restoring, self.go_on = threading.Event(), threading.Event()

    def restore(self, cid, *args) -> None:
        self.calls.append("restore")
        self.restoring.set()
        assert self.go_on.wait(10)
        if self.fail:
            raise RuncError("runc restore: criu failed")

    def delete(self, cid: str, force: bool = False) -> None:
        self.calls.append(f"delete force={force}")


class Context:
    def abort(self, code, details):
        raise grpc.RpcError(f"{code}: {details}")


class _IO:
    stdio = None

    def console_socket(self, bundle):
        return None

    def started(self) -> None:
        pass

    def wait(self, s) -> None:
        pass

    def close(self) -> None:
        pass


@pytest.mark.parametrize("fail", [True, False])
def test_a_task_being_restored_is_not_deleted_and_a_failed_restore_leaves_no_runc_state(
        tmp_path, monkeypatch, fail):
    monkeypatch.setenv("GPUSNAP_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setattr(remap, "plan_edits", lambda bundle, checkpoint: None)
    svc = TaskService("ns", SimpleNamespace(publish=lambda e: None), None, lambda: None)
    monkeypatch.setattr(svc, "_watch", lambda c, p: None)
    (tmp_path / "init.pid").write_text("4242")
    p = Proc(id="c1", paths=Paths(), io=_IO())  # type: ignore[arg-type]
    svc.containers["c1"] = Container(id="c1", bundle=str(tmp_path), init=p,
                                     checkpoint=str(tmp_path / "images"))
    runc = Runc(fail)
    svc.runcs["c1"] = runc  # type: ignore[assignment]
    req = SimpleNamespace(id="c1", exec_id="")
    started: list = []
    start = threading.Thread(target=lambda: started.append(_try(svc.Start, req)))
    start.start()
    assert runc.restoring.wait(10)
    with pytest.raises(grpc.RpcError, match="cannot delete running process c1"):
        svc.Delete(req, Context())
    assert "c1" in svc.containers
    runc.go_on.set()
    start.join(10)
    if fail:
        assert isinstance(started[0], Exception)
        assert runc.calls == ["restore", "delete force=True"]  # runc's state gone with it
        assert not p.restoring
    else:
        assert p.status == "running" and runc.calls == ["restore"] and not p.restoring


def _try(fn, req):
    try:
        return fn(req, Context())
    except Exception as exc:  # noqa: BLE001 -- the test looks at it
        return exc


def test_containerds_systemd_cgroup_option_reaches_every_runc_command(tmp_path):
    # SystemdCgroup = true (kubeadm's default): the cgroupsPath is slice:prefix:name,
    # which runc reads only with --systemd-cgroup, on create, kill, delete and the rest.
    from concurrent.futures import Future

    from gpusnap.shim.reaper import Exit
    from gpusnap.shim.runc import Runc as RealRunc

    seen: list[list[str]] = []

    def spawn(argv, **fds):
        seen.append(argv)
        done: Future = Future()
        done.set_result(Exit(1, 0, 0))
        return 1, done

    reaper = SimpleNamespace(spawn=spawn)
    for systemd in (True, False):
        RealRunc(reaper, "/run/r", str(tmp_path / "log.json"), "runc", systemd).kill("c1", 9)  # type: ignore[arg-type]
    assert seen[0][:4] == ["runc", "--root", "/run/r", "--systemd-cgroup"] and seen[0][-3:] == ["kill", "c1", "9"]
    assert "--systemd-cgroup" not in seen[1]


@pytest.mark.parametrize("exits, says, code", [
    (True, "signal refused", "NOT_FOUND"),  # the reaper's word, a moment later
    (False, "container not running", "NOT_FOUND"),  # runc's, as containerd's checkKillError reads it
    (False, "signal refused", "UNKNOWN")])
def test_a_kill_of_an_init_that_exits_as_runc_looks_is_not_found(tmp_path, exits, says, code):
    # containerd's Delete(WithProcessKill) takes NOT_FOUND ("already finished") as done;
    # runc's "container not running" as UNKNOWN failed it.
    svc = TaskService("ns", SimpleNamespace(publish=lambda e: None), None, lambda: None)
    p = Proc(id="k1", paths=Paths(), pid=4242, status="running")
    svc.containers["k1"] = Container(id="k1", bundle=str(tmp_path), init=p)

    class Gone:
        def kill(self, cid, sig, all_procs=False):
            if exits:
                threading.Timer(0.1, p.set_exited, (137, 1)).start()  # the reaper, a moment later
            raise RuncError(says)

    svc.runcs["k1"] = Gone()  # type: ignore[assignment]
    with pytest.raises(grpc.RpcError) as e:
        svc.Kill(SimpleNamespace(id="k1", exec_id="", signal=9, all=False), Context())
    assert str(e.value.args[0]).startswith(f"StatusCode.{code}"), e.value


@pytest.mark.parametrize("restored", [False, True])
def test_shim_delete_keeps_the_log_of_a_restore_only_where_it_did_not_succeed(
        tmp_path, monkeypatch, capfdbinary, restored):  # delete writes its answer's bytes
    """`SHIM delete` after a dead shim: a restore that died with it left its
    log (runc's error names it), kept; one that succeeded before the shim died
    is no failure to file. CRIU's folder goes either way."""
    from gpusnap.shim import bundle as bundle_state
    from gpusnap.shim import main as shim_main

    monkeypatch.setenv("GPUSNAP_STATE_DIR", str(tmp_path / "state"))
    bundle, work = tmp_path / "bundle", tmp_path / "bundle" / "criu-work"
    work.mkdir(parents=True)
    (work / "restore.log").write_text("Error (criu/cr-restore.c:1): the restore's own words\n")
    fake_runc = tmp_path / "runc"
    fake_runc.write_text("#!/bin/sh\nexit 0\n")
    fake_runc.chmod(0o755)
    bundle_state.write_state(str(bundle), "/run/r/ns", str(fake_runc), False, "/ckpt", str(work))
    if restored:
        bundle_state.mark_restored(str(bundle))
    assert bundle_state.read_state(str(bundle))["criu_work"] == str(work)
    shim_main.delete({"namespace": "ns", "id": "r1", "bundle": str(bundle)})
    kept = list((tmp_path / "state" / "logs").glob("restore-r1-*.log"))
    assert len(kept) == (0 if restored else 1) and not work.exists()
