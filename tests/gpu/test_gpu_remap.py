"""On a host with two NVIDIA GPUs: a checkpoint taken on GPU 0 restored onto GPU 1.

gpusnap restore drives unchanged `podman container restore --import`, with the
archive's spec, Podman config and CRIU /dev image rewritten in the stream and
the driver given the GPU UUID pairs.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.conftest import GPUSNAP, assert_one_line_error, gpusnap, gpusnap_json, podman, run
from tests.gpu import harness
from tests.integration.oci_registry import PASSWORD, make_registry

GIB = 1 << 30


@pytest.fixture(autouse=True)
def two_gpus():
    # Asked here, not at import: collection on a host without NVML must not fail.
    if harness.gpu_count() < 2:
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
    ctr.born_at_start = ctr.born()
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


def _restored_on_gpu1(ctr, its, used1_before: int, born: list[str] | None = None) -> None:
    ctr.assert_restored(born or ctr.born_at_start, its)
    _evidence(ctr.name)
    assert harness.gpu_memory_used(1) - used1_before >= 2 * GIB
    # The container's node follows the host's numbering: libcuda opens /dev/nvidia<minor>.
    assert _dev_nodes(ctr.name) == {"nvidia1"}


def test_restore_while_gpu0_is_taken_moves_to_gpu1(on_gpu0):
    ctr, archive, its = on_gpu0
    hog = harness.hold_memory(0, max(harness.gpu_memory_free(0) / GIB - 1.5, 1.0))
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
    hog = harness.hold_memory(0, max(harness.gpu_memory_free(0) / GIB - 1.5, 1.0))
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
        its, born = ctr.iterations(), ctr.born()
        used1 = harness.gpu_memory_used(1)
        moved = gpusnap_json("move", ctr.name, "--gpu", "1")
        assert moved["pids"] == pids
        _restored_on_gpu1(ctr, its, used1, born)
        assert harness.host_pids(ctr.name) == pids  # the same processes, now on GPU 1
        assert harness.gpu_memory_used(0) < GIB
    finally:
        ctr.remove()


# --- through a registry: a REF restored onto the other GPU, and two migrations at once ---

@pytest.fixture
def registry(tmp_path, monkeypatch):
    """A loopback registry of the test's own (docker-registry from the bundle's
    bench/ part) and a chunk cache of its own, both removed after it: a 16 GiB
    checkpoint is ~19 GB in each, and the GPU machine's disk holds a few."""
    monkeypatch.setenv("GPUSNAP_CACHE_DIR", str(tmp_path / "cache"))
    reg = make_registry(tmp_path / "registry")
    yield reg
    reg.stop()
    shutil.rmtree(tmp_path / "registry", ignore_errors=True)
    shutil.rmtree(tmp_path / "cache", ignore_errors=True)


def _gpusnap(registry, *args: str) -> dict:
    res = run([GPUSNAP, *args, *registry.flags(), "--json"], input=PASSWORD + "\n", timeout=900)
    assert res.returncode == 0, (args, res.stdout[-2000:], res.stderr[-2000:])
    return json.loads(res.stdout)


def _migrate(registry, ctr, tag: str) -> tuple[str, list[int], float]:
    """`gpusnap migrate` to a new tag: (the pinned REF, the iterations at the stop, seconds)."""
    ref = registry.ref(f"gpu/{tag}-{uuid.uuid4().hex[:8]}:v1")
    started = time.monotonic()
    pinned = _gpusnap(registry, "migrate", ctr.name, ref)["pinned"]
    seconds = time.monotonic() - started
    its = ctr.iterations()
    podman("rm", "-f", "-t", "0", ctr.name)
    return pinned, its, seconds


def _restore(registry, ref: str, *args: str) -> tuple[dict, float]:
    started = time.monotonic()
    result = _gpusnap(registry, "restore", ref, *args)
    return result, time.monotonic() - started


@pytest.mark.timeout(600)
@pytest.mark.parametrize("gib", [1, 16])
def test_restore_ref_onto_gpu1_with_every_tensor_compared(registry, gib, monkeypatch):
    """`gpusnap restore REF --gpu-map 0=1` (the path that hung), streamed as a
    restore with no map is, the files that name devices edited on the way;
    beside the same REF restored with no map. Each restore continues the same
    workers with every element compared."""
    # Like for like: the first restore would keep its pages in RAM for the next
    # (pages/prepared_pages.keep), and the second, linking them, would look faster.
    monkeypatch.setenv("GPUSNAP_KEEP_PAGES", "0")
    ctr = harness.start(nproc=1, gib=gib, gpus=[0])
    try:
        born = ctr.born()
        pinned, its, migrate_s = _migrate(registry, ctr, f"remap{gib}")
        _, plain_s = _restore(registry, pinned)
        ctr.assert_restored(born, its)
        assert _dev_nodes(ctr.name) == {"nvidia0"}
        podman("rm", "-f", "-t", "0", ctr.name)  # the REF is still there to restore

        used1 = harness.gpu_memory_used(1)
        moved, remap_s = _restore(registry, pinned, "--gpu-map", "0=1")
        assert moved["gpus"][0]["to"]["index"] == 1, moved
        assert moved["pull"]["streamed"], moved["pull"]
        assert moved["gpu_processes"][0]["state"] == "RUNNING"
        ctr.assert_restored(born, its)  # the REF's state again, from the same workers
        assert _dev_nodes(ctr.name) == {"nvidia1"}
        assert harness.gpu_memory_used(1) - used1 >= gib * GIB
        assert harness.gpu_memory_used(0) < GIB
        _evidence(f"{ctr.name}-remap{gib}")
        harness.figure(what="restore REF onto GPU 1", gib=gib, migrate_s=round(migrate_s, 2),
                       restore_no_map_s=round(plain_s, 2), restore_gpu_map_s=round(remap_s, 2),
                       ratio=round(remap_s / plain_s, 2))
    finally:
        ctr.remove()


@pytest.mark.timeout(600)
def test_two_containers_one_per_gpu_migrate_at_once(registry):
    """Two 8 GiB containers, one on each GPU, migrated through the registry and
    restored at the same time, against the same two one after the other."""
    ctrs = [harness.start(nproc=1, gib=8.0, gpus=[i], name=f"gpusnap-two{i}-{uuid.uuid4().hex[:6]}")
            for i in (0, 1)]
    try:
        born = [c.born() for c in ctrs]
        started = time.monotonic()
        for c, b in zip(ctrs, born):  # one after the other
            pinned, its, _ = _migrate(registry, c, "one")
            _restore(registry, pinned)
            c.assert_restored(b, its)
        sequential_s = time.monotonic() - started

        started = time.monotonic()
        with ThreadPoolExecutor(2) as pool:
            migrated = list(pool.map(lambda c: _migrate(registry, c, "both"), ctrs))
            list(pool.map(lambda m: _restore(registry, m[0]), migrated))
        together_s = time.monotonic() - started
        for c, b, (_, its, _) in zip(ctrs, born, migrated):
            c.assert_restored(b, its)
        assert [_dev_nodes(c.name) for c in ctrs] == [{"nvidia0"}, {"nvidia1"}]
        harness.figure(what="two 8 GiB containers, one per GPU, migrate + restore REF",
                       sequential_s=round(sequential_s, 2), together_s=round(together_s, 2),
                       ratio=round(together_s / sequential_s, 2))
    finally:
        for c in ctrs:
            c.remove()
