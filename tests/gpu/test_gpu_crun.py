"""CUDA containers under crun (Podman's default runtime on Fedora and RHEL).

crun hands CRIU gpusnap's configuration, and so its action script, from crun
1.26 with libcriu >= 4.2 (gpusnap/criu/runtimes.py); tests/gpu/prepare.sh
installs Debian sid's crun 1.28 and libcriu 4.2.1 for these tests. crun runs
no OCI hook at restore: the GPU comes back through the action script alone.
"""

from __future__ import annotations

import os
import shutil

import pytest

from tests.conftest import assert_one_line_error, gpusnap, gpusnap_json, podman
from tests.gpu import harness
from tests.gpu.test_gpu_checkpoint import podman_export_import

GIB = 1 << 30


@pytest.fixture
def crun_ctr():
    """A CUDA container (one process, 2 GiB) started with `podman run --runtime crun`."""
    assert shutil.which("crun"), "no crun: tests/gpu/prepare.sh installs it from the bundle's crun/ part"
    ctr = harness.start(nproc=1, gib=2.0, runtime="crun")
    yield ctr
    ctr.remove()


def _runtime(name: str) -> str:
    return podman("inspect", name, "--format", "{{.OCIRuntime}}").stdout.strip()


def test_probe_says_crun_runs_the_action_script():
    from gpusnap.criu.runtimes import crun_version, libcriu_sets_config_file, runs_action_script

    assert crun_version("crun") >= (1, 26), crun_version("crun")
    assert libcriu_sets_config_file()
    assert runs_action_script("crun")


def test_gpusnap_checkpoint_and_restore_under_crun(crun_ctr, tmp_path):
    assert _runtime(crun_ctr.name) == "crun"
    used_running = harness.gpu_memory_used()
    archive = tmp_path / "crun.tar.zst"
    result = gpusnap_json("checkpoint", crun_ctr.name, "--export", str(archive))
    assert set(result["gpu"]["timing"]) >= {"lock", "checkpoint"}, result["gpu"]
    assert used_running - harness.gpu_memory_used() >= 2 * GIB  # the GPU was freed
    info = gpusnap_json("inspect", str(archive))
    assert info["runtime"] == "crun", info.get("runtime")
    gpu = info["gpu"]
    assert gpu["quiesced_by"] == "gpusnap" and gpu["gpu_memory_bytes"] >= 2 * GIB
    podman("rm", crun_ctr.name)
    its = crun_ctr.iterations()
    restored = gpusnap_json("restore", str(archive))
    assert [p["state"] for p in restored["gpu_processes"]] == ["RUNNING"], restored
    assert _runtime(crun_ctr.name) == "crun"
    crun_ctr.wait_running(above=its)
    crun_ctr.verify()  # every element of its GPU buffers regenerated and compared


def test_plain_podman_export_import_under_crun(crun_ctr, tmp_path):
    """Unchanged Podman commands, crun driving CRIU, the action script quiescing
    (and, at restore, checking the GPUs: crun runs no hook)."""
    podman_export_import(crun_ctr, tmp_path / "plain.tar.zst")
    assert _runtime(crun_ctr.name) == "crun"


def test_leave_running_under_crun_gives_the_gpu_back(crun_ctr, tmp_path):
    archive = tmp_path / "live.tar.zst"
    gpusnap_json("checkpoint", crun_ctr.name, "--export", str(archive), "--leave-running")
    crun_ctr.wait_running(above=crun_ctr.iterations(), timeout=60)
    crun_ctr.verify()
    assert archive.stat().st_size > GIB // 2  # the checkpoint holds the GPU memory


def test_crun_that_passes_no_config_is_refused_before_anything(crun_ctr, tmp_path):
    """A crun whose libcriu predates 4.2 (as the probe would find it): one line, and
    the container, its GPU memory and its work untouched."""
    used = harness.gpu_memory_used()
    archive = tmp_path / "refused.tar.zst"
    res = gpusnap("checkpoint", crun_ctr.name, "--export", str(archive),
                  env={**os.environ, "GPUSNAP_CRUN_CONFIG": "0"})
    assert_one_line_error(res, "has CUDA processes and runs under crun", "keeps running")
    assert not archive.exists()
    assert harness.gpu_memory_used() >= used - GIB // 4
    crun_ctr.wait_running(above=crun_ctr.iterations(), timeout=60)
    crun_ctr.verify()
