"""The CRIU-step agent's folder, and its start: what the action script (which
starts it), the OCI hook (which reads the GPUs it read) and the agent share.
The folder's files are listed in agent.py.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from gpusnap import journal
from gpusnap.private import write_private

if TYPE_CHECKING:
    from gpusnap.gpu.turn import Turn

INVENTORY = "inventory.json"
NO_INVENTORY = "inventory.failed"


def folder(criu_pid: int) -> Path:
    return journal.state_subdir("actions") / f"{criu_pid}-agent"


def start(criu_pid: int, driver: bool, held: "Turn | None" = None) -> None:
    """The agent of this CRIU, in a session of its own (never a child CRIU waits
    for); ``driver``: load libcuda and read NVML ahead (a GPU checkpoint);
    ``held``: the restore's turn, which the agent holds on. Its
    pid goes to ``started`` at once: a step that comes before the agent reads
    requests (crun runs no hook in between) waits for it while it lives, which
    is never longer than starting Python for the step would take."""
    here = folder(criu_pid)
    if (here / "started").exists():
        return  # runc reads runc.conf, then CRIU again: the step may run twice
    turn_args = ["--turn", f"{held.init_pid}:{held.fd}"] if held is not None else []
    proc = subprocess.Popen([sys.executable, "-m", "gpusnap.action.agent", str(criu_pid),
                             *(["--driver"] if driver else []), *turn_args],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True, close_fds=True,
                            pass_fds=(held.fd,) if held is not None else ())
    here.mkdir(mode=0o700, exist_ok=True)
    write_private(here / "started", str(proc.pid))
