"""A private containerd 1.7 for the shim's tests (CPU and GPU), and helpers to drive tasks through ctr.

Each instance has its own config, root, state, socket and shim socket
directory in a fresh directory under /run; `cleanup()` kills this containerd,
its shims and their zygote.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest

from gpusnap.criu.log import SEIZE_TRIES, UNSEIZABLE_MARK
from gpusnap.ops.containerd_api import ContainerdError, checkpoint_to_dir
from tests.conftest import COUNTER, DEMO_IMAGE, run

RUNTIME = "io.containerd.gpusnap.v1"
SHIM = "containerd-shim-gpusnap-v1"
VENV_BIN = "/opt/gpusnap/venv/bin"
T = TypeVar("T")


class PrivateContainerd:
    """A containerd of our own: `start()`, `ctr(...)`, `restart()`, `stop()`."""

    def __init__(self, env: dict[str, str] | None = None, disabled: tuple[str, ...] = ()) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="gst-", dir="/run"))
        self.address = str(self.dir / "c.sock")
        self.namespace = f"gpusnap-test-{uuid.uuid4().hex[:8]}"
        self.proc: subprocess.Popen | None = None
        self.log = self.dir / "containerd.log"
        (self.dir / "config.toml").write_text(f"""version = 2
root = "{self.dir}/root"
state = "{self.dir}/state"
disabled_plugins = ["io.containerd.grpc.v1.cri", "io.containerd.internal.v1.tracing", "io.containerd.tracing.processor.v1.otlp"{"".join(f', "{d}"' for d in disabled)}]
[grpc]
  address = "{self.address}"
[ttrpc]
  address = "{self.address}.ttrpc"
[debug]
  level = "debug"
""")
        # The shim is found on containerd's PATH, as in production. Bytecode is
        # written as under a service manager, so shims start from .pyc files.
        self.env = dict(os.environ, PATH=f"{VENV_BIN}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
        self.env.pop("PYTHONDONTWRITEBYTECODE", None)
        # Shim sockets, server info files and the zygote of this containerd only.
        self.shim_dir = self.dir / "s"
        self.env["GPUSNAP_SHIM_DIR"] = str(self.shim_dir)
        self.env.update(env or {})  # containerd's environment is its shims'

    def start(self) -> None:
        logf = open(self.log, "ab")
        self.proc = subprocess.Popen(["containerd", "--config", str(self.dir / "config.toml")],
                                     stdout=logf, stderr=subprocess.STDOUT, env=self.env, start_new_session=True)
        logf.close()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"containerd exited: {self.log.read_text()[-2000:]}")
            if run(["ctr", "--address", self.address, "version"]).returncode == 0:
                return
            time.sleep(0.1)
        raise AssertionError(f"containerd did not come up: {self.log.read_text()[-2000:]}")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def ctr(self, *args: str, check: bool = True, timeout: float = 60, **kw) -> subprocess.CompletedProcess:
        cmd = ["ctr", "--address", self.address, "--namespace", self.namespace, *args]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=self.env, **kw)
        if check and res.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} failed ({res.returncode}):\n{res.stdout}\n{res.stderr}")
        return res

    def import_demo_image(self) -> None:
        self.import_image(DEMO_IMAGE)

    def import_image(self, ref: str = DEMO_IMAGE) -> None:
        """Podman's image REF into this containerd."""
        tar = self.dir / "image.tar"
        run(["podman", "save", "--format", "docker-archive", "-o", str(tar), ref], check=True)
        self.ctr("images", "import", str(tar))
        tar.unlink()

    def shim_servers(self) -> dict[int, dict]:
        """Live shim servers of this containerd, from the SOCKET.json each leaves beside its socket."""
        out = {}
        for info in self.shim_dir.glob("*.json"):
            try:
                d = json.loads(info.read_text())
            except (OSError, ValueError):
                continue
            if d.get("address") == self.address and Path(f"/proc/{d['pid']}").exists():
                out[d["pid"]] = d
        return out

    def shim_pids(self) -> list[int]:
        return sorted(self.shim_servers())

    def wait_no_shims(self, timeout: float = 10) -> None:
        deadline = time.monotonic() + timeout
        while self.shim_pids() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert self.shim_pids() == [], self.shim_servers()

    def server_of(self, task: str) -> dict:
        (info,) = [d for d in self.shim_servers().values() if d["bundle"].endswith(f"/{task}")]
        return info

    def zygote_pid(self) -> int | None:
        try:
            pid = json.loads((self.shim_dir / "zygote.json").read_text())["pid"]
        except (OSError, ValueError, KeyError):
            return None
        return pid if Path(f"/proc/{pid}").exists() else None

    def _zygotes(self) -> list[int]:
        """Zygote processes of our shim directory (also one still starting, without its info file)."""
        pids = []
        for d in Path("/proc").iterdir():
            try:
                cmd = (d / "cmdline").read_bytes().split(b"\0") if d.name.isdigit() else []
            except OSError:
                continue
            if b"gpusnap.shim.zygote" in cmd and str(self.shim_dir).encode() in cmd:
                pids.append(int(d.name))
        return pids

    def cleanup(self) -> None:
        """Kill what is left (tasks, shims, containerd) and remove the directory."""
        if self.proc is not None:
            for line in self.ctr("tasks", "ls", "-q", check=False).stdout.split():
                self.ctr("tasks", "kill", "-s", "KILL", line, check=False)
                time.sleep(0.2)
                self.ctr("tasks", "delete", "-f", line, check=False)
        self.stop()
        for pid in [*self.shim_pids(), *self._zygotes()]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        root = Path(f"/run/containerd/runc/{self.namespace}")
        for state in root.glob("*/state.json") if root.exists() else []:
            run(["runc", "--root", str(root), "delete", "--force", state.parent.name])
        shutil.rmtree(root, ignore_errors=True)
        for m in reversed(Path("/proc/self/mounts").read_text().splitlines()):
            target = m.split()[1]
            if target.startswith(str(self.dir)):
                run(["umount", "-l", target])
        shutil.rmtree(self.dir, ignore_errors=True)


