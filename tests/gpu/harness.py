"""Start and watch CUDA containers for the GPU tests, the GPU demo and bench/.

The image (localhost/gpusnap-cuda, built by tests/gpu/prepare.sh) holds only
the directory skeleton; the host's /usr, the PyTorch venv and the driver
libraries are bind-mounted read-only (non-recursive, so CRIU sees each mount
runc declared), and the GPU device nodes are passed with --device.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

IMAGE = "localhost/gpusnap-cuda:latest"
HERE = Path(__file__).resolve().parent
PYTHON = os.environ.get("GPUSNAP_CUDA_PYTHON", "/opt/torch/.venv/bin/python3")
DRIVER_DIR = "/usr/local/nvidia"


def figure(**fields) -> None:
    """A measured figure, kept with the run's logs (GPUSNAP_TEST_LOGS/figures.jsonl)
    for docs/benchmarks.md."""
    logs = os.environ.get("GPUSNAP_TEST_LOGS")
    if logs:
        Path(logs).mkdir(parents=True, exist_ok=True)
        with open(Path(logs) / "figures.jsonl", "a") as f:
            f.write(json.dumps(fields) + "\n")


def _sh(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    res = subprocess.run(list(args), capture_output=True, text=True, timeout=600)
    if check and res.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed: {res.stderr.strip()}")
    return res


def gpu_device_args(gpus: list[int]) -> list[str]:
    args = []
    for i in gpus:
        args += ["--device", f"/dev/nvidia{i}"]
    for node in ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"):
        if os.path.exists(node):
            args += ["--device", node]
    return args


def mount_args() -> list[str]:
    args = []
    for src in ("/usr", "/opt/torch", DRIVER_DIR, "/etc/ld.so.cache"):
        if os.path.exists(src):
            args += ["--mount", f"type=bind,src={src},dst={src},ro=true,bind-nonrecursive=true"]
    return args


@dataclass
class CudaContainer:
    name: str
    status: Path
    nproc: int
    # each worker's seed as the test first read it (workload.py): verify()
    # compares the GPU data with the tensors that seed made, which only the
    # original run holds
    seeds: list[str] = field(default_factory=list)

    def keep_seeds(self) -> "CudaContainer":
        self.seeds = self.born()
        return self

    def worker(self, i: int) -> tuple[int, str]:
        try:
            it, ok = (self.status / f"w{i}").read_text().split()
            return int(it), ok
        except (OSError, ValueError):
            return 0, "none"

    def iterations(self) -> list[int]:
        return [self.worker(i)[0] for i in range(self.nproc)]

    def born(self) -> list[str]:
        """Each worker's start token (workload.py): unchanged across a restore."""
        return [(self.status / f"w{i}.born").read_text() for i in range(self.nproc)]

    def assert_restored(self, born: list[str], its: list[int], timeout: float = 120) -> None:
        """Restored, not restarted: the same workers (their start tokens), counting
        on from where they were, with every element of their GPU data compared."""
        assert self.born() == born, "the workers started afresh: not a restore"
        now = self.wait_running(above=[max(i - 1, 0) for i in its], timeout=timeout)
        assert all(n >= i for n, i in zip(now, its)), (now, its)
        self.verify(timeout=timeout)

    def wait_running(self, above: list[int] | None = None, timeout: float = 120) -> list[int]:
        """Wait until every worker's iteration passes ``above`` (default 0)."""
        above = above or [0] * self.nproc
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            its = self.iterations()
            if all(it > a for it, a in zip(its, above)):
                bad = [i for i in range(self.nproc) if self.worker(i)[1] != "ok"]
                if bad:
                    raise AssertionError(f"workers {bad} report a wrong checksum")
                return its
            time.sleep(0.1)
        raise AssertionError(f"{self.name}: workers at {self.iterations()}, expected > {above}")

    def verify(self, timeout: float = 120) -> None:
        """Every worker compares all elements of its GPU data with the tensor the
        seed read at the start makes (workload.py; jobs.py ignores the seeds)."""
        token = uuid.uuid4().hex
        (self.status / "verify").write_text(" ".join([token, *self.seeds]))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            results = []
            for i in range(self.nproc):
                try:
                    results.append((self.status / f"w{i}.verified").read_text().split())
                except OSError:
                    results.append(None)
            if all(r and r[0] == token for r in results):
                assert all(r[1] == "ok" for r in results), f"contents differ: {results}"
                return
            time.sleep(0.1)
        raise AssertionError(f"{self.name}: verification did not finish")

    def remove(self) -> None:
        keep = os.environ.get("GPUSNAP_TEST_LOGS")
        if keep:  # CRIU's logs go with the container: keep them for the report
            res = _sh("podman", "inspect", self.name, "--format", "{{.StaticDir}}", check=False)
            for log in ("dump.log", "restore.log"):
                src = Path(res.stdout.strip()) / log
                if res.returncode == 0 and src.exists():
                    Path(keep).mkdir(parents=True, exist_ok=True)
                    (Path(keep) / f"{self.name}-{log}").write_bytes(src.read_bytes())
        _sh("podman", "rm", "-f", "-t", "0", self.name, check=False)


