"""Which OCI runtimes hand CRIU gpusnap's configuration, and so its action script.

gpusnap's CRIU action script (criu/action.py) quiesces CUDA processes before a
dump, sets the memory pages aside after it, and puts them where the restored
tasks can read them before a restore. CRIU runs it only when the runtime
that drives CRIU passes it a configuration file naming it:

- runc reads /etc/criu/runc.conf for every checkpoint and restore;
- crun passes /etc/criu/crun.conf (else runc.conf) only when built against
  libcriu 4.2 or newer. Debian 13's crun 1.21 with libcriu 4.1 passes none:
  measured in the version matrix (a `log-file` in crun.conf was ignored).
  Where crun is known to pass it, GPUSNAP_CRUN_CONFIG=1 says so.

Where the script does not run, gpusnap keeps CRIU's pages in Podman's tars
(nothing would move them) and refuses to checkpoint a container with CUDA
processes (nothing would quiesce them), before anything is touched.
"""

from __future__ import annotations

import os
from pathlib import Path

TRUST_ENV = "GPUSNAP_CRUN_CONFIG"


def runs_action_script(runtime: str) -> bool:
    """CRIU gets gpusnap's action script when ``runtime`` (a name or a path) drives it."""
    name = Path(runtime).name if runtime else "runc"  # Podman's default where none is told
    if name == "runc":
        return True
    if name == "crun":
        return os.environ.get(TRUST_ENV) == "1"
    return False


def why_not(runtime: str) -> str:
    """Why CRIU would not run the action script under ``runtime``, and the way on."""
    name = Path(runtime).name
    if name == "crun":
        return (f"{name} hands CRIU no configuration file unless it is built against libcriu "
                f">= 4.2, so gpusnap's action script would not run")
    return f"{name} is not known to hand CRIU /etc/criu/runc.conf, so gpusnap's action script would not run"
