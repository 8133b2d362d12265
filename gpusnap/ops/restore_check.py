"""The restored container's GPU processes, checked before a restore says it is done.

CRIU only logs a post-resume step that failed, so Podman (or the containerd
shim) counts such a restore as done while its processes wait CHECKPOINTED,
off their GPU. The check here resumes what the step left (under the
container's turn, onto the plan's GPUs) and says in words what it cannot:
on driver 580 a process whose restore the driver once refused for lack of GPU
memory is refused for good (CUDA_ERROR_OPERATING_SYSTEM, however much is free
later; docs/reliability.md), and only its checkpoint can bring the job back.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable

from gpusnap import journal
from gpusnap.errors import GpusnapError
from gpusnap.gpu.cuda import DriverAhead
from gpusnap.gpu.plan import Plan
from gpusnap.gpu.quiesce import Driver, QuiesceError, refused_for_good
from gpusnap.ops.gpu_state import bring_back, load_driver
from gpusnap.procs import age_s, cuda_processes

DOCTOR = "`gpusnap doctor --fix` brings them back onto the GPU"


class OffTheGpu(GpusnapError):
    """Restored processes whose GPU state the driver refused for good: their
    container cannot run on; the caller says what of the checkpoint is left."""

    def __init__(self, pids: list[int], first: str | None, again: str) -> None:
        self.pids = pids
        said = f"post-resume: {driver_words(first)}; tried again: {again}" if first else again
        super().__init__(f"the NVIDIA driver did not bring back the GPU state of restored "
                         f"process(es) {', '.join(map(str, pids))} ({said})",
                         "restore the checkpoint again once the GPU has the memory free")


def driver_words(text: str) -> str:
    """The driver's own failures in a QuiesceError's text, each once, without the
    layers each GPU-pair choice tried wraps around them."""
    calls = re.findall(r"cuCheckpointProcess\w+\(pid \d+\) failed: \S+ \(\d+\)", text)
    return "; ".join(dict.fromkeys(calls)) or text


def _post_resume_failed(rec: dict) -> bool:
    return rec.get("event") == "failed" and rec.get("action") == "post-resume"


def _left_uncopied(rec: dict) -> bool:
    """post-resume left a range of a pages file mapped and could not copy it
    (remote_map.let_go): a later change of that file would show through."""
    return rec.get("event") == "staging-left-mapped" and not rec.get("copied")


def post_resume_failure(init_pid: int) -> dict:
    """The journal's record of this restore's post-resume step failing, or {}."""
    return _journaled(init_pid, _post_resume_failed)


def staging_in_doubt(init_pid: int) -> bool:
    """Whether a process of this restore may still map a pages file (the opt-in
    staging mapping): its post-resume failed before the copy of what the driver
    left mapped, or the copy failed. One read of the journal."""
    return bool(_journaled(init_pid, lambda r: _post_resume_failed(r) or _left_uncopied(r)))


def _journaled(init_pid: int, matches: Callable[[dict], bool]) -> dict:
    """The journal's latest record of this restore that ``matches``, or {}: only
    records since ``init_pid`` (restored by this restore) began, so no earlier
    restore's whose init had the same pid."""
    age = age_s(init_pid)
    since = time.time() - age - 1.0 if age is not None else 0.0
    for rec in reversed(journal.read(100)):
        if matches(rec) and str(rec.get("init_pid")) == str(init_pid) \
                and rec.get("at", 0) >= since:
            return rec
    return {}


def gpu_report(pid: int, ahead: DriverAhead | None = None, plan: Plan | None = None) -> list[dict]:
    """The CUDA processes of the container whose init is ``pid`` and their driver
    states, any post-resume left off the GPU resumed first (gpu_state.bring_back).
    Raises OffTheGpu where the driver refuses them for good, GpusnapError where
    one is still not running or a failed post-resume cannot be checked."""
    procs = cuda_processes(pid)
    if not procs:
        return []
    driver = (ahead.get() if ahead else None) or load_driver()
    report = [_entry(driver, p.pid, p.comm) for p in procs]
    if all(e["state"] == "RUNNING" for e in report):
        return report  # the common case: no journal to read on a replica's path
    failed = post_resume_failure(pid)
    left = [e["pid"] for e in report if e["state"] in ("CHECKPOINTED", "LOCKED")]
    if left and driver is not None:
        try:
            resumed = bring_back(left, driver, plan.pair_choices() if plan else [("none", None)])
        except QuiesceError as exc:
            again = driver_words(str(exc))
            if refused_for_good(again):
                raise OffTheGpu(left, failed.get("error"), again) from None
            raise GpusnapError(f"restored, but the driver did not resume process(es) "
                               f"{', '.join(map(str, left))} ({again})", DOCTOR) from None
        report = [{**_entry(driver, e["pid"], e["comm"]), "resumed_late": True}
                  if e["pid"] in (resumed or []) else e for e in report]
    unanswered = set(failed.get("pids") or [])  # those post-resume waited for in vain
    for e in report:
        if e["state"] == "unknown" and failed and (driver is None or e["pid"] in unanswered):
            raise GpusnapError(f"restored, but its post-resume step failed "
                               f"({driver_words(failed.get('error') or '')}) and the driver does "
                               f"not answer about process {e['pid']} ({e.get('error')})", DOCTOR)
        if e["state"] not in ("RUNNING", "unknown"):
            raise GpusnapError(f"restored, but process {e['pid']} ({e['comm']}) is {e['state']} "
                               "on the GPU", DOCTOR)
    return report


def _entry(driver: Driver | None, pid: int, comm: str) -> dict:
    state, why = None, "no CUDA driver"
    if driver is not None:
        try:
            state = driver.state(pid)
        except Exception as exc:  # noqa: BLE001 -- reported, not fatal: it was restored
            why = str(exc)
    entry = {"pid": pid, "comm": comm, "state": state.name if state is not None else "unknown"}
    if state is None:
        entry["error"] = why
    return entry
