"""Quiesce and resume a set of CUDA processes: parallel and transactional.

Quiesce locks every process first (so no process of the container issues new
GPU work while another is being copied out), then checkpoints them all in
parallel, one thread each: the driver's copy is per process, so N processes on
N GPUs take about as long as the largest one. If any step fails, what was done
is undone (restore + unlock) before the error is raised: the container keeps
running on its GPUs. A call left in flight at its bound (a wedged driver) may
still land: the rollback waits for it a while longer (DRIVER_LATE) and puts
that process back too, or says what to do should it land later.
"""

from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Iterable, Protocol

from gpusnap.errors import GpusnapError
from gpusnap.gpu import staging
from gpusnap.gpu.cuda import CudaDriver, CudaError, ProcessState
from gpusnap.gpu.inventory import Inventory, mps_active
from gpusnap.procs import ProcessGpuUse
from gpusnap.waits import Bound, WaitExpired

# A restore refused with these is refused for good on driver 580: once it answered
# OUT_OF_MEMORY, every later restore of that process answers OPERATING_SYSTEM,
# however much memory is free (H200, 2026-11-30; docs/reliability.md)
_REFUSED_FOR_GOOD = re.compile(r"cuCheckpointProcessRestore\(pid \d+\) failed: "
                               r"CUDA_ERROR_(OPERATING_SYSTEM|OUT_OF_MEMORY)\b")


def refused_for_good(said: str) -> bool:
    """Whether the driver's words (a QuiesceError's) hold a restore refused for good."""
    return bool(_REFUSED_FOR_GOOD.search(said))


# How long the driver waits for a process's CUDA work to finish before its lock
# fails: the checkpoint, freeze and move verbs take it as --lock-timeout/--timeout.
DEFAULT_LOCK_TIMEOUT_MS = 10_000


class Driver(Protocol):
    def state(self, pid: int) -> ProcessState: ...
    def lock(self, pid: int, timeout_ms: int) -> None: ...
    def checkpoint(self, pid: int) -> None: ...
    def restore(self, pid: int, gpu_pairs: list[tuple[str, str]] | None = None) -> None: ...
    def unlock(self, pid: int) -> None: ...
    def landed(self, pid: int, seconds: float) -> bool: ...


@dataclass
class Timing:
    """Wall-clock seconds of each phase, for progress output and benchmarks."""

    phases: dict[str, float] = field(default_factory=dict)

    def add(self, phase: str, seconds: float) -> None:
        self.phases[phase] = round(self.phases.get(phase, 0.0) + seconds, 4)


class QuiesceError(Exception):
    """Some processes could not be quiesced or resumed; ``failures`` maps pid -> error."""

    def __init__(self, action: str, failures: dict[int, BaseException],
                 rollback_failures: dict[int, BaseException] | None = None) -> None:
        self.action = action
        self.failures = failures
        self.rollback_failures = rollback_failures or {}
        parts = [f"pid {pid}: {err}" for pid, err in sorted(failures.items())]
        msg = f"{action} failed for {len(failures)} process(es): " + "; ".join(parts)
        if self.rollback_failures:
            msg += " -- and could not undo for " + "; ".join(
                f"pid {pid}: {err}" for pid, err in sorted(self.rollback_failures.items()))
        super().__init__(msg)


def _parallel(pids: list[int], fn: Callable[[int], None]) -> dict[int, BaseException]:
    """Run fn(pid) for every pid at once; return the failures."""
    if not pids:
        return {}
    failures: dict[int, BaseException] = {}
    with ThreadPoolExecutor(max_workers=len(pids), thread_name_prefix="gpusnap") as pool:
        futures = {pid: pool.submit(fn, pid) for pid in pids}
        for pid, fut in futures.items():
            exc = fut.exception()
            if exc is not None:
                failures[pid] = exc
    return failures


def _timed(timing: Timing, phase: str, pids: list[int], fn: Callable[[int], None]) -> dict[int, BaseException]:
    start = time.monotonic()
    try:
        return _parallel(pids, fn)
    finally:
        timing.add(phase, time.monotonic() - start)


