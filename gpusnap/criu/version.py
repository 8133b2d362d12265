"""Which CRIU runc will run, and whether it can checkpoint GPU containers."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

from gpusnap.errors import GpusnapError

MIN_VERSION = (4, 0)
# Where CRIU looks for plugins (CRIU_LIBS_DIR overrides, as in criu/plugin.c).
PLUGIN_DIRS = ("/usr/lib/criu", "/usr/local/lib/criu", "/usr/lib64/criu")


def tool_version(path: str | None, pattern: str, timeout: float = 20) -> re.Match | None:
    """PATTERN searched in what `PATH --version` prints; None where it cannot be run."""
    if path is None:
        return None
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=timeout).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return re.search(pattern, out)


def criu_version(criu: str = "criu") -> str | None:
    """'4.1.1', or None when there is no usable criu on PATH."""
    m = tool_version(shutil.which(criu), r"Version:\s*([\d.]+)")
    return m.group(1) if m else None


def version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in version.split(".") if p.isdigit())


def is_supported(version: str | None) -> bool:
    return version is not None and version_tuple(version)[:2] >= MIN_VERSION


# Linux 6.16 refuses getsockopt(SO_PASSCRED/SO_PASSSEC) on TCP and UDP sockets,
# which CRIU before 4.2 asks of every socket: the dump of any container with one fails.
INET_SOCKETS = {"kernel": (6, 16), "criu": (4, 2)}
INET_SOCKETS_LOG = "Can't get 1:16 opt"  # dump.log's words for it


def inet_sockets_problem(version: str | None, kernel: str | None = None) -> str | None:
    """Why this CRIU cannot dump a container's TCP/UDP sockets on this kernel, or None."""
    kernel = kernel or os.uname().release
    if version is None or version_tuple(version)[:2] >= INET_SOCKETS["criu"]:
        return None
    if version_tuple(kernel.split("-")[0])[:2] < INET_SOCKETS["kernel"]:
        return None
    return (f"CRIU {version} cannot dump TCP or UDP sockets on Linux {kernel.split('-')[0]} "
            "(6.16 refuses it SO_PASSCRED on them; CRIU 4.2 asks only where it applies)")


def require_supported(verb: str, version: str | None = None) -> str:
    """The version of the criu runc will run (the first on PATH), or a one-line refusal;
    ``version``: what criu_version() answered already (else asked here).

    Called before anything is touched: CRIU 3.x fails mid-dump on recent kernels.
    """
    version = version or criu_version()
    if is_supported(version):
        return version
    path = shutil.which("criu")
    found = f"CRIU {version} at {path}" if version else (
        f"{path}, which does not say its version" if path else "no criu on PATH")
    raise GpusnapError(f"{verb} needs CRIU {'.'.join(map(str, MIN_VERSION))} or newer, found "
                       f"{found}; nothing was changed",
                       "put CRIU 4 first on PATH (`make deps` installs it as "
                       "/usr/local/sbin/criu); `gpusnap doctor` checks the host")


def cuda_plugin_path() -> Path | None:
    """CRIU's own cuda_plugin, if installed: then gpusnap must not quiesce as well."""
    dirs = [os.environ["CRIU_LIBS_DIR"]] if os.environ.get("CRIU_LIBS_DIR") else []
    for d in dirs + list(PLUGIN_DIRS):
        p = Path(d) / "cuda_plugin.so"
        if p.exists():
            return p
    return None
