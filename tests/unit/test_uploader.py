"""The Uploader against a registry that dies: the chunks queued behind the one
that failed for good are not sent, each to fail in its turn."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

import pytest

from gpusnap.oci import transfer
from gpusnap.oci.reference import parse as parse_ref
from gpusnap.oci.registry import TransientError


class DeadRegistry:
    """Every upload fails after ``seconds`` (its tries and bounds, shortened)."""

    def __init__(self, seconds: float) -> None:
        self.ref = parse_ref("reg.io/ckpt/app:v1")
        self.seconds = seconds
        self.puts = 0
        self._lock = threading.Lock()

    def blob_exists(self, digest: str) -> bool:
        return False

    def put_blob(self, digest: str, data: bytes) -> None:
        with self._lock:
            self.puts += 1
        time.sleep(self.seconds)
        raise TransientError("cannot reach registry reg.io: no connection within 10 s "
                             "(after 4 tries)")


def _failed(future: Future) -> BaseException | None:
    return future.exception(timeout=10)


def _depth(exc: BaseException) -> int:
    tb, n = exc.__traceback__, 0
    while tb is not None:
        tb, n = tb.tb_next, n + 1
    return n


def test_chunks_queued_behind_a_failed_one_are_not_sent():
    reg = DeadRegistry(0.3)
    up = transfer.Uploader(reg, None, 1, workers=2)
    try:
        futures = [up.submit(bytes([i]) * 4096) for i in range(8)]
        errors = [_failed(f) for f in futures]
    finally:
        up.close()
    assert all(isinstance(e, TransientError) for e in errors), errors
    # the two in flight when the registry died tried; the six queued did not
    assert reg.puts == 2, reg.puts
    # each its own copy, with its own short traceback: one object raised from
    # every worker gathered all their frames, each holding its chunk's bytes
    assert len({id(e) for e in errors}) == len(errors)
    assert all(_depth(e) <= 3 for e in errors), [_depth(e) for e in errors]
    with pytest.raises(TransientError):
        up.submit(b"x" * 4096)


def test_a_submit_waiting_on_the_budget_sees_the_failure_that_freed_it():
    reg = DeadRegistry(0.2)
    up = transfer.Uploader(reg, None, 1, workers=1)
    up.budget.limit = 4096  # one chunk in flight: the next submit waits for it
    try:
        first = up.submit(b"a" * 4096)
        with pytest.raises(TransientError):
            up.submit(b"b" * 4096)
        assert isinstance(_failed(first), TransientError)
    finally:
        up.close()
    assert reg.puts == 1, reg.puts
