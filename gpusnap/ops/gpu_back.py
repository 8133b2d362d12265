"""A leave-running checkpoint of a CUDA container: its GPUs given back.

Podman is done once CRIU is, but the container's CUDA processes get their
GPUs back later: pre-dump's guardian (action/guardian.py) restores and
unlocks them after CRIU exits, seconds later at GBs of GPU memory, and a
failure there was in the journal only. The guardian holds the container's
turn (gpu/turn.py) until then and journals its verdict (turn.DONE) just
before it lets go: so `gpusnap checkpoint --leave-running` waits for the
turn, within GPU_TURN, then reads that verdict and says it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from gpusnap import journal
from gpusnap.criu.runtimes import runs_action_script
from gpusnap.gpu.turn import DONE, GUARDING, holder, wait_turn
from gpusnap.waits import Bound, WaitExpired, raise_words

FIX = "run `gpusnap doctor --fix` to give them back"


@dataclass
class GpuBack:
    """Whether the GPUs are back: None where that is not known (yet)."""

    back: bool | None
    seconds: float  # waited for the guardian's turn once Podman was done
    detail: str | None = None  # where not back: what happened, in one line
    hint: str | None = None
    interrupted: bool = False  # Ctrl-C in the wait: the command exits 130 once it has said this

    def fields(self) -> dict:
        """For the checkpoint's result (and --json)."""
        out: dict = {"gpu_back": self.back, "gpu_back_seconds": self.seconds}
        if self.detail:
            out.update(gpu_back_detail=self.detail, gpu_back_hint=self.hint)
        if self.interrupted:
            out["gpu_back_interrupted"] = True
        return out


def expected(leave_running: bool, cuda: bool, runtime: str) -> bool:
    """Whether a guardian gives GPUs back after this checkpoint: not where the
    dump stops the container, nor without CUDA processes, nor where CRIU runs
    no action script (its CUDA plugin then gives them back before it ends)."""
    return leave_running and cuda and runs_action_script(runtime)


def _another_took_it(pid: int | None, role: str) -> bool:
    """A later command holds the turn: the guardian has let go of it."""
    return bool(role) and role not in GUARDING


def wait(init_pid: int, name: str, since: float, until: float,
         bound: Bound | None = None) -> GpuBack:
    """The guardian's verdict on ``name``'s GPUs, once it has let go of the turn:
    of the dump between ``since`` and ``until`` (when Podman was done)."""
    bound = bound or Bound.of("GPU_TURN")
    started = time.monotonic()
    try:
        turn = wait_turn(init_pid, f"the GPUs of {name} given back", "checkpoint's check",
                         bound, go_on=_another_took_it)
    except WaitExpired:
        return _still_coming(init_pid, name, round(time.monotonic() - started, 3))
    except OSError as exc:  # a state folder this process cannot use: nothing to wait on
        return GpuBack(None, 0.0, f"the checkpoint of {name} is complete; whether its GPUs "
                       f"are back could not be told ({exc})", f"`gpusnap doctor` tells; {FIX}")
    if turn is not None:
        turn.release()
    return verdict(init_pid, name, since, until, round(time.monotonic() - started, 3))


def not_waited(name: str) -> GpuBack:
    """Ctrl-C during the wait: the checkpoint is complete; the guardian goes on."""
    return GpuBack(None, 0.0, f"the checkpoint of {name} is complete; its GPUs were not "
                   "waited for (Ctrl-C): gpusnap's guardian goes on giving them back",
                   "`gpusnap doctor` says once they are back", interrupted=True)


def _still_coming(init_pid: int, name: str, waited: float) -> GpuBack:
    who, _ = holder(init_pid)
    return GpuBack(None, waited, (
        f"the checkpoint of {name} is complete; its GPUs are still being given back by "
        f"gpusnap's guardian (pid {who or 'unknown'}) {waited:.0f} s after Podman was done"),
        "`gpusnap doctor` says once they are back (its processes are \"left to gpusnap's "
        f"guardian\" meanwhile); a host that is just slow: {raise_words('GPU_TURN')}")


def _mine(init_pid: int, since: float, until: float) -> list[dict]:
    """This container's journal events since ``since``, from the last quiesce
    before ``until`` (a retaken checkpoint quiesced once a try) to the next one:
    another command's checkpoint of it, which waited on Podman's lock, comes
    after, and its guardian's verdict is not this one's."""
    events = [e for e in journal.read(1000) if str(e.get("init_pid")) == str(init_pid)
              and isinstance(e.get("at"), (int, float)) and e["at"] >= since - 1]
    starts = [i for i, e in enumerate(events) if e.get("event") == "quiesced"]
    if not starts:
        return events
    mine = [i for i in starts if events[i]["at"] <= until + 0.001]  # "at": to the millisecond
    if not mine:  # this dump quiesced nothing: the quiesces are others'
        return events[:starts[0]]
    first = mine[-1]
    later = [i for i in starts if i > first]
    return events[first:later[0]] if later else events[first:]


def verdict(init_pid: int, name: str, since: float, until: float, waited: float) -> GpuBack:
    """What the guardian journaled (turn.DONE, and its failure's words)."""
    events = _mine(init_pid, since, until)
    done = [e for e in events if e.get("event") == DONE]
    quiesced = events[0] if events and events[0].get("event") == "quiesced" else None
    if done and done[-1].get("ok"):
        return GpuBack(True, waited)
    if done:
        said = [e.get("error") for e in events if e.get("event") == "guardian-failed"]
        why = said[-1] if said and said[-1] else "the guardian failed (the journal says no more)"
        return _not_back(name, waited, why)
    if quiesced is not None and not quiesced.get("guardian", True):
        return GpuBack(True, waited)  # nothing quiesced here: no GPU was taken away
    if quiesced is not None:  # not known to be back: said as not back, the way to check with it
        return GpuBack(False, waited, f"the checkpoint of {name} is complete and kept, but "
                       "gpusnap's guardian ended before it said its GPUs were back (killed?)",
                       f"`gpusnap doctor` shows whether they are; {FIX}")
    # no quiesce and no verdict: its CUDA processes ended before the dump (nothing
    # taken), or the journal could not be written (a full state folder): not known
    return GpuBack(None, waited, f"the checkpoint of {name} is complete; whether its GPUs "
                   "are back could not be told (gpusnap's journal holds no record of its "
                   "quiesce)", "`gpusnap doctor` tells")


def _not_back(name: str, waited: float, why: str) -> GpuBack:
    return GpuBack(False, waited, f"the checkpoint of {name} is complete and kept, but its "
                   f"GPUs were not given back: {why}",
                   f"{FIX} (where the driver refuses, it says what else to do); the "
                   "checkpoint needs nothing more")