def states(driver: Driver, pids: Iterable[int]) -> dict[int, ProcessState]:
    """Driver state of each pid; pids the driver does not manage are left out.

    A process can map libcuda without ever creating a context (a shell that
    exec'd a CUDA program, a helper that dlopen'ed it): the driver answers
    with an error, and such a process has no GPU state to move. A question the
    driver could not answer (a stopped process, a bound run out) is raised.
    """
    return answers(driver, pids)[0]


def answers(driver: Driver, pids: Iterable[int]) -> tuple[dict[int, ProcessState], dict[int, str]]:
    """``states``, plus the driver's error for each pid it did not answer for:
    after a restore, where it should answer for every process it checkpointed,
    an error is what to wait out or report, not a process to pass over."""
    found, errors = {}, {}
    for pid in pids:
        try:
            found[pid] = driver.state(pid)
        except CudaError as exc:
            errors[pid] = exc.name
    return found, errors


def refuse_unsupported(procs: list[ProcessGpuUse], inventory: Inventory) -> None:
    """Refuse what the driver cannot checkpoint at all: a GPU in MIG mode, MPS clients;
    and GPUs NVML did not answer about, which the manifest would record as none."""
    if procs and inventory.unanswered:
        raise GpusnapError(f"cannot read the GPUs of {len(procs)} CUDA process(es): "
                           f"{inventory.error}; nothing was quiesced",
                           "check the GPUs (`nvidia-smi`), then checkpoint again")
    used = {m for p in procs for m in p.gpu_minors}
    mig = [g for g in inventory.gpus if g.minor in used and g.mig_enabled]
    if mig:
        raise GpusnapError(f"GPU {mig[0].index} ({mig[0].uuid}) is in MIG mode, which the "
                           "driver cannot checkpoint", "run the container on a GPU without MIG")
    if mps_active():
        raise GpusnapError("an MPS daemon is running: the driver cannot checkpoint MPS clients",
                           "stop MPS (echo quit | nvidia-cuda-mps-control) before checkpointing")


def refuse_unmanaged(driver: Driver, procs: list[ProcessGpuUse]) -> None:
    """Refuse, before anything is quiesced, a tree with processes that hold the
    driver's files or mappings but that the driver does not manage.

    A child forked from a CUDA process inherits its /dev/nvidia* fds and
    mappings, and the driver answers CUDA_ERROR_NOT_INITIALIZED for it (driver
    580): it cannot checkpoint it, and CRIU can dump neither. torch.compile's
    compile workers are such children, and so are DataLoader workers forked
    after CUDA started. An NVML-only or cuInit-only process is managed.
    """
    managed = states(driver, [p.pid for p in procs])
    outside = [p for p in procs if p.holds_driver and p.pid not in managed]
    if not outside:
        return
    pids = [str(p.pid) for p in outside]
    comms = ", ".join(sorted({p.comm for p in outside}))
    if len(pids) == 1:
        who, verb, own, them = f"process {pids[0]} ({comms})", "holds", "its", "it"
    else:
        more = " and more" if len(pids) > 3 else ""
        who = f"{len(pids)} processes ({', '.join(pids[:3])}{more}; {comms})"
        verb, own, them = "hold", "their", "them"
    raise GpusnapError(
        f"{who} {verb} the GPU driver's files without a CUDA context of {own} own, as a "
        f"child forked from a CUDA process does: the driver cannot checkpoint {them} and "
        "CRIU cannot dump those files; nothing was quiesced",
        "end such processes before the checkpoint: after torch.compile, call "
        "torch._inductor.async_compile.shutdown_compile_workers() (or set "
        "TORCHINDUCTOR_COMPILE_THREADS=1); give a DataLoader multiprocessing_context='spawn'")


