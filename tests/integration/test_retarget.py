"""The import stream rewritten for other devices, through real Podman, runc and CRIU.

No GPU here, so a CPU device stands in: the container gets /dev/full (1:7) and
is restored with that node moved to 1:5 (/dev/zero's numbers) at the same
path: the spec, Podman's config and CRIU's /dev image must all agree, or runc's
device cgroup or the restored node would still say 1:7.
"""

from __future__ import annotations

import hashlib
import subprocess
import tarfile
from pathlib import Path

import pytest

from gpusnap import PLAN_NAME
from gpusnap.errors import GpusnapError
from gpusnap.gpu.nodes import DeviceRemap, NodeChange
from gpusnap.runtime.retarget import rewrite_archive
from tests.conftest import (COUNTER, DEMO_IMAGE, GPUSNAP, assert_continued, born, gpusnap_json,
                            podman, read_counter, run, wait_counter)

FULL_TO_ZERO = DeviceRemap(nodes=(NodeChange("/dev/full", "/dev/full", (1, 7), (1, 5)),),
                           container_paths="keep")


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_restore_from_a_retargeted_stream_moves_the_device(name, tmp_path):
    podman("run", "-d", "--name", name, "--network", "none", "--device", "/dev/full",
           DEMO_IMAGE, "sh", "-c", COUNTER)
    wait_counter(name, 3)
    token = born(name)
    assert podman("exec", name, "sh", "-c", "echo x > /dev/full", check=False).returncode != 0
    archive = tmp_path / "c.tar.zst"
    gpusnap_json("checkpoint", name, "--export", str(archive))
    before = _sha(archive)
    podman("rm", "-f", "-t", "0", name)

    moved = tmp_path / "moved.tar"
    plan = {"moves": [], "note": "travels beside the manifest"}
    with open(moved, "wb") as out:
        rewrite_archive(archive, out.fileno(), FULL_TO_ZERO, plan)
    with tarfile.open(moved) as tar:
        names = tar.getnames()
    assert f"checkpoint/{PLAN_NAME}" in names
    assert names.index(f"checkpoint/{PLAN_NAME}") < names.index("checkpoint/inventory.img")

    podman("container", "restore", "--import", str(moved))
    assert_continued(name, 0, token)
    count = read_counter(name)
    listing = podman("exec", name, "ls", "-l", "/dev/full").stdout  # crw-rw-rw- ... 1,   5 ...
    assert listing.startswith("c") and listing.split()[4:6] == ["1,", "5"], listing
    # 1:5 is a zero device: writes succeed where /dev/full's fail
    podman("exec", name, "sh", "-c", "echo x > /dev/full")
    wait_counter(name, count)
    assert read_counter(name) > count
    assert _sha(archive) == before  # the export itself is never edited


def test_a_restore_that_moves_a_device_imports_through_the_rewriting_pump(name, tmp_path):
    """`gpusnap restore FILE --gpu-map`'s import, with a CPU device standing in
    for the GPU: one plan, made by the caller, handed to the import; Podman
    4.3's config-only opens get the moved config, the last the rewritten archive."""
    from gpusnap import archive as archive_files
    from gpusnap.gpu.plan import GpuSlot, Move, Plan
    from gpusnap.ops import restore as ops_restore

    podman("run", "-d", "--name", name, "--network", "none", "--device", "/dev/full",
           DEMO_IMAGE, "sh", "-c", COUNTER)
    wait_counter(name, 3)
    archive = tmp_path / "c.tar.zst"
    last, token = read_counter(name), born(name)  # before: the copy's count is at least this
    gpusnap_json("checkpoint", name, "--export", str(archive), "--leave-running")
    podman("rm", "-f", "-t", "0", name)
    plan = Plan(moves=(Move(GpuSlot(0, "GPU-a", "stand-in"), GpuSlot(1, "GPU-b", "stand-in"),
                            ("test",)),), uuid_pairs=(("GPU-a", "GPU-b"),), remap=FULL_TO_ZERO)
    contents = archive_files.read(str(archive), head_only=True)
    result = ops_restore.import_file(archive, contents, plan, None, False, False, str(archive))
    assert result["gpus"][0]["to"]["uuid"] == "GPU-b"
    assert_continued(name, last, token)
    listing = podman("exec", name, "ls", "-l", "/dev/full").stdout
    assert listing.split()[4:6] == ["1,", "5"], listing


