"""A containerd task's GPU quiesced before gpusnap's client pauses it.

containerd's client pauses a task, diffs its read-write layer, then asks the
shim to checkpoint. The driver's lock needs the CUDA processes running, so
for ctr and nerdctl the shim thaws a paused CUDA task for the dump, and what
the task writes in that window (seconds at GBs of GPU memory) is in CRIU's
images but not in the rw layer. gpusnap's own client quiesces the CUDA
processes first, building the GPU manifest while they still hold their GPUs,
and leaves it in a request keyed by the task's pid (requests.QUIESCED): the
shim then keeps the task paused from the diff to the end of the dump, and
the action script writes that manifest instead of quiescing.

Whatever happens to the dump, the processes that survive it get their GPUs
back once the client has resumed the task. A guardian watching this process
does it if the client is killed first: it waits for a dump in flight (CRIU
traces the processes), thaws a task left paused (the shim's Resume accepts
such a task later) and drops the request. A push's read-ahead of GPU memory
(Podman's path) has no part here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

from gpusnap import journal, requests
from gpusnap.criu.freezer import is_frozen
from gpusnap.errors import GpusnapError
from gpusnap.criu.version import criu_version, cuda_plugin_path
from gpusnap.gpu import manifest as gpu_manifest
from gpusnap.gpu.inventory import read_inventory
from gpusnap.gpu.quiesce import (DEFAULT_LOCK_TIMEOUT_MS, Driver, QuiesceError, Timing, quiesce,
                                  refuse_unmanaged, refuse_unsupported, require_driver, resume)
from gpusnap.gpu.turn import Turn, wait_turn
from gpusnap.ops.containerd_api import ContainerdError
from gpusnap.procs import cuda_processes, start_time


@dataclass
class Quiesced:
    """The CUDA processes of one task, quiesced by the client."""

    init_pid: int
    started: dict[int, int | None]  # the ones this quiesce changed, by start time: to give back
    driver: Driver
    manifest: dict
    all_pids: list[int] = field(default_factory=list)  # every CUDA process, changed or not
    guardian: subprocess.Popen | None = None
    turn: Turn | None = None  # held until the GPUs are back, by the guardian where there is one

    @property
    def pids(self) -> list[int]:
        return list(self.started)

    def ask(self) -> None:
        """The request the shim and pre-dump read; again before each try (pre-dump takes it)."""
        requests.put_bound(self.init_pid, requests.QUIESCED, manifest=self.manifest,
                           pids=self.pids)

    def seen(self) -> None:
        """After a dump: pre-dump took the request, so the images hold the manifest
        built here. Left untaken, pre-dump read another state folder
        (GPUSNAP_STATE_DIR) and the dump went on without it."""
        if requests.peek(self.init_pid, requests.QUIESCED):  # not bound(): the init may be gone
            raise ContainerdError("the CRIU action script did not see gpusnap's quiesce "
                                  "(GPUSNAP_STATE_DIR differs between this command and "
                                  "runc's?): the checkpoint lacks its GPU manifest")


@contextmanager
def quiesced_first(init_pid: int, lock_timeout_ms: int = DEFAULT_LOCK_TIMEOUT_MS
                   ) -> Iterator[Quiesced | None]:
    """The task's CUDA processes quiesced for the block; None where there are
    none, or where CRIU's cuda_plugin quiesces them itself during the dump.
    The block calls ``ask()`` before each dump and ``seen()`` after it.
    A guardian still giving back the GPUs of an earlier checkpoint is waited
    for first (gpu/turn.py)."""
    turn = wait_turn(init_pid, f"checkpoint of the task whose init is pid {init_pid}",
                     "containerd client")
    try:
        q = _quiesce(init_pid, lock_timeout_ms)
    except BaseException:
        turn.release()
        raise
    if q is None:
        turn.release()  # nothing asked of pre-dump, which then takes the turn itself
        yield None
        return
    with turn:  # held to the end: pre-dump, asked by the block, does not wait for it
        q.turn = turn
        try:  # from here on, whatever fails gives the GPUs back
            q.guardian = _guardian(q)
            journal.record("quiesced", init_pid=init_pid, pids=q.all_pids, by="gpusnap",
                           before="the client's pause", timing=q.manifest.get("timing"),
                           at=round(time.time(), 3))
            yield q
        except BaseException:
            _give_back(q, quiet=True)  # the dump's own failure is what the caller must see
            raise
        _give_back(q, quiet=False)


def _quiesce(init_pid: int, lock_timeout_ms: int) -> Quiesced | None:
    procs = cuda_processes(init_pid)
    if not procs or cuda_plugin_path():
        return None
    inventory = read_inventory()
    refuse_unsupported(procs, inventory)
    manifest = gpu_manifest.build(procs, inventory, criu_version(), "gpusnap")
    driver = require_driver()
    refuse_unmanaged(driver, procs)
    timing = Timing()
    try:
        changed = quiesce(driver, [p.pid for p in procs], lock_timeout_ms, timing)
    except QuiesceError as exc:  # rolled back: the task runs on, on its GPUs
        raise ContainerdError(f"GPU quiesce failed: {exc}; the task runs on") from None
    manifest.timing = timing.phases
    return Quiesced(init_pid, {pid: start_time(pid) for pid in changed}, driver,
                    json.loads(manifest.to_json()), all_pids=[p.pid for p in procs])


def _guardian(q: Quiesced) -> subprocess.Popen | None:
    """The action script's guardian, watching this process instead of CRIU: it
    waits for a dump in flight, drops the request and gives the GPUs back."""
    if not q.pids:
        return None
    turn = ["--turn-fd", str(q.turn.fd)] if q.turn is not None else []
    guardian = subprocess.Popen(
        [sys.executable, "-m", "gpusnap.action.guardian", str(os.getpid()), *map(str, q.pids),
         "--init", str(q.init_pid), "--drop-request", *turn],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True, close_fds=True, pass_fds=(q.turn.fd,) if turn else ())
    if q.turn is not None:
        q.turn.hand_over()
    return guardian


def _give_back(q: Quiesced, quiet: bool) -> None:
    """The surviving processes' GPUs back (restore + unlock); the guardian
    stops once that is done, and stays for this process's exit otherwise."""
    requests.drop(q.init_pid, requests.QUIESCED)
    # with exit_after CRIU killed them: their pids may be reused already
    living = [p for p, born in q.started.items() if born is not None and start_time(p) == born]
    if any(is_frozen(p) for p in living):  # the client's Resume failed: a restore would wait
        journal.record("resume-deferred", init_pid=q.init_pid, pids=living,
                       why="the task is still paused")
        if quiet:
            return
        raise ContainerdError("the task stayed paused after its checkpoint, its GPU quiesced: "
                              "gpusnap's guardian resumes it and gives the GPU back once this "
                              "command has ended")
    try:
        changed = resume(q.driver, living)
    except (QuiesceError, GpusnapError) as exc:  # a driver without answer, a process stopped
        journal.record("resume-failed", init_pid=q.init_pid, pids=living, error=str(exc))
        if quiet:
            return
        raise ContainerdError(f"the task was checkpointed but its GPU could not be given back "
                              f"({exc}); run `gpusnap doctor --fix`") from None
    if changed:
        journal.record("resumed", init_pid=q.init_pid, pids=changed, by="gpusnap",
                       after="the client's checkpoint")
    if q.guardian is not None:
        q.guardian.kill()
        q.guardian.wait()
        if q.turn is not None:  # the GPUs are back: leaving, this process lets go
            q.turn.take_back()