def quiesce(driver: Driver, pids: list[int], lock_timeout_ms: int = DEFAULT_LOCK_TIMEOUT_MS,
            timing: Timing | None = None) -> list[int]:
    """Move every process to CHECKPOINTED (GPU memory in host memory, GPU released).

    Returns the pids this call changed (already checkpointed ones are left as
    they are). Raises QuiesceError after rolling back on any failure.
    """
    timing = timing or Timing()
    before = states(driver, pids)
    to_lock = [p for p, s in before.items() if s == ProcessState.RUNNING]
    to_checkpoint = [p for p, s in before.items() if s in (ProcessState.RUNNING, ProcessState.LOCKED)]
    failed = [p for p, s in before.items() if s == ProcessState.FAILED]
    if failed:
        raise QuiesceError("checkpoint", {p: RuntimeError("the driver reports this process FAILED")
                                          for p in failed})

    try:
        failures = _timed(timing, "lock", to_lock, lambda pid: driver.lock(pid, lock_timeout_ms))
        if failures:
            locked = [p for p in to_lock if p not in failures]
            undo = _parallel(locked, driver.unlock)
            undo.update(_undo_late(driver, failures))
            raise QuiesceError("lock", failures, undo)

        failures = _timed(timing, "checkpoint", to_checkpoint, driver.checkpoint)
        if failures:
            undo = _rollback(driver, [p for p in to_checkpoint if p not in _late(failures)])
            undo.update(_undo_late(driver, failures))
            raise QuiesceError("checkpoint", failures, undo)
    except KeyboardInterrupt:
        # the calls in flight were waited out (the pool's exit): back as they were,
        # not left LOCKED or CHECKPOINTED for doctor to find
        _rollback(driver, to_checkpoint)
        raise
    return to_checkpoint


def _rollback(driver: Driver, pids: list[int]) -> dict[int, BaseException]:
    """Bring processes back to RUNNING whatever step they stopped at."""
    return _parallel(pids, lambda pid: _to_running(driver, pid, None))


def _late(failures: dict[int, BaseException]) -> list[int]:
    """The pids whose driver call was left in flight at its bound: it may still land."""
    return [pid for pid, exc in failures.items() if isinstance(exc, WaitExpired)]


def _undo_late(driver: Driver, failures: dict[int, BaseException]) -> dict[int, BaseException]:
    """Each process whose call was left at its bound, put back once that call
    lands, all waited for at once within DRIVER_LATE: a lock landing after the
    rollback would leave its process LOCKED, and no guardian starts after a
    quiesce that failed. ``failures`` then says of each that it was put back;
    returned: those whose call did not land, with what to do should it."""
    late = _late(failures)
    if not late:
        return {}
    bound = Bound.of("DRIVER_LATE")
    deadline = time.monotonic() + bound.seconds

    def back(pid: int) -> None:
        if not driver.landed(pid, max(0.0, deadline - time.monotonic())):
            raise RuntimeError(
                f"the call had not answered {bound.seconds:.0f} s later either: should it "
                "still, the process stays off its GPU until `gpusnap doctor --fix` gives it "
                "back")
        _to_running(driver, pid, None)
    undo = _parallel(late, back)
    for pid in late:
        if pid not in undo:
            failures[pid] = RuntimeError(f"{failures[pid]}; the call answered later, and the "
                                         "process was put back")
    return undo


def _to_running(driver: Driver, pid: int, gpu_pairs: list[tuple[str, str]] | None) -> None:
    state = driver.state(pid)
    if state == ProcessState.CHECKPOINTED:
        driver.restore(pid, gpu_pairs)
        state = ProcessState.LOCKED
    if state == ProcessState.LOCKED:
        driver.unlock(pid)


def resume(driver: Driver, pids: list[int], gpu_pairs: list[tuple[str, str]] | None = None,
           timing: Timing | None = None) -> list[int]:
    """Bring every process back to RUNNING on its GPUs (restore, then unlock).

    All processes are restored before any is unlocked, so the container's
    processes start issuing GPU work again together. Returns the pids changed.
    """
    timing = timing or Timing()
    before = states(driver, pids)
    to_restore = [p for p, s in before.items() if s == ProcessState.CHECKPOINTED]
    to_unlock = [p for p, s in before.items() if s in (ProcessState.CHECKPOINTED, ProcessState.LOCKED)]
    _refuse_empty_staging(to_restore)
    failures = _timed(timing, "restore", to_restore, lambda pid: driver.restore(pid, gpu_pairs))
    if failures:
        raise QuiesceError("restore", failures)
    failures = _timed(timing, "unlock", to_unlock, driver.unlock)
    if failures:
        raise QuiesceError("unlock", failures)
    return to_unlock


