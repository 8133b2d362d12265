"""Calls into the NVIDIA driver (libcuda's checkpoint API, NVML), each on a
thread of its own, so that its caller can stop waiting: a wedged driver, or
one waiting on a process that does not run, never answers.

The driver is per process, and so is what is known here: which calls are in
flight, and which outlived their bound. libcuda's exit handlers would wait on
a call in flight, so a command leaves by os._exit meanwhile (waits.leave).
"""

from __future__ import annotations

import threading
from typing import Callable

# what a call that did not answer may mean, in every such line
WEDGED = "the driver or a GPU may be wedged (`nvidia-smi`, `dmesg` say which)"

# calls that outlived their bound: later ones do not wait on them again
_HUNG: list[threading.Thread] = []
# every call's thread, the finished ones pruned as new ones start
_CALLS: list[threading.Thread] = []
_LISTING = threading.Lock()


class Call:
    """One driver call, started at once on a daemon thread."""

    def __init__(self, name: str, call: Callable[[], object]) -> None:
        self._done, self._result = threading.Event(), []
        self._raised: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(call,), name=name, daemon=True)
        self.thread.start()  # before it is listed: an unstarted thread is not alive, and pruned
        with _LISTING:  # calls start from several threads at once (quiesce's pool, the agent)
            _CALLS[:] = [t for t in _CALLS if t.is_alive()] + [self.thread]

    def _run(self, call: Callable[[], object]) -> None:
        try:
            self._result.append(call())
        except BaseException as exc:  # handed to the caller, in its thread
            self._raised = exc
        finally:
            self._done.set()

    def landed(self, seconds: float) -> bool:
        """Whether the call has answered, waited for up to ``seconds``; its thread
        is gone once it has, so the driver may be asked about its pid again."""
        self.thread.join(seconds)
        return not self.thread.is_alive()

    def code(self, seconds: float):
        """The call's result, or None where it did not answer within ``seconds``;
        what it raised is raised here."""
        if not self._done.wait(seconds):
            return None
        if self._raised is not None:
            raise self._raised
        return self._result[0]


def left_behind(call: Call) -> None:
    """``call`` outlived its bound and is left to finish on its own."""
    if call.thread not in _HUNG:
        _HUNG.append(call.thread)


def is_hung(call: Call) -> bool:
    return call.thread in _HUNG


def hung_named(name: str) -> bool:
    """Whether a call started as ``name`` outlived its bound and is still in flight."""
    return any(t.is_alive() and t.name == name for t in _HUNG)


def driver_hung() -> bool:
    """Whether a driver call of this process outlived its bound and is still in flight."""
    return any(t.is_alive() for t in _HUNG)


def driver_busy() -> bool:
    """Whether a driver call of this process is in flight (Ctrl-C or an early
    failure during a lock, a checkpoint or cuInit ahead, not only a hung call)."""
    return driver_hung() or any(t.is_alive() for t in _CALLS)
