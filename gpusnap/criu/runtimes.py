"""Which OCI runtimes hand CRIU gpusnap's configuration, and so its action script.

gpusnap's CRIU action script (action/action.py) quiesces CUDA processes before a
dump, sets the memory pages aside after it, and puts them where the restored
tasks can read them before a restore. CRIU runs it only when the runtime
that drives CRIU passes it a configuration file naming it:

- runc reads /etc/criu/runc.conf for every checkpoint and restore;
- crun passes /etc/criu/crun.conf (else runc.conf) from crun 1.26 on, and only
  when the libcriu.so.2 it loads at run time has criu_set_config_file()
  (libcriu >= 4.2; crun's src/libcrun/criu.c, handle_criu_config_file).
  Debian 13's crun 1.21 with libcriu 4.1 passes none (a `log-file` in
  crun.conf is ignored: docs/version-matrix.md); Debian sid's crun 1.28 with
  libcriu 4.2 passes it. GPUSNAP_CRUN_CONFIG=1 or =0 overrides the probe.

Where the script does not run, gpusnap keeps CRIU's pages in Podman's tars
(nothing would move them) and refuses to checkpoint a container with CUDA
processes (nothing would quiesce them), before anything is touched.
"""

from __future__ import annotations

import ctypes
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from gpusnap.criu.version import tool_version
from gpusnap.errors import GpusnapError

if TYPE_CHECKING:
    from gpusnap.gpu.manifest import Manifest

TRUST_ENV = "GPUSNAP_CRUN_CONFIG"
CRUN_FIRST = (1, 26)  # the first crun release that calls criu_set_config_file()
_SBIN = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def runs_action_script(runtime: str) -> bool:
    """CRIU gets gpusnap's action script when ``runtime`` (a name or a path) drives it."""
    name = Path(runtime).name if runtime else "runc"  # Podman's default where none is told
    if name == "runc":
        return True
    if name == "crun":
        told = os.environ.get(TRUST_ENV)
        if told in ("0", "1"):
            return told == "1"
        version = crun_version(runtime)
        return version is not None and version >= CRUN_FIRST and libcriu_sets_config_file()
    return False


def crun_version(runtime: str = "crun") -> tuple[int, int] | None:
    """crun's (major, minor) from `crun --version`, None where it cannot be run."""
    path = runtime if "/" in runtime else shutil.which(runtime, path=os.environ.get("PATH", "") + ":" + _SBIN)
    m = tool_version(path, r"crun version (\d+)\.(\d+)", timeout=10)
    return (int(m.group(1)), int(m.group(2))) if m else None


def libcriu_sets_config_file() -> bool:
    """The libcriu.so.2 a runtime dlopen()s here has criu_set_config_file() (libcriu >= 4.2)."""
    try:
        lib = ctypes.CDLL("libcriu.so.2")
    except OSError:
        return False
    return hasattr(lib, "criu_set_config_file")


def why_not(runtime: str) -> str:
    """Why CRIU would not run the action script under ``runtime``, and the way on."""
    name = Path(runtime).name
    if name == "crun":
        version = crun_version(runtime)
        have = f"crun {version[0]}.{version[1]}" if version else "this crun"
        if version is not None and version >= CRUN_FIRST:
            have += " with a libcriu older than 4.2"
        return (f"{have} hands CRIU no configuration file (crun >= {CRUN_FIRST[0]}.{CRUN_FIRST[1]} "
                "with libcriu >= 4.2 does), so gpusnap's action script would not run")
    return f"{name} is not known to hand CRIU /etc/criu/runc.conf, so gpusnap's action script would not run"


def require_gpu_restore(runtime: str, manifest: "Manifest | dict | None", source: str,
                        untouched: str) -> None:
    """Refuse, before anything is restored, a checkpoint whose CUDA processes gpusnap
    quiesced when ``runtime`` would restore it without the action script: CRIU
    would bring the processes back with no GPU state, locked for good.

    ``manifest``: the checkpoint's GPU manifest (or its dict); ``untouched``: what the
    refusal says stayed as it was ("nothing was restored", "nothing was downloaded").
    """
    if manifest is None:
        return
    if isinstance(manifest, dict):
        quiesced_by, processes = manifest.get("quiesced_by"), manifest.get("processes")
    else:
        quiesced_by, processes = manifest.quiesced_by, manifest.processes
    if quiesced_by != "gpusnap" or not processes:
        return
    runtime = runtime or "runc"
    if runs_action_script(runtime):
        return
    name = Path(runtime).name
    raise GpusnapError(
        f"{source} holds CUDA processes whose GPU state gpusnap brings back at restore, but "
        f"Podman would restore it under {name}: {why_not(runtime)}; {untouched}",
        f"restore it on a host where {name} hands CRIU its configuration file (runc always; "
        f"crun >= {CRUN_FIRST[0]}.{CRUN_FIRST[1]} with libcriu >= 4.2; {TRUST_ENV}=1 where the "
        "probe misjudges)")
