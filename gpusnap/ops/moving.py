"""Moves `gpusnap move` has under way, recorded so that one cut anywhere can be undone.

A move's processes are CHECKPOINTED in the driver while the container's
/dev nodes and device cgroup rule change under them. A move killed there
(SIGTERM, SIGKILL) left no word of it, and `gpusnap doctor --fix` took its
processes for a checkpoint's: it restored them onto their old GPUs, which
the container's nodes and rule no longer named. So a move writes a record
before anything changes: its container (init pid and start time), its
processes with their start times (a record outliving them names nothing),
the nodes and rules before and after, the GPU pairs it offered the driver,
and how far it got. ``put_back`` undoes it from there, for the move itself
and for doctor alike, and removes the record once the processes run on
their old GPUs again.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from gpusnap import journal
from gpusnap.errors import GpusnapError
from gpusnap.gpu import turn
from gpusnap.gpu.cuda import ProcessState
from gpusnap.gpu.quiesce import Driver, QuiesceError, quiesce, resume, resume_onto, states
from gpusnap.private import write_private
from gpusnap.procs import start_time
from gpusnap.runtime.livedev import LiveDevices

# How far a move got, each written before its step starts:
QUIESCE = "quiesce"  # processes leaving their old GPUs; the devices untouched
DEVICES = "devices"  # nodes and rule may be changed; a process not CHECKPOINTED is on the new GPUs
UNDONE = "undone"  # nodes and rule as before; those of on_new were CHECKPOINTED off the new GPUs
_PHASES = {QUIESCE: "while leaving its old GPUs", DEVICES: "with its GPU nodes and device rule "
           "changed or changing", UNDONE: "on its way back to its old GPUs"}

Pairs = list[tuple[str, str]] | None


class BackError(Exception):
    """A step of putting a move back failed; its record is kept for doctor."""


@dataclass
class Move:
    """One move's record, as written under the state folder's moves/."""

    init_pid: int
    init_start: int | None
    container: str
    pids: dict[int, int | None]  # pid -> start time
    devices: dict  # LiveDevices.to_dict()
    choices: list[tuple[str, Pairs]]  # the GPU UUID pairs offered the driver, old -> new
    phase: str = QUIESCE
    on_new: list[int] = field(default_factory=list)  # checkpointed again off the new GPUs

    def where(self) -> str:
        """How far it got, in words."""
        return _PHASES[self.phase]

    def running(self) -> list[int]:
        """The move's processes that still run (the same start time)."""
        return [p for p, born in self.pids.items() if born is not None and start_time(p) == born]

    def advance(self, phase: str, on_new: list[int] | None = None) -> None:
        self.phase = phase
        if on_new is not None:
            self.on_new = on_new
        self.save()

    def save(self) -> None:
        data = {**asdict(self), "pids": {str(p): t for p, t in self.pids.items()}}
        write_private(_path(self.init_pid), json.dumps(data))

    def note(self, phase: str, on_new: list[int] | None = None) -> None:
        """``advance`` on the way back: a record that cannot be written (a full or
        read-only state folder) must not stop the undo that is under way."""
        try:
            self.advance(phase, on_new)
        except OSError as exc:
            journal.record("move-record-unsaved", container=self.container, phase=phase,
                           error=str(exc))

    def back_choices(self) -> list[tuple[str, Pairs]]:
        """The pairs that take a process checkpointed on the new GPUs back to the old."""
        return [(f"{label}, back", [(new, old) for old, new in pairs] if pairs else None)
                for label, pairs in self.choices]

    @classmethod
    def from_dict(cls, d: dict) -> "Move":
        if d.get("phase", QUIESCE) not in _PHASES:
            raise ValueError(f"phase {d.get('phase')!r}")
        return cls(int(d["init_pid"]), d.get("init_start"), str(d.get("container") or "?"),
                   {int(p): t for p, t in d["pids"].items()}, dict(d["devices"]),
                   [(str(label), [tuple(p) for p in pairs] if pairs else None)
                    for label, pairs in d["choices"]],
                   d.get("phase", QUIESCE), [int(p) for p in d.get("on_new", [])])


def _folder() -> Path:
    return journal.state_subdir("moves")


def _path(init_pid: int) -> Path:
    return _folder() / f"{init_pid}.json"


def begin(init_pid: int, name: str, pids: list[int], live: LiveDevices,
          choices: list[tuple[str, Pairs]]) -> Move:
    """The record of a move about to start, written before anything changes
    (``refuse`` kept the move of a container whose last one was cut off from
    getting here: this would write over its record)."""
    move = Move(init_pid, start_time(init_pid), name, {p: start_time(p) for p in pids},
                live.to_dict(), [(label, list(pairs) if pairs else None) for label, pairs in choices])
    try:
        move.save()
    except OSError as exc:
        raise GpusnapError(f"cannot record the move of {name} ({exc.strerror}); nothing was "
                           "changed", f"free space under {journal.state_dir()}, then move again") \
            from None
    return move


