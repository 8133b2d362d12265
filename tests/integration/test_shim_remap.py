"""Device remap at restore under the shim, through real containerd, runc and CRIU.

No GPU here, so a CPU device stands in (as in test_retarget.py): a container
given /dev/full (1:7) is checkpointed the nerdctl way and restored with that
node moved to 1:5 (/dev/zero's numbers). The shim takes the DeviceRemap from
GPUSNAP_SHIM_DEVICE_REMAP (a file, rewritten per test) and must edit the
bundle's config.json (device list, cgroup rule) and CRIU's /dev image before
`runc restore`, or the restored node and cgroup would still say 1:7. The
NVIDIA planner is reached where the checkpoint has a GPU manifest: here that
restore must be refused with one line and nothing changed.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from gpusnap import MANIFEST_NAME
from gpusnap.gpu.nodes import DeviceRemap, NodeChange
from gpusnap.ops.containerd_api import Client, ContainerdError, restore_from_dir
from gpusnap.shim.remap import BACKUP, DEVICE_REMAP_ENV
from tests.conftest import DEMO_IMAGE, foreign_h100_manifest
from tests.integration.shim_containerd import (
    RUNTIME, STAMPED_COUNTER, checkpoint_as_a_user, private_containerd, read_tmp_c, remove, tasks,
    wait_counter, wait_status)

FULL_TO_ZERO = DeviceRemap(nodes=(NodeChange("/dev/full", "/dev/full", (1, 7), (1, 5)),), container_paths="keep")


@pytest.fixture(scope="module")
def remap_file(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("remap") / "remap.json"


@pytest.fixture(scope="module")
def containerd(remap_file: Path):
    with private_containerd(env={DEVICE_REMAP_ENV: str(remap_file)}) as c:
        yield c


def _checkpointed(c, name: str, dest: Path) -> tuple[int, Path]:
    """A counter with /dev/full, checkpointed into DEST and its task deleted: (counter value, bundle)."""
    c.ctr("run", "-d", "--runtime", RUNTIME, "--device", "/dev/full", DEMO_IMAGE, name, "sh", "-c", STAMPED_COUNTER)
    wait_counter(c, name, 0)
    assert c.ctr("tasks", "exec", "--exec-id", "w0", name, "sh", "-c", "echo x > /dev/full", check=False).returncode
    before = read_tmp_c(tasks(c)[name][0])
    bundle = Path(c.server_of(name)["bundle"])
    with Client(c.address, c.namespace) as api:
        checkpoint_as_a_user(api, name, dest)
    c.ctr("tasks", "kill", "-s", "KILL", name)
    wait_status(c, name, "STOPPED")
    c.ctr("tasks", "delete", name)
    return before, bundle


def _full_rules(spec: dict) -> tuple[list, bool, bool]:
    """(/dev/full's numbers in linux.devices, cgroup allows 1:7, cgroup allows 1:5)."""
    devs = [(d["major"], d["minor"]) for d in spec["linux"]["devices"] if d["path"] == "/dev/full"]
    rules = [(r.get("major"), r.get("minor")) for r in spec["linux"]["resources"]["devices"] if r.get("allow")]
    return devs, (1, 7) in rules, (1, 5) in rules


def test_restore_moves_the_device_in_spec_cgroup_and_dev_image(containerd, remap_file: Path, tmp_path: Path):
    c = containerd
    before, bundle = _checkpointed(c, "rm1", tmp_path / "ck")
    remap_file.write_text(json.dumps(FULL_TO_ZERO.to_dict()))
    with Client(c.address, c.namespace) as api:
        pid = restore_from_dir(api, "rm1", tmp_path / "ck", stdout=f"file://{tmp_path}/out.log")
    wait_status(c, "rm1", "RUNNING")
    first = read_tmp_c(pid)
    assert before <= first < before + 50000, (before, first)  # restored, not started afresh
    listing = c.ctr("tasks", "exec", "--exec-id", "l1", "rm1", "ls", "-l", "/dev/full").stdout
    assert listing.startswith("c") and listing.split()[4:6] == ["1,", "5"], listing  # CRIU's /dev image edited
    c.ctr("tasks", "exec", "--exec-id", "w1", "rm1", "sh", "-c", "echo x > /dev/full")  # 1:5 takes writes
    assert wait_counter(c, "rm1", first) > first
    # The bundle's spec says 1:5 now; the original (1:7) is kept beside it.
    assert _full_rules(json.loads((bundle / "config.json").read_text())) == ([(1, 5)], False, True)
    assert _full_rules(json.loads((bundle / BACKUP / "config.json").read_text())) == ([(1, 7)], True, True)
    assert list((bundle / BACKUP).glob("tmpfs-dev-*.tar.gz.img"))
    # The image directory containerd unpacked (and leaves behind) goes once CRIU has read it,
    # not at Delete: a GPU task's holds GBs for as long as the task runs.
    image_dir = Path((bundle / BACKUP / "image-dir").read_text())
    deadline = time.monotonic() + 30
    while image_dir.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not image_dir.exists() and image_dir.name.startswith("ctrd-checkpoint"), image_dir
    remove(c, "rm1")


def _refused_start(c, name: str, src: Path, tmp_path: Path) -> str:
    """Restore NAME from SRC, which must fail; the one-line error."""
    with Client(c.address, c.namespace) as api:
        with pytest.raises(ContainerdError) as e:
            restore_from_dir(api, name, src, stdout=f"file://{tmp_path}/out.log")
    return str(e.value)


def test_a_remap_that_cannot_be_applied_is_refused_before_anything_changes(containerd, remap_file, tmp_path):
    c = containerd
    _, bundle = _checkpointed(c, "rm2", tmp_path / "ck")
    # /dev/null renamed onto the /dev/zero the container already has, with other numbers.
    remap_file.write_text(json.dumps(DeviceRemap(nodes=(NodeChange("/dev/null", "/dev/zero", (1, 3), (1, 7)),))
                                     .to_dict()))
    msg = _refused_start(c, "rm2", tmp_path / "ck", tmp_path)
    assert msg.startswith("Tasks.Start: cannot move the container's devices:") and "\n" not in msg, msg
    assert "/dev/zero" in msg, msg
    # Nothing was edited: no backup, the task's bundle spec still names 1:7, no plan in the image.
    assert not (bundle / BACKUP).exists()
    assert _full_rules(json.loads((bundle / "config.json").read_text())) == ([(1, 7)], True, True)
    assert tasks(c)["rm2"][1] == "CREATED"  # a failed Start leaves the created task, as runc's shim does
    c.ctr("tasks", "delete", "rm2")
    c.ctr("containers", "delete", "rm2")


def test_a_gpu_checkpoint_on_a_host_without_its_gpu_is_refused_by_the_planner(containerd, remap_file, tmp_path):
    c = containerd
    _, bundle = _checkpointed(c, "rm3", tmp_path / "ck")
    remap_file.unlink(missing_ok=True)  # no forced remap: the shim plans from the manifest
    manifest = foreign_h100_manifest()
    (tmp_path / "ck" / MANIFEST_NAME).write_text(manifest.to_json())
    msg = _refused_start(c, "rm3", tmp_path / "ck", tmp_path)
    assert msg.startswith("Tasks.Start: cannot restore here:") and "\n" not in msg, msg
    assert "io.gpusnap.gpu-map" in msg and "nothing was changed" in msg, msg
    assert _full_rules(json.loads((bundle / "config.json").read_text())) == ([(1, 7)], True, True)
    assert not (bundle / BACKUP).exists()
    c.ctr("tasks", "delete", "rm3")
    c.ctr("containers", "delete", "rm3")
