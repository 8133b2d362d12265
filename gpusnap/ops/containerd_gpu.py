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
does it if the client is killed first (thawing a task left paused).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

from gpusnap import journal, requests
from gpusnap.criu.version import criu_version, cuda_plugin_path
from gpusnap.gpu import manifest as gpu_manifest
from gpusnap.gpu.inventory import read_inventory
from gpusnap.gpu.quiesce import (DEFAULT_LOCK_TIMEOUT_MS, Driver, QuiesceError, Timing, quiesce,
                                  refuse_unmanaged, refuse_unsupported, require_driver, resume)
from gpusnap.ops.containerd_api import ContainerdError
from gpusnap.procs import alive, cuda_processes


@dataclass
class Quiesced:
    """The CUDA processes of one task, quiesced by the client."""

    init_pid: int
    pids: list[int]  # the ones this quiesce changed: the ones to give back
    driver: Driver
    guardian: subprocess.Popen | None


@contextmanager
def quiesced_first(init_pid: int, lock_timeout_ms: int = DEFAULT_LOCK_TIMEOUT_MS
                   ) -> Iterator[Quiesced | None]:
    """The task's CUDA processes quiesced for the block; None where there are
    none, or where CRIU's cuda_plugin quiesces them itself during the dump."""
    procs = cuda_processes(init_pid)
    if not procs or cuda_plugin_path():
        yield None
        return
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
    q = Quiesced(init_pid, changed, driver, _guardian(changed))
    requests.put(init_pid, requests.QUIESCED, manifest=json.loads(manifest.to_json()), pids=changed)
    journal.record("quiesced", init_pid=init_pid, pids=[p.pid for p in procs], by="gpusnap",
                   before="the client's pause", timing=manifest.timing, at=round(time.time(), 3))
    try:
        yield q
    except BaseException:
        _give_back(q, quiet=True)  # the dump's own failure is what the caller must see
        raise
    _give_back(q, quiet=False)


def _guardian(pids: list[int]) -> subprocess.Popen | None:
    """The action script's guardian, watching this process instead of CRIU."""
    if not pids:
        return None
    return subprocess.Popen([sys.executable, "-m", "gpusnap.action.guardian", str(os.getpid()),
                             *map(str, pids)], stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True, close_fds=True)


def _give_back(q: Quiesced, quiet: bool) -> None:
    """The surviving processes' GPUs back (restore + unlock); the guardian
    stops once that is done, and stays for this process's exit if it failed."""
    requests.drop(q.init_pid, requests.QUIESCED)
    living = [p for p in q.pids if alive(p)]  # with exit_after, CRIU killed them
    try:
        changed = resume(q.driver, living)
    except QuiesceError as exc:
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
