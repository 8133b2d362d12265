"""`gpusnap push containerd://NS/CTR --stop`: the task is killed only once its
checkpoint image exists; a failure before that resumes it (containerd_checkpoint.
_checkpoint_paused). containerd is stood in for here; the whole push and stop
runs against real containerd in tests/integration/test_shim_registry.py."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest

from gpusnap.ops import containerd_checkpoint as cc
from gpusnap.ops.containerd_api import ContainerdError


class _Containerd:
    def __init__(self, fail: str | None = None) -> None:
        self.calls: list[tuple[str, dict]] = []
        self.fail = fail
        self.pb = SimpleNamespace(images=SimpleNamespace(Image=lambda **kw: kw))

    @contextlib.contextmanager
    def leased(self):
        yield "lease"

    def call(self, module, service, method, **fields):
        self.calls.append((method, fields))
        if method == self.fail:
            raise ContainerdError(f"{service}.{method}: failed")
        if method == "Checkpoint":
            return SimpleNamespace(descriptors=[])
        return SimpleNamespace()

    def methods(self) -> list[str]:
        return [m for m, _ in self.calls]


@pytest.fixture
def stood_in(monkeypatch):
    monkeypatch.setattr(cc, "_rw_diff", lambda c, ctr: None)
    monkeypatch.setattr(cc, "_write_checkpoint_index", lambda c, ctr, descs: "index")
    monkeypatch.setattr(cc, "runc_checkpoint_options", lambda exit_after: {"exit": exit_after})


def test_a_stop_kills_the_task_only_after_its_image_exists(stood_in):
    c = _Containerd()
    cc._checkpoint_paused(c, None, "job", "ckpt:1", exit_after=True, check=None)
    assert c.methods() == ["Pause", "Checkpoint", "Create", "Kill", "Resume", "Wait"]
    assert dict(c.calls)["Checkpoint"]["options"] == {"exit": False}  # CRIU leaves it paused
    assert dict(c.calls)["Kill"] == {"container_id": "job", "signal": 9, "all": True}


@pytest.mark.parametrize("fail", ["check", "Create"])
def test_a_failure_after_the_dump_resumes_the_task_instead_of_losing_it(stood_in, fail):
    c = _Containerd(fail if fail != "check" else None)

    def check():
        if fail == "check":
            raise ContainerdError("pre-dump never took the client's GPU manifest")
    with pytest.raises(ContainerdError):
        cc._checkpoint_paused(c, None, "job", "ckpt:1", exit_after=True, check=check)
    assert "Kill" not in c.methods() and c.methods()[-1] == "Resume"


def test_a_full_disk_under_a_containerd_restore_is_one_line(monkeypatch, tmp_path):
    import errno

    from gpusnap.errors import GpusnapError
    from gpusnap.ops import containerd_registry as cr

    @contextlib.contextmanager
    def client(address, namespace):
        yield None

    def full(*a, **kw):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "checkpoint.tar"))
    monkeypatch.setattr(cr, "_client", client)
    monkeypatch.setattr(cr, "import_dir", full)
    plan = SimpleNamespace(gpu_map=None, address="a", namespace="ns", container="job")
    with pytest.raises(GpusnapError) as err:  # an OSError's traceback before
        cr._import(plan, tmp_path / "checkpoint", "reg/x:v1", None)
    assert err.value.message == (f"restoring job in namespace ns failed: No space left on "
                                 f"device: {tmp_path / 'checkpoint.tar'}")
    assert err.value.hint.startswith("free space there") and "reg/x:v1 is unchanged" in \
        err.value.hint


@pytest.mark.parametrize("leave_running, status, kept", [
    (True, "PAUSED", False), (True, "RUNNING", False), (True, "STOPPED", True),
    (False, "PAUSED", True), (False, "RUNNING", False), (False, "STOPPED", True)])
def test_a_paused_task_is_alive_only_where_no_kill_was_sent(monkeypatch, leave_running, status,
                                                            kept):
    # A leave-running push whose client Resume failed leaves the task paused,
    # and gpusnap's guardian resumes it: keeping the image and hinting
    # `ctr tasks rm` would have the user destroy it. A --stop push's paused task
    # may hold the SIGKILL its thaw delivers: its image is all that is left.
    from gpusnap.ops import containerd_registry as cr
    from gpusnap.proto import load

    pb = load()

    class Api:
        def __init__(self):
            self.pb = pb

        def call(self, module, service, method, **fields):
            if method == "Get" and service == "Tasks":
                return SimpleNamespace(process=SimpleNamespace(
                    status=getattr(pb.task_types, status)))
            return SimpleNamespace()  # the image exists

    @contextlib.contextmanager
    def client(address, namespace):
        yield Api()
    monkeypatch.setattr(cr, "_client", client)
    assert cr._only_copy("a", "ns", "job", "ckpt:1", leave_running) is kept
