"""The checks a restore passes before anything is touched, and how a user overrides one.

Every refusal is a Problem: one line, named after its check. Checks that a user
may knowingly override are skipped with GPUSNAP_SKIP_CHECKS=name[,name...]
(the same idea as CRIU's amdgpu plugin's KFD_*_CHECK variables, with one
variable for all of them); the others describe something no override can fix.
"""

from __future__ import annotations

import difflib
import platform
from dataclasses import dataclass
from typing import Mapping

from gpusnap.criu.version import criu_version, is_supported
from gpusnap.errors import GpusnapError
from gpusnap.gpu.inventory import Inventory, mps_active
from gpusnap.gpu.manifest import Manifest

SKIP_ENV = "GPUSNAP_SKIP_CHECKS"
MIN_CHECKPOINT_DRIVER = 570  # cuCheckpointProcess* exists
MIN_REMAP_DRIVER = 580  # CUcheckpointRestoreArgs carries GPU UUID pairs


@dataclass(frozen=True)
class Check:
    name: str
    skippable: bool
    what: str
    # CRIU amdgpu_plugin variable that relaxes the same check (AMD only)
    kfd_env: str | None = None


CHECKS: dict[str, Check] = {c.name: c for c in (
    Check("nvidia", False, "this host has a working NVIDIA driver"),
    Check("driver", False, f"the NVIDIA driver is r{MIN_CHECKPOINT_DRIVER}+ (checkpoint API)"),
    Check("driver-version", True, "the NVIDIA driver is the version the checkpoint's processes "
                                  "loaded (their libcuda is the host's)"),
    Check("cuda", True, "the CUDA driver API version is not older than the checkpoint's"),
    Check("remap-driver", True, f"restoring onto other GPUs needs driver r{MIN_REMAP_DRIVER}+"),
    Check("gpu-map", False, "--gpu-map names GPUs that exist"),
    Check("count", False, "enough suitable GPUs for every GPU of the checkpoint"),
    Check("chip", True, "each target GPU is the same chip and compute capability"),
    Check("memory", True, "each target GPU has the free memory its processes used"),
    Check("mig", False, "target GPUs are not in MIG mode"),
    Check("devices", False, "the checkpoint records the device numbers needed to move its GPUs"),
    Check("arch", False, "the CPU architecture is the checkpoint's"),
    Check("kernel", True, "the kernel is not older than the checkpoint's"),
    Check("criu", False, "CRIU 4.0 or newer is installed"),
    Check("criu-version", True, "CRIU is not older than the one that wrote the checkpoint"),
    Check("mps", True, "no CUDA MPS daemon is running"),
    Check("amd-gpu", False, "AMD GPUs here match the checkpoint's (ISA, CUs, engines, links)"),
    Check("amd-fw", True, "GPU firmware is not older", "KFD_FW_VER_CHECK"),
    Check("amd-sdma-fw", True, "SDMA firmware is not older", "KFD_SDMA_FW_VER_CHECK"),
    Check("amd-caches", True, "no fewer caches", "KFD_CACHES_COUNT_CHECK"),
    Check("amd-gws", True, "no fewer global wave syncs", "KFD_NUM_GWS_CHECK"),
    Check("amd-vram", True, "no less VRAM", "KFD_VRAM_SIZE_CHECK"),
    Check("amd-numa", True, "GPUs keep their NUMA (CPU) neighbours", "KFD_NUMA_CHECK"),
    Check("amd-capability", True, "the same KFD capability bits", "KFD_CAPABILITY_CHECK"),
)}


@dataclass(frozen=True)
class Problem:
    """One reason the restore cannot go ahead as planned."""

    check: str
    message: str
    # None: as the check is registered; False where an override cannot help this instance
    skippable: bool | None = None

    def __post_init__(self) -> None:
        if self.check not in CHECKS:
            raise ValueError(f"unknown check {self.check!r}")
        if "\n" in self.message:
            raise ValueError("a problem is one line")

    @property
    def can_skip(self) -> bool:
        return CHECKS[self.check].skippable if self.skippable is None else self.skippable

    @property
    def line(self) -> str:
        """The message, plus the override where there is one."""
        if not self.can_skip:
            return self.message
        return f"{self.message} (override: {SKIP_ENV}={self.check})"


class SkipChecksError(GpusnapError, ValueError):
    def __init__(self, message: str) -> None:
        skippable = ", ".join(n for n, c in CHECKS.items() if c.skippable)
        super().__init__(message, f"{SKIP_ENV} takes a comma-separated list of: {skippable}")


