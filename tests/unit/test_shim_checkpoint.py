"""shim/checkpoint.py: a dump CRIU gave up on at its seize is taken again where a
new freeze can miss the race, and said in words where only the client can."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpusnap.criu.log import UNSEIZABLE_MARK
from gpusnap.shim import checkpoint
from gpusnap.shim.runc import CheckpointOpts, RuncError

SEIZE = ("(10.138333) Error (criu/cr-dump.c:1655): Timeout reached. Try to interrupt: 0\n"
         "(10.138566) Error (compel/src/lib/infect.c:262): Unseizable non-zombie 4242 found, "
         "state D, err -1/4\n")


class FakeRunc:
    """runc checkpoint answering from ``logs``: a log text fails that try with it."""

    def __init__(self, work: Path, logs: list[str | None]) -> None:
        self.work, self.logs, self.calls = work, logs, 0

    def checkpoint(self, cid: str, opts: CheckpointOpts) -> None:
        log = self.logs[self.calls]
        self.calls += 1
        if log is not None:
            (self.work / "dump.log").write_text(log)
            raise RuncError("criu failed: type DUMP errno 0")


def _dump(tmp_path: Path, logs: list[str | None], frozen_by_client: bool) -> FakeRunc:
    runc = FakeRunc(tmp_path, logs)
    checkpoint.dump(runc, "c1", CheckpointOpts(image_path=str(tmp_path / "img"),  # type: ignore[arg-type]
                    work_path=str(tmp_path)), str(tmp_path / "criu-dump.log"), frozen_by_client)
    return runc


def test_a_task_the_shim_froze_is_taken_again(tmp_path):
    assert _dump(tmp_path, [SEIZE, None], frozen_by_client=False).calls == 2


def test_a_task_the_client_paused_gets_words_not_a_retry(tmp_path):
    with pytest.raises(RuncError) as err:
        _dump(tmp_path, [SEIZE, None], frozen_by_client=True)
    text = str(err.value)
    assert text.startswith(f"{UNSEIZABLE_MARK} 4242: it stayed uninterruptible"), text
    assert "checkpoint again" in text and f"(CRIU log: {tmp_path / 'criu-dump.log'})" in text


def test_other_failures_and_a_third_miss_are_raised(tmp_path):
    with pytest.raises(RuncError, match=r"criu failed: type DUMP errno 0 \(CRIU log: "):
        _dump(tmp_path, ["(0.1) Error (criu/files.c:1): no\n"], frozen_by_client=False)
    with pytest.raises(RuncError, match="3 tries; checkpoint again"):
        _dump(tmp_path, [SEIZE] * 3, frozen_by_client=False)


class EarlyFailingRunc:
    """runc checkpoint failing before CRIU ran: no work/dump.log."""

    calls = 0

    def checkpoint(self, cid: str, opts: CheckpointOpts) -> None:
        self.calls += 1
        raise RuncError("runc checkpoint: container is not running")


def test_an_earlier_failures_log_is_not_this_ones(tmp_path):
    (tmp_path / "criu-dump.log").write_text(SEIZE)  # an earlier dump's
    runc = EarlyFailingRunc()
    with pytest.raises(RuncError, match="container is not running") as err:
        checkpoint.dump(runc, "c1", CheckpointOpts(image_path=str(tmp_path / "img"),  # type: ignore[arg-type]
                        work_path=str(tmp_path / "work")), str(tmp_path / "criu-dump.log"), False)
    assert runc.calls == 1 and str(err.value) == "runc checkpoint: container is not running"  # no log named
    assert not (tmp_path / "criu-dump.log").exists()
