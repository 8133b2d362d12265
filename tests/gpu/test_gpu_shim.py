"""A CUDA container under containerd-shim-gpusnap-v1: checkpointed and restored, and with 2 GPUs restored onto the other.

A private containerd 1.7 (tests/integration/shim_containerd.py) runs the CUDA
image of tests/gpu/harness.py with the same mounts and device nodes through
`ctr run --runtime io.containerd.gpusnap.v1`. The checkpoint and restore go
through containerd's API the way nerdctl drives them
(gpusnap.ops.containerd_api): Tasks.Checkpoint with exit, the CRIU image
unpacked into a directory, then Tasks.Create with it re-tarred and Start, at
which the shim plans the GPUs, edits the bundle and the image and runs
`runc restore`; the CRIU action script quiesces and resumes the CUDA processes.
gpusnap's own containerd checkpoint (a push's) quiesces them before its pause
instead (ops/containerd_gpu.py), and the last test holds it to that.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from gpusnap import MANIFEST_NAME, PLAN_NAME
from gpusnap.procs import process_tree
from gpusnap.ops.containerd_api import Client, checkpoint_to_dir, restore_from_dir, runc_checkpoint_options
from gpusnap.ops.containerd_checkpoint import checkpoint_container, export_image, import_dir
from gpusnap.gpu.gpumap import GPU_MAP_ANNOTATION
from gpusnap.shim.remap import BACKUP
from tests.conftest import RENAMING_HOLDER, journal_mark, journal_since
from tests.gpu import harness
from tests.integration.shim_containerd import RUNTIME, PrivateContainerd, private_containerd, tasks, wait_status

GIB = 1 << 30


@pytest.fixture(scope="module")
def containerd():
    with private_containerd(harness.IMAGE) as c:
        yield c


def _ctr_mounts() -> list[str]:
    """harness.mount_args() in ctr's syntax: read-only, non-recursive binds."""
    args = []
    for src in ("/usr", "/opt/torch", harness.DRIVER_DIR, "/etc/ld.so.cache"):
        if os.path.exists(src):
            args += ["--mount", f"type=bind,src={src},dst={src},options=bind:ro"]
    return args


def _run_cuda(c: PrivateContainerd, gpus: list[int], annotations: dict[str, str] | None = None,
              gib: float = 2.0, beside: str = "") -> harness.CudaContainer:
    """The CUDA workload under the shim; BESIDE: a shell loop its init runs too."""
    name = f"gpusnap-shim-{uuid.uuid4().hex[:8]}"
    status = Path(tempfile.mkdtemp(prefix=f"{name}-", dir="/var/tmp"))
    args = ["run", "-d", "--runtime", RUNTIME, *harness.gpu_device_args(gpus)]  # ctr's --device, as Podman's
    for k, v in (annotations or {}).items():
        args += ["--annotation", f"{k}={v}"]
    args += [*_ctr_mounts(), "--mount", f"type=bind,src={status},dst=/status,options=rbind:rw",
             "--mount", f"type=bind,src={harness.HERE},dst=/work,options=rbind:ro",
             "--env", f"LD_LIBRARY_PATH={harness.DRIVER_DIR}/lib64:{harness.DRIVER_DIR}/lib",
             "--env", "PYTHONUNBUFFERED=1", harness.IMAGE, name]
    workload = [harness.PYTHON, "/work/workload.py", "1", str(gib)]
    args += ["sh", "-c", f"({beside}) & exec {' '.join(workload)}"] if beside else workload
    c.ctr(*args)
    ctr = harness.CudaContainer(name, status, 1)
    ctr.wait_running()
    return ctr.keep_seeds()


def _dev_nodes(c: PrivateContainerd, name: str) -> set[str]:
    """The GPU nodes the container's processes hold open. Not `ls /dev`: under
    containerd's default capabilities (CAP_MKNOD, which Podman drops) libcuda
    makes a node for every GPU of the host in the container's /dev, though the
    device cgroup opens only the container's (seen on 2x H200: nvidia0 and
    nvidia1 in a container given /dev/nvidia0)."""
    held = set()
    for pid in process_tree(tasks(c)[name][0]):
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    node = os.readlink(f"/proc/{pid}/fd/{fd}").removeprefix("/dev/")
                    if node.startswith("nvidia") and node[6:].isdigit():
                        held.add(node)
    return held


