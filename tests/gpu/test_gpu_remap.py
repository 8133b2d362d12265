"""On a host with two NVIDIA GPUs: a checkpoint taken on GPU 0 restored onto GPU 1.

gpusnap restore drives unchanged `podman container restore --import`, with the
archive's spec, Podman config and CRIU /dev image rewritten in the stream and
the driver given the GPU UUID pairs.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import assert_one_line_error, gpusnap, gpusnap_json, podman
from tests.gpu import harness

GIB = 1 << 30


def _gpu_count() -> int:
    import pynvml
    pynvml.nvmlInit()
    try:
        return pynvml.nvmlDeviceGetCount()
    finally:
        pynvml.nvmlShutdown()


def _free(index: int) -> int:
    import pynvml
    pynvml.nvmlInit()
    try:
        info = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(index))
        return info.free
    finally:
        pynvml.nvmlShutdown()


@pytest.fixture(autouse=True)
def two_gpus():
    # Asked here, not at import: collection on a host without NVML must not fail.
    if _gpu_count() < 2:
        pytest.skip("needs two NVIDIA GPUs (nvidia-h200-x2)")


def _sha(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _dev_nodes(name: str) -> set[str]:
    out = podman("exec", name, "ls", "/dev").stdout.split()
    return {n for n in out if n.startswith("nvidia") and n[6:].isdigit()}


@pytest.fixture
def on_gpu0(tmp_path):
    """A CUDA container on GPU 0 (2 GiB), checkpointed, exported and removed."""
    ctr = harness.start(nproc=1, gib=2.0, gpus=[0])
    archive = tmp_path / "gpu0.tar.zst"
    gpusnap_json("checkpoint", ctr.name, "--export", str(archive))  # Podman's export, faster
    its = ctr.iterations()
    podman("rm", ctr.name)
    yield ctr, archive, its
    ctr.remove()


def _evidence(label: str) -> None:
    """nvidia-smi as a user would read it, kept with the run's logs."""
    logs = os.environ.get("GPUSNAP_TEST_LOGS")
    if logs:
        Path(logs).mkdir(parents=True, exist_ok=True)
        out = subprocess.run(["nvidia-smi"], capture_output=True, text=True).stdout
        (Path(logs) / f"nvidia-smi-{label}.txt").write_text(out)


def _restored_on_gpu1(ctr, its, used1_before: int) -> None:
    ctr.wait_running(above=its)
    ctr.verify()
    _evidence(ctr.name)
    assert harness.gpu_memory_used(1) - used1_before >= 2 * GIB
    # The container's node follows the host's numbering: libcuda opens /dev/nvidia<minor>.
    assert _dev_nodes(ctr.name) == {"nvidia1"}


def test_restore_while_gpu0_is_taken_moves_to_gpu1(on_gpu0):
    ctr, archive, its = on_gpu0
    hog = harness.hold_memory(0, max(_free(0) / GIB - 1.5, 1.0))
    try:
        plan = gpusnap_json("restore", str(archive), "--dry-run")
        assert plan["remap"] and "GPU 0 (" in plan["moves"][0] and "-> GPU 1 (" in plan["moves"][0]
        used1 = harness.gpu_memory_used(1)
        restored = gpusnap_json("restore", str(archive))
        assert restored["gpus"][0]["to"]["index"] == 1, restored
        assert restored["gpu_processes"][0]["state"] == "RUNNING"
        _restored_on_gpu1(ctr, its, used1)
    finally:
        hog.remove()


def test_plain_podman_restore_while_gpu0_is_taken_moves_to_gpu1(on_gpu0):
    """Unchanged `podman container restore --import`: the OCI hook plans GPU 1, the
    CRIU action script gives the restored container GPU 1's node and cgroup rule and
    the driver the UUID pair before the processes get their GPU state back."""
    ctr, archive, its = on_gpu0
    hog = harness.hold_memory(0, max(_free(0) / GIB - 1.5, 1.0))
    try:
        used1 = harness.gpu_memory_used(1)
        podman("container", "restore", "--import", str(archive))
        _restored_on_gpu1(ctr, its, used1)
    finally:
        hog.remove()


def test_restore_with_gpu_map_puts_it_on_gpu1(on_gpu0):
    ctr, archive, its = on_gpu0
    used1 = harness.gpu_memory_used(1)
    restored = gpusnap_json("restore", str(archive), "--gpu-map", "0=1")
    assert restored["gpus"][0]["to"]["index"] == 1
    assert "--gpu-map 0=1" in " ".join(restored["gpus"][0]["why"])
    _restored_on_gpu1(ctr, its, used1)


def test_a_map_to_a_missing_gpu_changes_nothing(on_gpu0):
    ctr, archive, _ = on_gpu0
    before = _sha(archive)
    res = gpusnap("restore", str(archive), "--gpu-map", "0=7")
    assert_one_line_error(res, "GPU 7", "nothing was changed")
    assert podman("container", "exists", ctr.name, check=False).returncode == 1
    assert _sha(archive) == before


def test_move_live_onto_gpu1_keeps_the_pids():
    ctr = harness.start(nproc=1, gib=2.0, gpus=[0])
    try:
        pids = harness.host_pids(ctr.name)
        assert_one_line_error(gpusnap("move", ctr.name, "--gpu", "0"), "already")
        plan = gpusnap_json("move", ctr.name, "--gpu", "1", "--dry-run")
        assert plan["dry_run"] and "-> GPU 1 (" in plan["moves"][0]
        its = ctr.iterations()
        used1 = harness.gpu_memory_used(1)
        moved = gpusnap_json("move", ctr.name, "--gpu", "1")
        assert moved["pids"] == pids
        _restored_on_gpu1(ctr, its, used1)
        assert harness.host_pids(ctr.name) == pids  # the same processes, now on GPU 1
        assert harness.gpu_memory_used(0) < GIB
    finally:
        ctr.remove()