def parse_skip(value: str | None) -> frozenset[str]:
    """GPUSNAP_SKIP_CHECKS=chip,memory -> {'chip', 'memory'}; unknown or unskippable names fail."""
    if value is None or not value.strip():
        return frozenset()
    names = []
    for position, raw in enumerate(value.split(","), start=1):
        name = raw.strip()
        if not name:
            raise SkipChecksError(f"{SKIP_ENV}: item {position} of {value!r} is empty")
        check = CHECKS.get(name)
        if check is None:
            close = difflib.get_close_matches(name, list(CHECKS), n=1)
            guess = f" (did you mean {close[0]!r}?)" if close else ""
            raise SkipChecksError(f"{SKIP_ENV}: unknown check {name!r}{guess}")
        if not check.skippable:
            raise SkipChecksError(f"{SKIP_ENV}: check {name!r} ({check.what}) cannot be skipped")
        names.append(name)
    return frozenset(names)


def skip_from_env(environ: Mapping[str, str]) -> frozenset[str]:
    return parse_skip(environ.get(SKIP_ENV))


def split_skipped(problems: list[Problem], skip: frozenset[str]) -> tuple[list[Problem], list[Problem]]:
    """(still refusing, overridden by the user)."""
    kept = [p for p in problems if not (p.can_skip and p.check in skip)]
    skipped = [p for p in problems if p.can_skip and p.check in skip]
    return kept, skipped


# --- facts about this host that are not GPUs ------------------------------------------------

@dataclass(frozen=True)
class HostFacts:
    arch: str | None = None
    kernel: str | None = None
    criu_version: str | None = None
    mps_active: bool = False


def read_host_facts() -> HostFacts:
    """This host now (runs `criu --version`)."""
    return HostFacts(arch=platform.machine(), kernel=platform.release(),
                     criu_version=criu_version(), mps_active=mps_active())


def version_key(version: str | None, parts: int = 3) -> tuple[int, ...] | None:
    """'6.18.0-1-amd64' -> (6, 18, 0); None for anything without a leading number."""
    if not version:
        return None
    numbers = []
    for piece in version.replace("-", ".").split(".")[:parts]:
        if not piece.isdigit():
            break
        numbers.append(int(piece))
    return tuple(numbers) or None


def driver_major(version: str | None) -> int:
    try:
        return int((version or "0").split(".")[0])
    except ValueError:
        return 0


# --- what the checkpoint needs of this host ------------------------------------------------

def driver_problems(manifest: Manifest, inventory: Inventory) -> list[Problem]:
    here, there = inventory.driver_version, manifest.driver_version
    if driver_major(here) < MIN_CHECKPOINT_DRIVER:
        return [Problem("driver", f"NVIDIA driver {here} cannot restore CUDA checkpoints: "
                                  f"r{MIN_CHECKPOINT_DRIVER} or newer is needed")]
    problems = []
    # The processes mapped the host's libcuda, which must match the kernel module; a
    # checkpoint without processes (nothing mapped) does not care.
    if manifest.processes and here and there and here != there:
        problems.append(Problem("driver-version", f"NVIDIA driver here is {here} but the "
                                f"checkpoint's processes run driver {there}'s libcuda: restore on a "
                                f"host with driver {there}"))
    cuda_here = version_key(inventory.cuda_driver_version, 2)
    cuda_there = version_key(manifest.cuda_driver_version, 2)
    if cuda_here and cuda_there and cuda_here < cuda_there:
        problems.append(Problem("cuda", f"CUDA driver API here is {inventory.cuda_driver_version}, "
                                f"older than the checkpoint's {manifest.cuda_driver_version}"))
    return problems


def host_problems(manifest: Manifest | None, host: HostFacts | None, uses_gpus: bool) -> list[Problem]:
    if host is None:
        return []
    problems = []
    was = (manifest.host if manifest else {}) or {}
    if was.get("arch") and host.arch and was["arch"] != host.arch:
        problems.append(Problem("arch", f"the checkpoint was taken on {was['arch']} and this host is "
                                f"{host.arch}: CRIU restores only onto the same CPU architecture"))
    k_was, k_here = version_key(was.get("kernel"), 2), version_key(host.kernel, 2)
    if k_was and k_here and k_here < k_was:
        problems.append(Problem("kernel", f"kernel {host.kernel} here is older than the checkpoint's "
                                f"{was['kernel']}: restored processes may use what it lacks"))
    if not is_supported(host.criu_version):
        problems.append(Problem("criu", f"restore needs CRIU 4.0 or newer, found "
                                f"{host.criu_version or 'no criu'}"))
    elif manifest and manifest.criu_version:
        c_was, c_here = version_key(manifest.criu_version), version_key(host.criu_version)
        if c_was and c_here and c_here < c_was:
            problems.append(Problem("criu-version", f"CRIU {host.criu_version} here is older than "
                                    f"CRIU {manifest.criu_version} that wrote the checkpoint"))
    if uses_gpus and host.mps_active:
        problems.append(Problem("mps", "a CUDA MPS control daemon runs here: restored processes "
                                "would meet MPS, which the checkpoint API does not support"))
    return problems