def _checkpoint_and_remove_task(c: PrivateContainerd, ctr: harness.CudaContainer, dest: Path) -> tuple[list[int], float]:
    """Checkpoint with exit (the GPU memory leaves with the process), then delete the task; (iterations, seconds)."""
    t0 = time.monotonic()
    with Client(c.address, c.namespace) as api:
        checkpoint_to_dir(api, ctr.name, dest, options=runc_checkpoint_options(exit_after=True))
    took = time.monotonic() - t0
    wait_status(c, ctr.name, "STOPPED", timeout=60)
    its = ctr.iterations()
    c.ctr("tasks", "delete", ctr.name)
    manifest = json.loads((dest / MANIFEST_NAME).read_text())  # the action script quiesced the GPU at pre-dump
    assert manifest["quiesced_by"] == "gpusnap" and manifest["processes"], manifest
    return its, took


def _restore(c: PrivateContainerd, ctr: harness.CudaContainer, src: Path) -> float:
    t0 = time.monotonic()
    with Client(c.address, c.namespace) as api:
        restore_from_dir(api, ctr.name, src, stdout=f"file://{ctr.status}/out.log",
                         stderr=f"file://{ctr.status}/out.log")
    wait_status(c, ctr.name, "RUNNING")
    return time.monotonic() - t0


def _cleanup_task(c: PrivateContainerd, name: str, container: bool = True) -> None:
    c.ctr("tasks", "kill", "-s", "KILL", name, check=False)
    deadline = time.monotonic() + 20
    while tasks(c).get(name, (0, "STOPPED"))[1] != "STOPPED" and time.monotonic() < deadline:
        time.sleep(0.2)
    c.ctr("tasks", "delete", name, check=False)
    if container:
        c.ctr("containers", "delete", name, check=False)


def _cleanup(c: PrivateContainerd, ctr: harness.CudaContainer) -> None:
    _cleanup_task(c, ctr.name)
    shutil.rmtree(ctr.status, ignore_errors=True)


def test_cuda_container_checkpointed_and_restored_under_the_shim(containerd, tmp_path):
    c = containerd
    ctr = _run_cuda(c, [0])
    try:
        used0, born = harness.gpu_memory_used(0), ctr.born()
        its, took = _checkpoint_and_remove_task(c, ctr, tmp_path / "ck")
        assert harness.gpu_memory_used(0) < used0 - GIB  # released with the process
        restored_in = _restore(c, ctr, tmp_path / "ck")
        ctr.assert_restored(born, its)  # every element of the 2 GiB tensor compared
        # The tensor is back on GPU 0 (the caching allocator's spare blocks need not be:
        # 7.7 GB before, 3.4 GB after on an H200)
        assert harness.gpu_memory_used(0) >= 2 * GIB
        assert _dev_nodes(c, ctr.name) == {"nvidia0"}
        print(f"shim checkpoint {took:.1f}s, restore {restored_in:.1f}s")
    finally:
        _cleanup(c, ctr)


def test_restore_onto_the_other_gpu_by_annotation(containerd, tmp_path):
    if harness.gpu_count() < 2:
        pytest.skip("needs two NVIDIA GPUs (nvidia-h200-x2)")
    c = containerd
    ctr = _run_cuda(c, [0], annotations={GPU_MAP_ANNOTATION: "0=1"})
    try:
        born = ctr.born()
        its, _ = _checkpoint_and_remove_task(c, ctr, tmp_path / "ck")
        used1 = harness.gpu_memory_used(1)
        _restore(c, ctr, tmp_path / "ck")
        ctr.assert_restored(born, its)
        assert harness.gpu_memory_used(1) - used1 >= 2 * GIB
        # The container's node follows the host numbering: libcuda opens /dev/nvidia<minor>.
        assert _dev_nodes(c, ctr.name) == {"nvidia1"}
        bundle = Path(c.server_of(ctr.name)["bundle"])
        image_dir = Path((bundle / BACKUP / "image-dir").read_text())
        plan = json.loads((image_dir / PLAN_NAME).read_text())
        assert [m["target"]["index"] for m in plan["moves"]] == [1], plan
        spec = json.loads((bundle / "config.json").read_text())
        assert [d["path"] for d in spec["linux"]["devices"] if d["path"].startswith("/dev/nvidia")
                and d["path"][11:].isdigit()] == ["/dev/nvidia1"]
    finally:
        _cleanup(c, ctr)


