"""The CRIU-step agent (action/agent.py) started by `gpusnap restore` before
Podman, instead of by CRIU's pre-restore step.

Started from pre-restore, the agent's Python, imports, libcuda and NVML load
inside CRIU's stop, and so does pre-restore's own Python (docs/benchmarks.md).
Started here, they load while Podman imports the checkpoint; the restore's
images carry AGENT_FILE, naming the agent's folder, and packaging/bin/criu-action
hands it pre-restore, after which it is that CRIU's agent as if pre-restore had
started it. Only ever a head start: where the agent is gone, or the images lack
the file (a plain `podman container restore`), CRIU's steps run as before.

    <state>/actions/<agent pid>-early-<nonce>/   until CRIU asks (then <criu pid>-agent)
      started    the agent's pid, written by the CLI as it starts it
      requests   a FIFO; pid: written once the agent reads it (as in agent.py)
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import subprocess
import sys
from pathlib import Path

from gpusnap import journal
from gpusnap.private import write_private

AGENT_FILE = "gpusnap-agent"  # in the images (checkpoint/): the agent folder's name
EARLY = "-early-"
STOP_WAIT_S = 1.0  # an agent stopped (killed) before it read requests: still importing


def early_name(agent_pid: int, nonce: str) -> str:
    """The folder's name: the agent's pid first, as every name in actions/ starts
    with the pid it belongs to (action.run_step removes those whose pid is gone)."""
    return f"{agent_pid}{EARLY}{nonce}"


def early_folder(name: str) -> Path:
    return journal.state_subdir("actions") / name


class EarlyAgent:
    """A started agent: ``name`` goes into the images as AGENT_FILE."""

    def __init__(self, proc: subprocess.Popen, name: str) -> None:
        self.proc, self.name = proc, name

    def member(self) -> dict[str, bytes]:
        """The file the import stream adds to the images (ops/pull.py write_files's edits)."""
        return {f"checkpoint/{AGENT_FILE}": self.name.encode()}

    def done(self) -> None:
        """The restore is over (restored or failed): an agent CRIU never asked for
        pre-restore leaves now (asked to where it reads requests, else stopped);
        one it asked is CRIU's and leaves with CRIU."""
        here = early_folder(self.name)
        if not here.exists():
            return  # taken by CRIU's pre-restore (or gone)
        if not (here / "pid").exists():  # not reading requests yet: nothing can be half done
            with contextlib.suppress(OSError):
                self.proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=STOP_WAIT_S)
            if self.proc.poll() is not None:
                shutil.rmtree(here, ignore_errors=True)
            return
        try:
            fd = os.open(here / "requests", os.O_WRONLY | os.O_NONBLOCK)
        except OSError:
            return  # its FIFO moved: CRIU's pre-restore is taking it
        try:
            os.write(fd, b"leave 0 - -\n")
        except OSError:
            pass
        finally:
            os.close(fd)


def start(driver: bool) -> EarlyAgent | None:
    """The agent, loading its modules (and with ``driver``, libcuda and NVML) while
    the caller goes on; None where it cannot start (CRIU's steps start their own)."""
    nonce = secrets.token_hex(8)
    try:
        proc = subprocess.Popen([sys.executable, "-m", "gpusnap.action.agent", "--early", nonce,
                                 "--parent", str(os.getpid()), *(["--driver"] if driver else [])],
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True,
                                close_fds=True, cwd="/", env=_env())
    except OSError as exc:
        journal.record("agent-not-started", error=str(exc), early=True)
        return None
    name = early_name(proc.pid, nonce)
    here = early_folder(name)
    try:
        here.mkdir(mode=0o700, exist_ok=True)
        # a step that comes before the agent reads requests waits for it while it lives
        write_private(here / "started", str(proc.pid))
    except OSError as exc:  # only ever a head start: the restore goes on without it
        proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):  # still in an uninterruptible call
            proc.wait(timeout=STOP_WAIT_S)
        shutil.rmtree(here, ignore_errors=True)
        journal.record("agent-not-started", error=str(exc), early=True)
        return None
    return EarlyAgent(proc, name)


# What of the CLI's environment the agent keeps: where gpusnap and Python come
# from, the state folder and the locale. The rest (a wrapped Podman's
# LD_LIBRARY_PATH, CUDA_VISIBLE_DEVICES, GPUSNAP_WAIT_*...) stays the CLI's, as
# runc's environment is all the agent pre-restore starts gets.
KEPT_ENV = ("PATH", "PYTHONPATH", "GPUSNAP_STATE_DIR", "LANG", "LC_ALL")


def _env() -> dict[str, str]:
    return {k: os.environ[k] for k in KEPT_ENV if k in os.environ}