@contextlib.contextmanager
def private_containerd(image: str = DEMO_IMAGE, env: dict[str, str] | None = None,
                       disabled: tuple[str, ...] = ()) -> Iterator[PrivateContainerd]:
    """A started PrivateContainerd (ENV added to its and its shims' environment, the
    plugins DISABLED left out) with IMAGE imported from Podman, cleaned up afterwards."""
    if shutil.which("containerd") is None or shutil.which(SHIM, path=VENV_BIN) is None:
        raise pytest.UsageError(f"the shim tests need containerd and {SHIM} (`make install`)")
    c = PrivateContainerd(env, disabled)
    try:
        c.start()
        c.import_image(image)
        yield c
    finally:
        c.cleanup()


def tasks(c: PrivateContainerd) -> dict[str, tuple[int, str]]:
    """`ctr t ls` as {task: (pid, status)}."""
    out = {}
    for line in c.ctr("tasks", "ls").stdout.splitlines()[1:]:
        name, pid, status = line.split()
        out[name] = (int(pid), status)
    return out


def counter_value(c: PrivateContainerd, task: str) -> int:
    return int(c.ctr("tasks", "exec", "--exec-id", f"read-{uuid.uuid4().hex[:6]}", task, "cat", "/tmp/c").stdout)


def wait_counter(c: PrivateContainerd, task: str, above: int, timeout: float = 15) -> int:
    deadline = time.monotonic() + timeout
    value = -1
    while time.monotonic() < deadline:
        try:
            value = counter_value(c, task)
        except (AssertionError, ValueError):
            value = -1
        if value > above:
            return value
        time.sleep(0.1)
    raise AssertionError(f"counter of {task} stuck at {value} (wanted > {above})")


def run_counter(c: PrivateContainerd, name: str) -> int:
    c.ctr("run", "-d", "--runtime", RUNTIME, DEMO_IMAGE, name, "sh", "-c", COUNTER)
    return wait_counter(c, name, 2)


def remove(c: PrivateContainerd, name: str) -> None:
    c.ctr("tasks", "kill", "-s", "KILL", name, check=False)
    deadline = time.monotonic() + 10
    while tasks(c).get(name, (0, "STOPPED"))[1] != "STOPPED" and time.monotonic() < deadline:
        time.sleep(0.1)
    c.ctr("tasks", "delete", name, check=False)
    c.ctr("containers", "delete", name)


