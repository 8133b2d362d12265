"""Kubernetes' checkpoint API through the CRI, against a real containerd 2.1
with its CRI plugin (the version matrix's Debian sid root: `make test-matrix`;
marker `cri`, outside `make test`, whose containerd 1.7 has no CRI restore).

The calls the kubelet makes: a pod sandbox under RuntimeClass handler
`gpusnap` (runtime_type io.containerd.gpusnap.v1), a counter container in it,
CheckpointContainer (KEP-2008: the container keeps running, an archive is
written), `gpusnap push` of that archive to a registry, `gpusnap pull` of it
on the "other node", and a restore into a new pod sandbox: CreateContainer
whose image is the archive, then StartContainer (containerd 2.1's
CRImportCheckpoint). The restored counter must go on from the checkpoint's
count, and containerd must say it restored (annotation restored=true): a
silent cold start fails both.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from gpusnap.runtime.cri import Cri
from tests.conftest import COUNTER, DEMO_IMAGE, run
from tests.integration.oci_registry import make_registry

pytestmark = [pytest.mark.cri, pytest.mark.integration]

HANDLER = "gpusnap"
VENV_BIN = "/opt/gpusnap/venv/bin"
CNI_BIN = "/usr/lib/cni"
DROP_IN = Path(__file__).resolve().parents[2] / "packaging" / "kubernetes" / "containerd-gpusnap.toml"


def _containerd_major() -> int:
    out = run(["containerd", "--version"]).stdout
    parts = [w for w in out.split() if w[:1].isdigit() or w.startswith("v2")]
    return int(parts[-1].lstrip("v").split(".")[0]) if parts else 0


class CriContainerd:
    """containerd 2.x with its CRI plugin, a RuntimeClass handler for gpusnap's
    shim, a CNI bridge of its own and a sandbox image from REGISTRY."""

    def __init__(self, registry_host: str) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="gcri-", dir="/run"))
        self.socket = str(self.dir / "c.sock")
        self.made: list[str] = []
        cni = self.dir / "cni"
        cni.mkdir()
        self.bridge = f"gcri{uuid.uuid4().hex[:6]}"
        (cni / "10-gpusnap-test.conflist").write_text(json.dumps({
            "cniVersion": "1.0.0", "name": "gpusnap-cri-test",
            "plugins": [{"type": "bridge", "bridge": self.bridge, "isGateway": True, "ipMasq": False,
                         "ipam": {"type": "host-local", "ranges": [[{"subnet": "10.91.0.0/24"}]]}},
                        {"type": "loopback"}]}))
        # The handler `gpusnap` comes from the file nodes get (node-install.sh).
        (self.dir / "config.toml").write_text(f"""version = 3
imports = ["{DROP_IN}"]
root = "{self.dir}/root"
state = "{self.dir}/state"
[grpc]
  address = "{self.socket}"
[ttrpc]
  address = "{self.socket}.ttrpc"
[plugins.'io.containerd.cri.v1.runtime']
  enable_cdi = false
  # Sandboxes ask oom_score_adj -998, which needs CAP_SYS_RESOURCE (this
  # machine's sandbox lacks it): clamp to containerd's own, as rootless setups do.
  restrict_oom_score_adj = true
  [plugins.'io.containerd.cri.v1.runtime'.containerd]
    default_runtime_name = "runc"
    [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
    # gpusnap's handler with a runc option, written as runc's handler takes it:
    # the CRI sends it as runtimeoptions.v1.Options (TOML), not runc's message.
    [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.{HANDLER}-opts]
      runtime_type = "io.containerd.gpusnap.v1"
      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.{HANDLER}-opts.options]
        Root = "{self.dir}/runc-opts"
    # A RuntimeClass whose shim is not installed on this node.
    [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.{HANDLER}-missing]
      runtime_type = "io.containerd.gpusnapmissing.v1"
  [plugins.'io.containerd.cri.v1.runtime'.cni]
    bin_dirs = ["{CNI_BIN}"]
    conf_dir = "{cni}"
