"""`gpusnap checkpoint --leave-running` of a CUDA container says whether its
GPUs are back (ops/gpu_back.py): it waits for the guardian's turn (a real
process holds it here, as a guardian does), then reads the guardian's verdict
from the journal. A checkpoint without a guardian to wait for does not wait."""

from __future__ import annotations

import json
import threading
import time
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from gpusnap import journal
from gpusnap.cli import checkpoint as cli
from gpusnap.gpu import turn as turns
from gpusnap.ops import gpu_back
from gpusnap.waits import Bound
from tests.unit import turn_holder

INIT = 4343


@pytest.fixture(autouse=True)
def state(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUSNAP_STATE_DIR", str(tmp_path / "state"))


def _checkpoint(monkeypatch, *args: str, cuda: bool = True, leave_running: bool = True,
                runtime: str = "runc"):
    """`gpusnap checkpoint web ARGS`, its dump faked: done at once."""
    plan = SimpleNamespace(container=SimpleNamespace(pid=INIT, name="web", runtime=runtime, id="c0ffee"),
                           cuda=[SimpleNamespace(pid=INIT + 1)] if cuda else [],
                           estimate_bytes=1 << 30, leave_running=leave_running)
    result = {"container": {"id": "c0ffee", "name": "web"}, "export": None,
              "leave_running": leave_running, "seconds": 1.0, "export_bytes": None,
              "criu": {"processes": 2, "memory_pages_bytes": 1 << 20}, "gpu": None}
    monkeypatch.setattr(cli.ops, "plan", lambda *a, **k: plan)
    def run(p):
        p.dumped = (time.time() - 1, time.time())  # as ops.checkpoint stamps it: Podman done
        return dict(result)
    monkeypatch.setattr(cli.ops, "run", run)
    return CliRunner().invoke(cli.checkpoint_cmd, ["web", *args])


def _guardian_ends(holder, after: float, ok: bool, error: str | None = None) -> None:
    """The guardian's end, as action/guardian.py's main: its verdict, then the turn."""
    def end():
        time.sleep(after)
        if error:
            journal.record("guardian-failed", init_pid=INIT, pids=[INIT + 1], error=error)
        journal.record(turns.DONE, init_pid=INIT, ok=ok)
        turn_holder.stop(holder)
    threading.Thread(target=end).start()


def test_a_leave_running_checkpoint_says_its_gpus_are_back_once_the_guardian_let_go(monkeypatch):
    journal.record("quiesced", init_pid=INIT, pids=[INIT + 1], guardian=True)
    holder = turn_holder.start(INIT)
    _guardian_ends(holder, 0.4, ok=True)
    res = _checkpoint(monkeypatch, "-R", "--json")
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert out["gpu_back"] is True and out["gpu_back_seconds"] >= 0.3
    assert "gpu_back_detail" not in out
    assert holder.poll() is not None  # waited for it to let go


def test_a_give_back_that_failed_is_said_and_the_checkpoint_kept(monkeypatch):
    journal.record("quiesced", init_pid=INIT, pids=[INIT + 1], guardian=True)
    holder = turn_holder.start(INIT)
    _guardian_ends(holder, 0.1, ok=False, error="restore failed for 1 process(es): pid 4344: "
                   "cuCheckpointProcessRestore(pid 4344) failed: CUDA_ERROR_OUT_OF_MEMORY (2)")
    res = _checkpoint(monkeypatch, "-R", "--json")
    assert res.exit_code == 1
    out = json.loads(res.output)
    assert out["gpu_back"] is False and out["container"]["name"] == "web"
    assert out["gpu_back_detail"].startswith(
        "the checkpoint of web is complete and kept, but its GPUs were not given back: "
        "restore failed for 1 process(es): pid 4344")
    assert "`gpusnap doctor --fix`" in out["gpu_back_hint"]
    # and in words, on stderr, after the usual lines
    journal.record("quiesced", init_pid=INIT, pids=[INIT + 1], guardian=True)
    holder = turn_holder.start(INIT)
    _guardian_ends(holder, 0.1, ok=False, error="CUDA_ERROR_OUT_OF_MEMORY")
    res = _checkpoint(monkeypatch, "-R")
    assert res.exit_code == 1 and "Checkpointed web" in res.output
    assert "the container keeps running, off its GPUs" in res.output
    assert "Error: the checkpoint of web is complete and kept" in res.output
    assert "gpusnap doctor --fix" in res.output


def test_a_guardian_still_at_work_at_the_bound_is_said_with_the_command_to_check(monkeypatch):
    monkeypatch.setenv("GPUSNAP_WAIT_GPU_TURN", "0.3")
    journal.record("quiesced", init_pid=INIT, pids=[INIT + 1], guardian=True)
    with turn_holder.holding(INIT) as holder:
        res = _checkpoint(monkeypatch, "-R", "--json")
    assert res.exit_code == 0  # the checkpoint is complete; the GPUs are on their way
    out = json.loads(res.output)
    assert out["gpu_back"] is None and out["gpu_back_seconds"] >= 0.3
    assert out["gpu_back_detail"].startswith(
        f"the checkpoint of web is complete; its GPUs are still being given back by gpusnap's "
        f"guardian (pid {holder.pid}) ")
    assert out["gpu_back_detail"].endswith(" s after Podman was done")
    assert out["gpu_back_hint"].startswith("`gpusnap doctor` says once they are back")
    assert "GPUSNAP_WAIT_GPU_TURN=SECONDS" in out["gpu_back_hint"]


@pytest.mark.parametrize("cuda, leave_running, runtime", [
    (False, True, "runc"), (True, False, "runc"),
    (True, True, "/usr/bin/runsc")])  # no action script: CRIU's CUDA plugin's to give back
def test_a_checkpoint_without_a_guardian_to_wait_for_does_not_wait(monkeypatch, cuda,
                                                                   leave_running, runtime):
    with turn_holder.holding(INIT):  # would hold it past any wait
        started = time.monotonic()
        res = _checkpoint(monkeypatch, *(["-R"] if leave_running else []), "--json",
                          cuda=cuda, leave_running=leave_running, runtime=runtime)
        assert time.monotonic() - started < 2
    assert res.exit_code == 0 and "gpu_back" not in json.loads(res.output)


def test_a_guardian_gone_without_a_word_is_not_taken_for_gpus_back():
    journal.record("quiesced", init_pid=INIT, pids=[INIT + 1], guardian=True)
    back = gpu_back.wait(INIT, "web", time.time() - 5, time.time(), Bound("GPU_TURN", 5))
    assert back.back is False and "ended before it said its GPUs were back" in back.detail
    assert "`gpusnap doctor --fix`" in back.hint


def test_gpus_nothing_took_away_are_back():
    journal.record("quiesced", init_pid=INIT, pids=[INIT + 1], guardian=False)
    assert gpu_back.wait(INIT, "web", time.time() - 5, time.time(), Bound("GPU_TURN", 5)).back is True


def test_an_earlier_trys_verdict_is_not_this_ones():
    """A retaken checkpoint (stale files) quiesced once a try: the last try's
    guardian is the one whose verdict counts."""
    journal.record("quiesced", init_pid=INIT, pids=[INIT + 1], guardian=True)
    journal.record(turns.DONE, init_pid=INIT, ok=True)
    journal.record("quiesced", init_pid=INIT, pids=[INIT + 1], guardian=True)
    journal.record("guardian-failed", init_pid=INIT + 7, error="another container's")
    journal.record(turns.DONE, init_pid=INIT, ok=False)
    back = gpu_back.verdict(INIT, "web", time.time() - 5, time.time(), 0.1)
    assert back.back is False and "the journal says no more" in back.detail


def test_a_second_checkpoint_run_at_once_is_not_taken_for_this_ones():
    """Two `checkpoint -R` of one container: Podman's lock runs this one's dump
    first; the other's quiesce and verdict come after this one's Podman was
    done, and are not this one's."""
    since = time.time() - 5
    journal.record("quiesced", init_pid=INIT, pids=[INIT + 1], guardian=True)
    journal.record(turns.DONE, init_pid=INIT, ok=True)
    until = time.time()
    time.sleep(0.05)
    journal.record("quiesced", init_pid=INIT, pids=[INIT + 1], guardian=True)  # the other's
    assert gpu_back.verdict(INIT, "web", since, until, 0.1).back is True
    journal.record("guardian-failed", init_pid=INIT, error="the other's give-back failed")
    journal.record(turns.DONE, init_pid=INIT, ok=False)
    assert gpu_back.verdict(INIT, "web", since, until, 0.1).back is True
    other = gpu_back.verdict(INIT, "web", since, time.time(), 0.1)  # the other's own verdict
    assert other.back is False and "the other's give-back failed" in other.detail


def test_a_dump_that_quiesced_nothing_is_not_given_anothers_quiesce():
    since = time.time() - 5
    until = time.time()
    time.sleep(0.05)
    journal.record("quiesced", init_pid=INIT, pids=[INIT + 1], guardian=True)
    journal.record(turns.DONE, init_pid=INIT, ok=False)
    assert gpu_back.verdict(INIT, "web", since, until, 0.1).back is None


def test_a_later_command_holding_the_turn_is_not_waited_for():
    """The guardian let go and, say, `gpusnap freeze` took the turn at once."""
    journal.record("quiesced", init_pid=INIT, pids=[INIT + 1], guardian=True)
    journal.record(turns.DONE, init_pid=INIT, ok=True)
    with turn_holder.holding(INIT, "freeze"):
        started = time.monotonic()
        assert gpu_back.wait(INIT, "web", time.time() - 5, time.time(), Bound("GPU_TURN", 5)).back is True
        assert time.monotonic() - started < 2


def test_no_record_of_the_quiesce_is_said_as_not_known_never_as_back():
    # processes that ended before the dump, or a journal that could not be written
    back = gpu_back.wait(INIT, "web", time.time() - 5, time.time(), Bound("GPU_TURN", 5))
    assert back.back is None and "could not be told" in back.detail
    assert back.hint == "`gpusnap doctor` tells"


def test_ctrl_c_during_the_wait_still_says_the_checkpoint_it_took(monkeypatch):
    def interrupted(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(gpu_back, "wait", interrupted)
    res = _checkpoint(monkeypatch, "-R", "--json")
    assert res.exit_code == 130, res.output
    out = json.loads(res.output)
    assert out["container"]["name"] == "web" and out["gpu_back"] is None
    assert "not waited for (Ctrl-C)" in out["gpu_back_detail"]