def step(move: Move, phase: str) -> None:
    """``advance`` on the way there: a step the record cannot say is not taken."""
    try:
        move.advance(phase)
    except OSError as exc:
        raise GpusnapError(f"cannot record the move's progress under {journal.state_dir()} "
                           f"({exc.strerror})",
                           f"free space under {journal.state_dir()}, then move again") from None


def refuse(init_pid: int, name: str, verb: str, holding_turn: bool = True) -> None:
    """One line where a move of this container was cut off: until its undo, only
    its record knows which GPUs the processes belong on (and a second move
    would write over it). ``holding_turn``: the caller holds the container's
    turn, so no move is at work; else a record whose turn is held is a move
    still at work, which doctor would leave alone."""
    if not any(m.init_pid == init_pid for m in under_way()):
        return
    if not holding_turn and _at_work(init_pid):
        raise GpusnapError(f"{name} is being moved (`gpusnap move`), so it cannot {verb} now; "
                           "nothing was changed", "run it again once the move is done")
    raise GpusnapError(f"a move of {name} was cut off and is not undone yet, so it cannot "
                       f"{verb}; nothing was changed",
                       "`gpusnap doctor --fix` puts it back on its old GPUs")


def _at_work(init_pid: int) -> bool:
    """Whether someone holds the container's turn now (a move holds it throughout)."""
    try:
        held = turn.try_take(init_pid, "check")
    except OSError:  # a state folder this process cannot use: no word either way
        return False
    if held is None:
        return True
    held.release()
    return False


def end(init_pid: int) -> None:
    _path(init_pid).unlink(missing_ok=True)


def under_way() -> list[Move]:
    """Recorded moves whose container still runs (its init, the same start time):
    cut off, or at work where their container's turn is held."""
    found = []
    for record in sorted(_folder().glob("*.json")):
        try:
            move = Move.from_dict(json.loads(record.read_text()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue
        if move.init_start is not None and start_time(move.init_pid) == move.init_start:
            found.append(move)
    return found


def moving() -> dict[int, str]:
    """pid -> the container a recorded move took it off its GPU in: only that
    move's undo brings it back (onto the GPUs its container's nodes name)."""
    return {pid: m.container for m in under_way() for pid in m.running()}


def undo_recorded(move: Move, driver: Driver) -> None:
    """``put_back`` for a move whose process is gone (`gpusnap doctor --fix`)."""
    live = LiveDevices.recorded(move.devices)
    try:
        put_back(move, live, driver)
    finally:
        live.close()


def put_back(move: Move, live: LiveDevices, driver: Driver) -> None:
    """Undo ``move`` from wherever it got to: the processes restored onto the new
    GPUs checkpointed again, the old nodes and rule put back, every process
    resumed on its old GPUs; the record removed once done. BackError (the
    record kept) where a step failed."""
    pids = move.running()
    if move.phase == DEVICES:
        _off_new(move, driver, pids)
        try:
            live.undo()
        except Exception as exc:  # noqa: BLE001 -- any failure: doctor finishes it
            raise BackError(f"the old GPU nodes and device rule could not be put back ({exc})") \
                from exc
        move.note(UNDONE)
    _resume_old(move, driver, pids)
    end(move.init_pid)


def _off_new(move: Move, driver: Driver, pids: list[int]) -> None:
    """Checkpoint again the processes a resume restored onto the new GPUs: the
    old nodes would leave them there, split from the rest."""
    now = states(driver, pids)
    on_new = sorted(set(move.on_new) | {p for p, s in now.items() if s != ProcessState.CHECKPOINTED})
    move.note(DEVICES, on_new)  # first: a cut meanwhile still knows which were on the new GPUs
    try:
        quiesce(driver, on_new)
    except QuiesceError as exc:
        raise BackError(f"process(es) restored onto the new GPUs could not be checkpointed "
                        f"again ({exc})") from exc


def _resume_old(move: Move, driver: Driver, pids: list[int]) -> None:
    """Every process back to RUNNING on its old GPUs: those checkpointed on the
    new ones with the pairs back, the others as they were checkpointed."""
    now = states(driver, pids)
    from_new = [p for p in move.on_new if now.get(p) == ProcessState.CHECKPOINTED]
    try:
        if from_new:  # which pairs the driver took back: for the record, as a move's way there
            label, _, refused = resume_onto(driver, from_new, move.back_choices())
            journal.record("move-resumed-back", container=move.container, pids=from_new,
                           gpu_pairs=label, failed_first=refused)
        resume(driver, [p for p in pids if p not in from_new])
    except QuiesceError as exc:
        raise BackError(f"the processes could not be resumed on their old GPUs ({exc})") from exc