def test_gpusnaps_own_checkpoint_keeps_a_cuda_task_paused_from_its_rw_diff_to_its_dump(
        containerd, tmp_path):
    """ctr and nerdctl pause the task, diff its rw layer, then ask the shim to
    checkpoint; the shim thaws a CUDA task for the driver's lock, and a file
    renamed while the driver copies GPU memory out is in CRIU's images but not
    in the layer. gpusnap's client quiesces the GPU before its pause
    (ops/containerd_gpu.py): a leave-running checkpoint of a CUDA task that
    renames a file it holds open restores, and the source runs on, its GPU back."""
    c = containerd
    ctr = _run_cuda(c, [0], beside=RENAMING_HOLDER)
    copy = f"{ctr.name}-copy"
    image = f"gpusnap-test/{ctr.name}:ck"
    try:
        born, its = ctr.born(), ctr.iterations()
        mark = journal_mark()
        with Client(c.address, c.namespace) as api:
            checkpoint_container(api, ctr.name, image, exit_after=False)
            export_image(api, image, tmp_path / "ck")
        events = [e for e in journal_since(mark) if e["event"] in (
            "quiesced", "gpu-manifest-written", "resumed", "guardian-resumed")]
        assert [e["event"] for e in events] == ["quiesced", "gpu-manifest-written", "resumed"], events
        assert events[0]["before"] == "the client's pause"
        manifest = json.loads((tmp_path / "ck" / "checkpoint" / MANIFEST_NAME).read_text())
        assert manifest["processes"] and manifest["gpus"][0]["index"] == 0, manifest
        assert tasks(c)[ctr.name][1] == "RUNNING"
        ctr.wait_running(above=ctr.iterations())  # the source counts on, its GPU back
        ctr.verify()
        _cleanup_task(c, ctr.name)
        (ctr.status / "w0").unlink()  # the copy's own count, not the source's last
        with Client(c.address, c.namespace) as api:
            import_dir(api, tmp_path / "ck", copy, stdout=f"file://{ctr.status}/out.log",
                       stderr=f"file://{ctr.status}/out.log")
        ctr.assert_restored(born, its)  # the renamed file was where CRIU found it
    finally:
        _cleanup_task(c, copy)
        c.ctr("images", "rm", image, check=False)
        _cleanup(c, ctr)


def test_gpusnaps_stop_checkpoint_kills_a_cuda_task_only_once_its_image_exists(
        containerd, tmp_path):
    """`gpusnap push containerd://NS/CTR --stop`'s checkpoint: CRIU leaves the task
    paused (its GPU quiesced before the pause), the image is made, and only then
    is the task killed and thawed (a failure before that resumes it instead:
    ops/containerd_checkpoint.py). It ends STOPPED, its GPU memory freed, and the
    image restores it with every tensor equal."""
    c = containerd
    before = harness.gpu_memory_used(0)
    ctr = _run_cuda(c, [0])
    copy = f"{ctr.name}-copy"
    image = f"gpusnap-test/{ctr.name}:stop"
    try:
        born, its = ctr.born(), ctr.iterations()
        with Client(c.address, c.namespace) as api:
            checkpoint_container(api, ctr.name, image, exit_after=True)
            assert tasks(c)[ctr.name][1] == "STOPPED"  # when it returns, as runc's exit left it
            export_image(api, image, tmp_path / "ck")
        deadline = time.monotonic() + 30
        while harness.gpu_memory_used(0) > before + (256 << 20) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert harness.gpu_memory_used(0) <= before + (256 << 20), "the killed task's GPU memory"
        _cleanup_task(c, ctr.name)
        (ctr.status / "w0").unlink()  # the copy's own count, not the source's last
        with Client(c.address, c.namespace) as api:
            import_dir(api, tmp_path / "ck", copy, stdout=f"file://{ctr.status}/out.log",
                       stderr=f"file://{ctr.status}/out.log")
        ctr.assert_restored(born, its)
    finally:
        _cleanup_task(c, copy)
        c.ctr("images", "rm", image, check=False)
        _cleanup(c, ctr)


def test_a_cuda_task_checkpointed_in_nerdctls_order_and_left_running_gets_its_gpu_back(
        containerd, tmp_path):
    """nerdctl's and ctr's order: Pause, Checkpoint leaving the task running,
    Resume. The shim thaws the paused CUDA task for the driver's lock, pauses
    it again after the dump for the client, and the guardian gives its GPU
    back only after the client's Resume (requests.HELD; before, the task read
    PAUSED after the checkpoint). It reads RUNNING, counts on with its GPU
    data intact, and the checkpoint restores."""
    c = containerd
    ctr = _run_cuda(c, [0])
    try:
        born, its = ctr.born(), ctr.iterations()
        mark = journal_mark()
        with Client(c.address, c.namespace) as api:
            checkpoint_to_dir(api, ctr.name, tmp_path / "ck", exit_after=False)
        assert tasks(c)[ctr.name][1] == "RUNNING"
        ctr.wait_running(above=ctr.iterations())
        events = [e["event"] for e in journal_since(mark)]
        assert "guardian-resumed" in events and "guardian-thawed" not in events, events
        ctr.verify()
        _cleanup_task(c, ctr.name, container=False)
        (ctr.status / "w0").unlink()  # the restored task's own count, not the source's last
        _restore(c, ctr, tmp_path / "ck")
        ctr.assert_restored(born, its)
    finally:
        _cleanup(c, ctr)