def _refuse_empty_staging(pids: list[int]) -> None:
    """The driver would bring back whatever its staging holds: zeros, where a
    restore's post-resume did not put it back (gpu/staging.py)."""
    empty = [pid for pid in pids if staging.held(pid) is not None]
    if empty:
        raise QuiesceError("restore", {pid: RuntimeError(
            "its GPU memory is not back in host memory (the restore's post-resume step did not "
            "map it from the checkpoint); restore the checkpoint again") for pid in empty})


def resume_onto(driver: Driver, pids: list[int],
                choices: list[tuple[str, list[tuple[str, str]] | None]],
                timing: Timing | None = None) -> tuple[str, list[int], list[str]]:
    """Resume with the first GPU pair choice the driver takes (Plan.pair_choices).

    A refused restore leaves the processes CHECKPOINTED, so the next choice can
    be tried. Returns (the choice taken, pids changed, what was refused first).
    """
    _refuse_empty_staging(pids)  # once, not for every choice
    refused: dict[str, QuiesceError] = {}
    for label, pairs in choices:
        try:
            return label, resume(driver, pids, pairs, timing), [
                f"{was}: {exc}" for was, exc in refused.items()]
        except QuiesceError as exc:
            refused[label] = exc
    if len(refused) == 1:  # one choice: its own words, not wrapped in a second "failed for"
        raise next(iter(refused.values()))
    failed = sorted({pid for exc in refused.values() for pid in exc.failures})
    raise QuiesceError("restore", {pid: RuntimeError("; ".join(
        f"{label}: {exc.failures[pid]}" for label, exc in refused.items() if pid in exc.failures))
        for pid in failed})


@dataclass
class Answers:
    """What the driver answered about a restored tree (restored_answers)."""

    pids: list[int]  # its CUDA processes, as last seen
    waited: float  # seconds spent asking again, 0.0 where it answered at once
    unanswered: dict[int, str]  # the driver's errors seen first, where it had to ask again
    short: str | None = None  # where the bound ran out: what is missing, in words
    missing: list[int] = field(default_factory=list)  # then: those the driver did not answer for


def restored_answers(driver: Driver, find: Callable[[], list[int]], expected: int,
                     sleep: Callable[[float], None] = time.sleep) -> Answers:
    """The restored processes (``find``'s pids), once the driver answers for at
    least ``expected`` of them, the number the checkpoint holds GPU memory of.

    One restore on an H200 (driver 580) left its process CHECKPOINTED behind a
    post-resume that found nothing to resume: either the process or the driver's
    answer for it was not there yet, and one passed over, as a dump passes over a
    process without a context, stays off its GPU with nobody told. So the
    answers are waited for, within RESUME_SETTLE; where they never come, the
    processes that did answer are still the caller's to resume (``short``
    says what is missing): one that exited meanwhile must not hold back the
    rest."""
    bound = Bound.of("RESUME_SETTLE")
    start = time.monotonic()
    first: dict[int, str] = {}
    tries = 0
    while True:
        pids = find()
        found, errors = answers(driver, pids)
        first = first or errors
        waited = time.monotonic() - start
        if len(found) >= expected:  # answered at once: nothing was waited for
            return Answers(pids, round(waited, 3) if tries else 0.0, first)
        if waited > bound.seconds:
            said = "; ".join(f"pid {p}: {e}" for p, e in sorted(errors.items())) if errors \
                else f"{expected - len(found)} of them gone from the restored tree"
            return Answers(pids, round(waited, 3), first, (
                f"the checkpoint holds GPU memory of {expected} process(es), but after "
                f"{waited:.0f} s the NVIDIA driver answers for {len(found)} of the "
                f"{len(pids)} restored ones ({said})"), sorted(errors))
        sleep(0.05)
        tries += 1


def require_driver() -> Driver:
    """The CUDA driver, loaded (libcuda) only here, where there are CUDA processes."""
    try:
        return CudaDriver()
    except RuntimeError as exc:
        raise GpusnapError(str(exc), "install NVIDIA driver r570 or newer") from exc