def test_a_remap_that_cannot_be_applied_fails_without_a_valid_looking_stream(name, tmp_path):
    podman("run", "-d", "--name", name, "--network", "none", DEMO_IMAGE, "sh", "-c", COUNTER)
    wait_counter(name, 3)
    archive = tmp_path / "c.tar.zst"
    gpusnap_json("checkpoint", name, "--export", str(archive), "--leave-running")
    # /dev/null renamed onto the /dev/zero the container already has, with other numbers.
    clash = DeviceRemap(nodes=(NodeChange("/dev/null", "/dev/zero", (1, 3), (1, 7)),))
    cut = tmp_path / "x.tar"
    with open(cut, "wb") as out:
        with pytest.raises(GpusnapError) as failed:
            rewrite_archive(archive, out.fileno(), clash, None)
    assert "cannot move the devices in checkpoint/tmpfs-dev-" in failed.value.message
    assert "/dev/zero twice" in failed.value.message
    # It ends with a broken header, not an end marker: a tar reader (Go's, as in
    # Podman; GNU tar here) fails instead of taking the members before it for all.
    listing = subprocess.run(["tar", "-tf", str(cut)], capture_output=True, text=True)
    assert listing.returncode != 0, listing
    assert "Skipping to next header" in listing.stderr or \
        "does not look like a tar archive" in listing.stderr, listing


def test_a_restore_from_the_registry_that_moves_a_device_streams_the_edits(registry, name,
                                                                            cache_dir,
                                                                            monkeypatch):
    """`gpusnap restore REF --gpu-map`'s path, with a CPU device standing in for
    the GPU and the plan made by hand (no GPU here can make one): the files that
    name devices are edited once, before Podman starts, and written into the
    stream Podman imports while the chunks arrive; nothing is staged."""
    from gpusnap.gpu.plan import GpuSlot, Move, Plan
    from gpusnap.oci.registry import RegistryOptions
    from gpusnap.ops import gpu_plan, restore_ref
    from tests.integration.oci_registry import PASSWORD, USER

    podman("run", "-d", "--name", name, "--network", "none", "--device", "/dev/full",
           DEMO_IMAGE, "sh", "-c", COUNTER)
    wait_counter(name, 3)
    before, token = read_counter(name), born(name)
    ref = registry.ref(f"ckpt/moved-{name}:v1")
    run([GPUSNAP, "push", name, ref, "--stop", *registry.flags()], input=PASSWORD + "\n",
        check=True)
    podman("rm", name)
    plan = Plan(moves=(Move(GpuSlot(0, "GPU-a", "stand-in"), GpuSlot(1, "GPU-b", "stand-in"),
                            ("test",)),), uuid_pairs=(("GPU-a", "GPU-b"),), remap=FULL_TO_ZERO)
    monkeypatch.setattr(gpu_plan, "plan_here", lambda *a, **kw: plan)
    staged = set(Path("/var/tmp").glob(".gpusnap-pull-*"))

    result = restore_ref.restore(ref, None, False, False,
                                 RegistryOptions(username=USER, password=PASSWORD,
                                                 ca_file=str(registry.ca)), gpu_map="0=1")
    assert result["pull"]["streamed"], result["pull"]
    assert result["gpus"][0]["to"]["uuid"] == "GPU-b"
    assert set(Path("/var/tmp").glob(".gpusnap-pull-*")) <= staged
    assert_continued(name, before, token)
    listing = podman("exec", name, "ls", "-l", "/dev/full").stdout
    assert listing.split()[4:6] == ["1,", "5"], listing
    podman("exec", name, "sh", "-c", "echo x > /dev/full")  # 1:5 takes writes
    count = read_counter(name)
    assert wait_counter(name, count) > count
