"""Live move: a running container's CUDA processes onto other GPUs of this host, no CRIU.

discover (the container, its CUDA processes, this host's GPUs) -> plan (the
same planner and checks as a restore) -> act (quiesce: GPU memory to host
memory; swap the container's GPU nodes and device cgroup rule; driver restore
onto the new GPUs) -> record. The processes keep their pids throughout. Any
failure after the quiesce puts the nodes and the rule back and resumes the
processes on their old GPUs; a move killed on the way is undone the same way
by `gpusnap doctor --fix`, from the record it writes first (ops/moving.py).
"""

from __future__ import annotations

import json
import time
from typing import NoReturn

from gpusnap import journal
from gpusnap.criu.version import criu_version
from gpusnap.errors import GpusnapError
from gpusnap.gpu import manifest as gpu_manifest
from gpusnap.gpu.inventory import read_inventory
from gpusnap.gpu.quiesce import Driver, QuiesceError, Timing, quiesce, resume_onto
from gpusnap.oci.spec import SpecError, rewrite_spec
from gpusnap.ops import moving
from gpusnap.ops.freeze import gpu_turn
from gpusnap.ops.gpu_plan import plan_here
from gpusnap.runtime import podman
from gpusnap.runtime.livedev import LiveDevices, ctrl_c_held, plan_live


def gpu_map_for(index: int | None, gpu_map: str | None, used: list[dict]) -> str:
    """--gpu N is --gpu-map SRC=N for a container on one GPU."""
    if gpu_map:
        if index is not None:
            raise GpusnapError("give --gpu or --gpu-map, not both")
        return gpu_map
    if index is None:
        raise GpusnapError("say where to: --gpu N (or --gpu-map SRC=DST,...)")
    if len(used) != 1:
        raise GpusnapError(f"the container uses {len(used)} GPUs; --gpu names one",
                           "say where each goes with --gpu-map SRC=DST,...")
    return f"{used[0]['index']}={index}"


def move(name: str, index: int | None, gpu_map: str | None, lock_timeout_ms: int,
         dry_run: bool = False) -> dict:
    # a checkpoint's guardian still giving the GPUs back would plan on the wrong memory
    with gpu_turn(name, "be moved", "move") as (ctr, procs, driver):
        return _move(ctr, procs, driver, index, gpu_map, lock_timeout_ms, dry_run)


def _move(ctr: podman.Container, procs: list, driver: Driver, index: int | None,
          gpu_map: str | None, lock_timeout_ms: int, dry_run: bool) -> dict:
    manifest = gpu_manifest.build(procs, read_inventory(), criu_version(), "gpusnap")
    plan = plan_here(manifest, gpu_map_for(index, gpu_map, manifest.gpus),
                     refusal_hint="`gpusnap gpus` lists this host's GPUs; nothing was changed")
    if not plan.needs_remap:
        raise GpusnapError(f"{ctr.name} is on those GPUs already; nothing was changed")
    spec = json.loads((ctr.userdata / "config.json").read_text())
    try:
        rewrite_spec(spec, plan.remap)  # the same checks a restore's spec passes
    except SpecError as exc:
        raise GpusnapError(f"cannot move {ctr.name}'s devices: {exc}; nothing was changed") from None
    live = plan_live(ctr.pid, spec, plan.remap)
    report = {"container": ctr.name, "moves": plan.describe(), "plan": plan.to_dict()}
    if dry_run:
        return {**report, "dry_run": True}
    pids = [p.pid for p in procs]
    timing = Timing()
    start = time.monotonic()
    label, refused = _act(ctr, pids, driver, live, plan.pair_choices(), lock_timeout_ms, timing)
    seconds = time.monotonic() - start
    journal.record("moved", container=ctr.id, pids=pids, moves=plan.describe(), gpu_pairs=label,
                   failed_first=refused, timing=timing.phases, seconds=round(seconds, 3))
    return {**report, "pids": pids, "gpu_pairs": label, "timing": timing.phases,
            "seconds": round(seconds, 3)}


def _act(ctr: podman.Container, pids: list[int], driver: Driver, live: LiveDevices,
         choices: list, lock_timeout_ms: int, timing: Timing) -> tuple[str, list[str]]:
    """Quiesce, change the devices, resume onto the new GPUs: (the pair choice
    the driver took, what it refused first). Undone on any failure."""
    # before anything changes: a move killed anywhere is undone from it (doctor --fix)
    record = moving.begin(ctr.pid, ctr.name, pids, live, choices)
    try:
        quiesce(driver, pids, lock_timeout_ms, timing)
    except BaseException as exc:
        moving.end(ctr.pid)  # the nodes untouched; the driver's state rolled back (else doctor's)
        if isinstance(exc, QuiesceError):
            raise GpusnapError(f"could not stop {ctr.name}'s GPU work, nothing was changed: {exc}",
                               "a process may be in a long kernel; retry with a longer --timeout") \
                from None
        raise
    try:
        moving.step(record, moving.DEVICES)
        live.apply()
        label, _, refused = resume_onto(driver, pids, choices, timing)
    except BaseException as exc:  # Ctrl-C included: never leave the container off its GPU
        _back(ctr.name, record, live, driver, exc)
    finally:
        live.close()
    moving.end(ctr.pid)
    return label, refused


def _back(name: str, record: moving.Move, live: LiveDevices, driver: Driver,
          exc: BaseException) -> NoReturn:
    """Undo a half-done move (moving.put_back): the processes off the new GPUs,
    the old nodes and rule, the processes resumed on their old GPUs."""
    try:
        with ctrl_c_held():  # a Ctrl-C now would leave it half put back: after, it is said
            moving.put_back(record, live, driver)
    except KeyboardInterrupt as stopped:  # held until the undo was done
        exc = stopped
    except Exception as undo_exc:  # noqa: BLE001 -- both reported; the record is kept for doctor
        journal.record("move-undo-failed", container=name, error=str(exc), undo=str(undo_exc))
        raise GpusnapError(f"moving {name} failed ({exc}), and putting it back did not finish: "
                           f"{undo_exc}", "`gpusnap doctor --fix` puts it back on its old GPUs") \
            from None
    journal.record("move-undone", container=name, error=str(exc))
    if isinstance(exc, KeyboardInterrupt):
        raise exc
    said, hint = str(exc), "`gpusnap gpus` shows the target's free memory"
    if isinstance(exc, GpusnapError) and exc.hint:  # its own advice, said once
        said, hint = exc.message, exc.hint
    raise GpusnapError(f"moving {name} failed, it runs on its old GPUs again: {said}", hint) \
        from None