def wait_status(c: PrivateContainerd, name: str, status: str, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if tasks(c).get(name, (0, ""))[1] == status:
            return
        time.sleep(0.1)
    raise AssertionError(f"{name} is {tasks(c).get(name)}, not {status}")



def shim_call(c: PrivateContainerd, task: str, method: str, **fields):
    """One RPC straight to the shim serving TASK (containerd.task.v3.Task), in
    the protocol it serves (gRPC under containerd 1.7, ttrpc under 2.x)."""
    import grpc
    from google.protobuf import message_factory

    from gpusnap.proto import load
    from gpusnap.proto.rpc import unary_stub
    from gpusnap.shim import ttrpc

    pb = load().shim
    (info,) = [p for p in c.shim_dir.glob("*.json")
               if json.loads(p.read_text()).get("bundle", "").endswith(f"/{task}")]
    service = pb.DESCRIPTOR.services_by_name["Task"]
    method_desc = service.methods_by_name[method]
    req = message_factory.GetMessageClass(method_desc.input_type)(**fields)
    sock = str(info.with_suffix(".sock"))
    if json.loads(info.read_text()).get("protocol") == "ttrpc":
        return ttrpc.call(sock, service.full_name, method, req,
                          message_factory.GetMessageClass(method_desc.output_type))
    with grpc.insecure_channel(f"unix:{sock}") as ch:
        return unary_stub(ch, service, method)(req, timeout=30)


STAMPED_COUNTER = COUNTER.replace("i=0;", "i=$(($(date +%s)*100000));")


def read_tmp_c(pid: int) -> int:
    return int(Path(f"/proc/{pid}/root/tmp/c").read_text())



LOGGER = """#!/bin/sh
# A binary:// logging program: `out PREFIX` as its arguments (from the URI's query).
echo "$CONTAINER_ID $CONTAINER_NAMESPACE $*" > "$2.env"
cat <&3 > "$2.out" 5>&- &
cat <&4 > "$2.err" 5>&- &
exec 3<&- 4<&- 5>&-  # closing fd 5 (in every process holding it) says ready
wait
"""


def binary_log_uri(directory: Path, prefix: str) -> str:
    """A binary:// URI whose program writes PREFIX.out, .err and .env (id, namespace, args) in DIRECTORY."""
    logger = directory / "logger.sh"
    if not logger.exists():
        logger.write_text(LOGGER)
        logger.chmod(0o755)
    return f"binary://{logger}?out={directory / prefix}"


def _again_as_a_user(once: Callable[[], T], between: Callable[[], None] = lambda: None) -> T:
    """``once()`` again where the shim answers that the client's pause caught the
    task in vfork() and to checkpoint again (gpusnap/shim/checkpoint.py; busybox
    1.38's sh in the sid leg), ``between()`` first: what a user does on that
    answer. Any other failure is raised."""
    for attempt in range(1, SEIZE_TRIES + 1):
        try:
            return once()
        except (AssertionError, ContainerdError) as e:
            if UNSEIZABLE_MARK not in str(e) or attempt == SEIZE_TRIES:
                raise
            print(f"checkpoint again: {e}")
            between()
    raise AssertionError("unreachable")


def ctr_checkpoint(c: PrivateContainerd, name: str, ref: str) -> subprocess.CompletedProcess:
    """`ctr containers checkpoint --task --rw NAME REF`, again on the shim's
    answer to do so, the task resumed first if it is still paused."""
    def once() -> subprocess.CompletedProcess:
        res = c.ctr("containers", "checkpoint", "--task", "--rw", name, ref, check=False)
        if res.returncode != 0:
            raise AssertionError(f"ctr containers checkpoint {name} failed ({res.returncode}):\n"
                                 f"{res.stdout}\n{res.stderr}")
        return res

    def resume_paused() -> None:
        if tasks(c).get(name, (0, ""))[1] == "PAUSED":
            c.ctr("tasks", "resume", name)
    return _again_as_a_user(once, resume_paused)


def checkpoint_as_a_user(api, *args, **kwargs):
    """ops.containerd_api.checkpoint_to_dir (what nerdctl does), again on the
    shim's answer to do so."""
    return _again_as_a_user(lambda: checkpoint_to_dir(api, *args, **kwargs))