[plugins.'io.containerd.cri.v1.images'.pinned_images]
  sandbox = "{registry_host}/pause:1"
""")
        env = dict(os.environ, PATH=f"{VENV_BIN}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                   GPUSNAP_SHIM_DIR=str(self.dir / "s"))
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        self.log = self.dir / "containerd.log"
        with open(self.log, "ab") as logf:
            self.proc = subprocess.Popen(["containerd", "--config", str(self.dir / "config.toml")],
                                         stdout=logf, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)
        self.cri = Cri(self.socket, timeout=120)
        deadline = time.monotonic() + 30
        while True:
            try:
                self.cri.version()
                return
            except Exception:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(f"containerd's CRI did not come up: {self.log.read_text()[-3000:]}")
                time.sleep(0.2)

    def stop(self) -> None:
        for pod in self.pods():
            for call in (self.cri.stop_pod, self.cri.remove_pod):
                try:
                    call(pod)
                except Exception:
                    pass
        self.cri.close()
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
        run(["ip", "link", "delete", self.bridge])
        subprocess.run(["umount", "-R", "-l", str(self.dir / "root")], capture_output=True)
        subprocess.run(["umount", "-R", "-l", str(self.dir / "state")], capture_output=True)
        shutil.rmtree(self.dir, ignore_errors=True)

    def pods(self) -> list[str]:
        return sorted({c.pod_sandbox_id for c in self.cri.containers()} | set(self.made))

    def pod(self, name: str, handler: str = HANDLER) -> tuple[str, object]:
        config = self.cri.sandbox_config(name, "default", uuid.uuid4().hex,
                                         log_directory=str(self.dir / "logs" / name))
        (self.dir / "logs" / name).mkdir(parents=True, exist_ok=True)
        pod_id = self.cri.run_pod(config, handler)
        self.made.append(pod_id)
        return pod_id, config

    def count(self, container_id: str) -> int:
        pid = self.cri.status_info(container_id)["pid"]
        return int(Path(f"/proc/{pid}/root/tmp/c").read_text())

    def wait_count(self, container_id: str, above: int, timeout: float = 20) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                now = self.count(container_id)
                if now > above:
                    return now
            except (OSError, ValueError, KeyError):
                pass
            time.sleep(0.1)
        raise AssertionError(f"{container_id} did not count past {above}")


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    reg = make_registry(tmp_path_factory.mktemp("cri-registry"), plain=True)
    host = f"127.0.0.1:{reg.port}"
    name = f"gcri-pause-{uuid.uuid4().hex[:6]}"
    # The sandbox ("pause") image and the counter's: from the demo image, served
    # over plain HTTP on loopback (containerd's default for a localhost registry).
    run(["podman", "create", "--name", name, DEMO_IMAGE], check=True)
    try:
        run(["podman", "commit", "-q", "--change", 'CMD ["/bin/sleep", "100000000"]', name,
             f"{host}/pause:1"], check=True)
    finally:
        run(["podman", "rm", "-f", name])
    run(["podman", "tag", DEMO_IMAGE, f"{host}/demo:1"], check=True)
    for image in (f"{host}/pause:1", f"{host}/demo:1"):
        run(["podman", "push", "-q", "--tls-verify=false", image], check=True)
    yield reg, host
    reg.stop()


@pytest.fixture
def containerd(registry):
    if _containerd_major() < 2:
        pytest.fail("containerd 2.x is needed (its CRI restores checkpoints): run `make test-matrix`")
    c = CriContainerd(registry[1])
    yield c
    c.stop()


def _members(path: Path) -> dict[str, tuple]:
    """Name -> (type, mode, size, content digest) of each tar member."""
    import hashlib
    import tarfile

    out = {}
    with tarfile.open(path) as tar:
        for m in tar:
            data = tar.extractfile(m).read() if m.isfile() else b""
            out[m.name.lstrip("./")] = (m.type, m.mode, m.size, hashlib.sha256(data).hexdigest())
    return out


def gpusnap(*args: str) -> dict:
    res = run([f"{VENV_BIN}/gpusnap", *args, "--json"])
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def test_cri_checkpoint_pushed_and_restored_into_a_new_pod_counts_on(containerd, registry, tmp_path):
    reg, host = registry
    cri = containerd.cri
    image = f"{host}/demo:1"
    pod_a, config_a = containerd.pod("counter-a")
    cri.pull(image, config_a)
    ctr_a = cri.create(pod_a, config_a, "counter", image, ["sh", "-c", COUNTER],
                       log_path="counter.log")
    cri.start(ctr_a)
    assert cri.status_info(ctr_a)["runtimeType"] == "io.containerd.gpusnap.v1"
    before = containerd.wait_count(ctr_a, 5)

    # What the kubelet's POST /checkpoint/default/counter-a/counter does.
    archive = tmp_path / "checkpoint-counter-a.tar"
    cri.checkpoint(ctr_a, str(archive))
    assert archive.stat().st_size > 0
    at_checkpoint = before
    assert containerd.wait_count(ctr_a, containerd.count(ctr_a)) > at_checkpoint  # it keeps running

    ref = f"{host}/checkpoints/counter:{uuid.uuid4().hex[:8]}"
    pushed = gpusnap("push", str(archive), ref, "--plain-http")
    restored_tar = tmp_path / "pulled.tar"
    gpusnap("pull", pushed.get("pinned", ref), "-o", str(restored_tar), "--plain-http")
    assert _members(restored_tar) == _members(archive)

    # The other node: a new pod sandbox, a container created from the archive.
    pod_b, config_b = containerd.pod("counter-b")
    ctr_b = cri.create(pod_b, config_b, "counter", str(restored_tar), log_path="counter.log")
    cri.start(ctr_b)
    status = cri.status(ctr_b)
    assert status.annotations.get("restored") == "true", dict(status.annotations)
    assert cri.status_info(ctr_b)["runtimeType"] == "io.containerd.gpusnap.v1"
    first = containerd.wait_count(ctr_b, 0)
    assert first >= at_checkpoint, (first, at_checkpoint)  # not a cold start from 1
    assert containerd.wait_count(ctr_b, first) > first
    assert containerd.wait_count(ctr_a, containerd.count(ctr_a)) > 0  # the source still runs


def test_a_handlers_runc_options_reach_the_shims_runc(containerd, registry):
    # A handler written as runc's (`SystemdCgroup = true` on kubeadm nodes): its
    # options reach runc; Root here, which the test host can show.
    reg, host = registry
    cri = containerd.cri
    image = f"{host}/demo:1"
    pod, config = containerd.pod("opts", handler=f"{HANDLER}-opts")
    cri.pull(image, config)
    ctr = cri.create(pod, config, "counter", image, ["sh", "-c", COUNTER], log_path="counter.log")
    cri.start(ctr)
    containerd.wait_count(ctr, 1)
    listed = subprocess.run(["runc", "--root", str(containerd.dir / "runc-opts" / "k8s.io"), "list", "-q"],
                            capture_output=True, text=True, timeout=30)
    assert ctr in listed.stdout.split() and pod in listed.stdout.split(), (listed.stdout, listed.stderr)


def test_a_runtime_class_whose_shim_is_missing_is_one_line(containerd, registry):
    from gpusnap.errors import GpusnapError

    cri = containerd.cri
    pod, config = containerd.pod("still-here")
    with pytest.raises(GpusnapError) as err:
        cri.run_pod(cri.sandbox_config("nope", "default", uuid.uuid4().hex), f"{HANDLER}-missing")
    message = err.value.message
    assert "\n" not in message and "RunPodSandbox" in message
    assert "containerd-shim-gpusnapmissing-v1" in message, message
    assert cri.pod_status(pod).state == cri.pb.SANDBOX_READY  # nothing else touched
