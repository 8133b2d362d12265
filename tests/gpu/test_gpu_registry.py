"""A CUDA container pushed through a loopback registry and restored from it, with
the driver's copy of its GPU memory read ahead of CRIU (gpusnap/pages/dump_ahead.py):
the pushed images hold it, the container left running gets it back before the
driver restores it, and a copy restored from the registry has every element.
Needs the bundle's bench/ part (docker-registry, bcrypt) carried."""

from __future__ import annotations

import json
import os
import subprocess
import uuid

import pytest

from tests.conftest import GPUSNAP, journal_mark, journal_path, journal_since, run
from tests.gpu import harness
from tests.integration.oci_registry import PASSWORD, make_registry

@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    reg = make_registry(tmp_path_factory.mktemp("registry"))
    yield reg
    reg.stop()


def _last(events: list[dict], kind: str) -> dict:
    found = [e for e in events if e["event"] == kind]
    assert found, [e["event"] for e in events]
    return found[-1]


def test_migrate_reads_gpu_memory_ahead_and_the_restored_copy_has_it(cuda_ctr, registry):
    """gpusnap migrate (the container stops): the driver's copy of the GPU memory is
    read ahead of CRIU and composed into the images in place; the copy restored
    from the registry has every element. A push that leaves the container
    running is dumped by CRIU (nothing to write back before it runs on)."""
    its = cuda_ctr.wait_running()
    mark = journal_mark()
    ref = registry.ref(f"gpu/ahead-{uuid.uuid4().hex[:8]}:v1")
    env = {**os.environ, "GPUSNAP_PAGES_RAM": "1"}
    res = run([GPUSNAP, "push", cuda_ctr.name, f"{ref}-running", *registry.flags(), "--json"],
              input=PASSWORD + "\n", env=env)
    assert res.returncode == 0, (res.stdout, res.stderr)
    assert "pages-read-ahead" not in [e["event"] for e in journal_since(mark)]
    pushed = json.loads(res.stdout)  # a leave-running push says its GPUs came back, as checkpoint -R does
    assert pushed["gpu_back"] is True and pushed["gpu_back_seconds"] >= 0, pushed
    cuda_ctr.wait_running(above=its)
    cuda_ctr.verify()

    mark = journal_mark()
    res = run([GPUSNAP, "migrate", cuda_ctr.name, ref, *registry.flags(), "--json"],
              input=PASSWORD + "\n", env=env)
    assert res.returncode == 0, (res.stdout, res.stderr)
    pinned = json.loads(res.stdout)["pinned"]
    events = journal_since(mark)
    taken = _last(events, "pages-read-ahead")
    assert taken["bytes"] >= 2 << 30, taken  # the 2 GiB tensor, in the driver's copy
    assert _last(events, "pages-composed")["how"] == ["in place"]
    its = cuda_ctr.iterations()
    subprocess.run(["podman", "rm", "-f", "-t", "0", cuda_ctr.name], check=True,
                   capture_output=True)
    mark = journal_mark()
    res = run([GPUSNAP, "restore", pinned, *registry.flags(), "--json"], input=PASSWORD + "\n")
    assert res.returncode == 0, (res.stdout, res.stderr)
    cuda_ctr.wait_running(above=its)
    cuda_ctr.verify()  # every element of the restored copy compared
    # The later CRIU steps ran in the agent (gpusnap/action/agent.py), the driver
    # loaded ahead, and the OCI hook took the agent's NVML read.
    events = journal_since(mark)
    assert _last(events, "pages-filled")["by"] == "agent"
    resumed = _last(events, "resumed")
    assert (resumed["by"], resumed["driver_ahead"]) == ("agent", True), resumed
    cid = subprocess.run(["podman", "inspect", "--format", "{{.Id}}", cuda_ctr.name],
                         capture_output=True, text=True, check=True).stdout.strip()
    assignment = json.loads((journal_path().parent / "containers" / f"{cid}.json").read_text())
    assert assignment["inventory_read_by"] == "agent", assignment
    assert assignment["gpus"][0]["uuid"], assignment


def test_a_pre_copys_final_round_reads_ahead_into_the_pages_round_one_kept(cuda_ctr, registry):
    """migrate -P keeps round 1's pages file (the driver's copy of the GPU
    memory, dumped by CRIU) in RAM (gpusnap/pages/kept_pages.py); the final
    round's read-ahead writes the driver's new copy over it, and the copy
    restored from the registry has every element of the GPU data as it was
    at the final round."""
    its = cuda_ctr.wait_running()
    ref = registry.ref(f"gpu/kept-{uuid.uuid4().hex[:8]}:v1")
    env = {**os.environ, "GPUSNAP_PAGES_RAM": "1"}
    mark = journal_mark()
    res = run([GPUSNAP, "migrate", "-P", cuda_ctr.name, ref, *registry.flags(), "--json"],
              input=PASSWORD + "\n", env=env)
    assert res.returncode == 0, (res.stdout, res.stderr)
    kept = _last(journal_since(mark), "pages-kept")
    assert kept["bytes"] >= 2 << 30, kept
    its = cuda_ctr.wait_running(above=its)
    cuda_ctr.verify()  # round 1 left it running, its GPU data whole

    mark = journal_mark()
    res = run([GPUSNAP, "migrate", cuda_ctr.name, ref, *registry.flags(), "--json"],
              input=PASSWORD + "\n", env=env)
    assert res.returncode == 0, (res.stdout, res.stderr)
    pinned = json.loads(res.stdout)["pinned"]
    events = journal_since(mark)
    taken = _last(events, "pages-read-ahead")
    assert taken["reused"] >= 2 << 30, taken
    assert _last(events, "pages-composed")["how"] == ["in place"]
    # what the read found as round 1 left it, and the push took unhashed (same_pages.py)
    harness.figure(what="pre-copy final round, 2 GiB", read=taken["bytes"],
                   unchanged=taken["unchanged"],
                   unchanged_pushed=json.loads(res.stdout)["unchanged_bytes"])
    assert not os.path.exists(kept["folder"])
    its = cuda_ctr.iterations()
    subprocess.run(["podman", "rm", "-f", "-t", "0", cuda_ctr.name], check=True,
                   capture_output=True)
    res = run([GPUSNAP, "restore", pinned, *registry.flags(), "--json"], input=PASSWORD + "\n")
    assert res.returncode == 0, (res.stdout, res.stderr)
    cuda_ctr.wait_running(above=its)
    cuda_ctr.verify()