def _run(name: str, gpus: list[int], nproc: int, *command: str, runtime: str | None = None) -> CudaContainer:
    """A CUDA container running ``command`` with a /status folder; waits for its workers."""
    status = Path(tempfile.mkdtemp(prefix=f"{name}-", dir="/var/tmp"))
    _sh("podman", "run", "-d", "--name", name, "--network", "none", *gpu_device_args(gpus),
        *(["--runtime", runtime] if runtime else []),
        *mount_args(), "-v", f"{status}:/status", "-v", f"{HERE}:/work:ro",
        "-e", f"LD_LIBRARY_PATH={DRIVER_DIR}/lib64:{DRIVER_DIR}/lib", "-e", "PYTHONUNBUFFERED=1",
        IMAGE, *command)
    ctr = CudaContainer(name, status, nproc)
    try:
        ctr.wait_running()
    except AssertionError:
        logs = _sh("podman", "logs", name, check=False)
        ctr.remove()
        raise AssertionError(f"{name} did not start: {logs.stdout[-2000:]}{logs.stderr[-2000:]}")
    return ctr


def start(nproc: int = 1, gib: float = 2.0, gpus: list[int] | None = None,
          name: str | None = None, runtime: str | None = None) -> CudaContainer:
    """``runtime``: Podman's --runtime (crun, runc); Podman's default where None."""
    return _run(name or f"gpusnap-cuda-{uuid.uuid4().hex[:8]}", gpus if gpus is not None else [0],
                nproc, PYTHON, "/work/workload.py", str(nproc), str(gib),
                runtime=runtime).keep_seeds()


class Hog:
    """A container on one GPU that takes memory when told (take): for a GPU
    filled at a chosen moment, after gpusnap planned onto it."""

    def __init__(self, gpu: int) -> None:
        code = ("import os, time, torch; torch.zeros(1, device='cuda'); "
                "open('/status/w0', 'w').write('1 ok')\n"
                "while not os.path.exists('/status/go'): time.sleep(0.01)\n"
                "x = torch.empty(int(open('/status/go').read()), dtype=torch.uint8, device='cuda'); "
                "torch.cuda.synchronize(); open('/status/w0', 'w').write('2 ok'); time.sleep(1e6)")
        self.ctr = _run(f"gpusnap-hog-{uuid.uuid4().hex[:8]}", [gpu], 1, PYTHON, "-c", code)

    def take(self, nbytes: int) -> None:
        (self.ctr.status / "go").write_text(str(max(nbytes, 1 << 20)))
        self.ctr.wait_running(above=[1], timeout=60)

    def remove(self) -> None:
        self.ctr.remove()


def hold_memory(gpu: int, gib: float) -> CudaContainer:
    """A container that only holds ``gib`` GiB on ``gpu`` (uninitialised: quick even
    for nearly all of an H200), to make that GPU too full for a restore."""
    hog = Hog(gpu)
    hog.take(int(gib * (1 << 30)))
    return hog.ctr


def _nvml(ask):
    """``ask(pynvml)`` with NVML open (pynvml: only on the GPU host, asked when used)."""
    import pynvml
    pynvml.nvmlInit()
    try:
        return ask(pynvml)
    finally:
        pynvml.nvmlShutdown()


def gpu_count() -> int:
    return _nvml(lambda nv: nv.nvmlDeviceGetCount())


def gpu_memory_free(index: int = 0) -> int:
    """Bytes free on a GPU, from NVML."""
    return _nvml(lambda nv: nv.nvmlDeviceGetMemoryInfo(nv.nvmlDeviceGetHandleByIndex(index)).free)


def gpu_memory_used(index: int = 0) -> int:
    """Bytes in use on a GPU, from NVML."""
    return _nvml(lambda nv: nv.nvmlDeviceGetMemoryInfo(nv.nvmlDeviceGetHandleByIndex(index)).used)


def host_pids(name: str) -> list[int]:
    """Host pids of the container's CUDA processes."""
    from gpusnap.procs import cuda_processes
    pid = int(_sh("podman", "inspect", name, "--format", "{{.State.Pid}}").stdout.strip())
    return [p.pid for p in cuda_processes(pid)]


def room() -> str:
    """What holds the disk and the memory (df, du, free): a GPU checkpoint is
    several copies of the GPU memory at once, on disk and in tmpfs; said with
    a failure, which may be a full one."""
    from gpusnap.ops.leftovers import staging_folders

    mounts = ["/", "/run", "/run/gpusnap/ram", "/dev/shm"]
    where = ["/var/lib/containers", "/var/tmp", "/tmp", "/run/gpusnap"]
    out = []
    for cmd in (["df", "-h", *[m for m in mounts if os.path.isdir(m)]],
                ["du", "-xsh", *where, *map(str, staging_folders())], ["free", "-g"]):
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            out.append(res.stdout)
        except (OSError, subprocess.TimeoutExpired) as exc:
            out.append(f"{cmd[0]}: {exc}\n")
    return "".join(out)
