"""The shim's CRIU dump: whether a paused task must run for it (CUDA), runc
checkpoint, CRIU's log kept beside the bundle on failure, and a dump CRIU gave
up on at its seize taken again where a new freeze can miss the race.

A task caught in vfork() by the freeze (criu.log.seize_blocked) is a race of
milliseconds. Where CRIU froze the task itself (it was running, or the shim
thawed it for the CUDA driver) another try freezes it at another moment. A
task the client paused before Checkpoint (ctr, nerdctl) stays frozen as it was
caught: only the client can resume and pause it again, after which its rw
layer must be diffed again too, so the answer says to checkpoint again.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

from gpusnap import requests
from gpusnap.criu.log import SEIZE_TRIES, seize_blocked, unseizable_words
from gpusnap.private import open_private
from gpusnap.procs import cuda_processes, start_time
from gpusnap.shim.runc import CheckpointOpts, Runc, RuncError

log = logging.getLogger("gpusnap.shim")

def thaw_for_the_driver(status: str, pid: int) -> bool:
    """Whether a task must run for its dump: a paused one that uses CUDA, whose
    GPU the driver's lock (pre-dump) needs running, unless gpusnap's client
    quiesced that GPU before its pause (requests.QUIESCED)."""
    return (status == "paused" and bool(pid) and bool(cuda_processes(pid))
            and not requests.bound(pid, requests.QUIESCED))


def thaw_held(runc: Runc, cid: str, pid: int) -> None:
    """Thaw a task its client paused, for the dump, marked held first
    (requests.HELD): the guardian gives its GPUs back after the client's Resume,
    once the shim has paused it again for the client."""
    # the shim that holds it: a HELD left by a shim that died is no hold (requests.held)
    requests.put_bound(pid, requests.HELD, holder=os.getpid(), holder_started=start_time(os.getpid()))
    try:
        runc.resume(cid)
    except BaseException:
        requests.drop(pid, requests.HELD)
        raise


def pause_again(runc: Runc, cid: str, pid: int, exited: bool) -> bool:
    """Pause a task thawed for its dump again, as its client left it: a Go client
    diffs the rw layer after Checkpoint, then resumes it (or not, if it was
    paused before), and the guardian gives its GPUs back once that Resume has
    dropped requests.HELD. False where it exited or the pause failed (it
    runs): HELD is dropped then."""
    if not exited:
        try:
            runc.pause(cid)
            return True
        except RuncError as e:  # the dump's own outcome is what the client must see
            log.warning("re-pausing %s after its checkpoint: %s", cid, e)
    requests.drop(pid, requests.HELD)
    return False


def dump(runc: Runc, cid: str, opts: CheckpointOpts, dump_log: str, frozen_by_client: bool) -> None:
    """runc checkpoint CID; on failure CRIU's log is copied to DUMP_LOG (runc's
    work folder goes) and named in the error."""
    for attempt in range(1, SEIZE_TRIES + 1):
        try:
            runc.checkpoint(cid, opts)
            return
        except RuncError as e:
            try:  # an earlier failure's log is not this one's (runc may fail before CRIU runs)
                os.unlink(dump_log)
            except FileNotFoundError:
                pass
            try:
                with open(os.path.join(opts.work_path, "dump.log"), "rb") as src, \
                        open_private(dump_log, "wb") as dst:
                    shutil.copyfileobj(src, dst)
            except OSError:
                pass
            pid = seize_blocked(Path(dump_log))
            if pid is None:
                raise RuncError(f"{e} (CRIU log: {dump_log})" if os.path.exists(dump_log) else str(e)) from None
            if frozen_by_client or attempt == SEIZE_TRIES:
                again = ("checkpoint again (the task stays paused as it was caught until "
                         "resumed)" if frozen_by_client else f"{SEIZE_TRIES} tries; checkpoint again")
                raise RuncError(f"{unseizable_words(pid)}; {again} (CRIU log: {dump_log})") from None
            log.warning("checkpoint of %s: CRIU could not seize %d, taking it again", cid, pid)
