"""The RPC sequence of `nerdctl checkpoint create` and `nerdctl start --checkpoint`, through containerd's API.

nerdctl is not installable here; gpusnap.ops.containerd_api makes the calls its
Go client makes (leases, Containers.Get, Tasks.Pause/Checkpoint/Resume,
Content.Write/Read, Images.Create/Delete, Snapshots.Mounts, Tasks.Create with
a checkpoint descriptor, Tasks.Start) against a private containerd 1.7 whose
container runs under io.containerd.gpusnap.v1.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from gpusnap.ops.containerd_api import (
    CHECKPOINT_CONFIG_MEDIA, CHECKPOINT_MEDIA, Client, ContainerdError, checkpoint_to_dir, nerdctl_options,
    restore_from_dir, runc_checkpoint_options)
from tests.conftest import DEMO_IMAGE
from tests.integration.shim_containerd import (
    RUNTIME, STAMPED_COUNTER, binary_log_uri, checkpoint_as_a_user, private_containerd, read_tmp_c, remove,
    tasks, wait_counter, wait_status)


@pytest.fixture(scope="module")
def containerd():
    with private_containerd() as c:
        yield c


def test_nerdctl_options_reach_runc_v2_only():
    # nerdctl's withCheckpointOpts: CheckpointOptions{exit} for io.containerd.runc.v2, nothing otherwise.
    assert nerdctl_options(RUNTIME, exit_after=True) is None
    opts = nerdctl_options("io.containerd.runc.v2", exit_after=True)
    assert opts.type_url == "containerd.runc.v1.CheckpointOptions" and opts.value == b"\x08\x01"


def test_checkpoint_create_then_start_checkpoint_continues(containerd, tmp_path: Path):
    c = containerd
    c.ctr("run", "-d", "--runtime", RUNTIME, DEMO_IMAGE, "nc1", "sh", "-c", STAMPED_COUNTER)
    wait_counter(c, "nc1", 0)
    before = read_tmp_c(tasks(c)["nc1"][0])
    images_before = set(c.ctr("images", "ls", "-q").stdout.split())
    dest = tmp_path / "checkpoints" / "ck1"
    dest.parent.mkdir()
    with Client(c.address, c.namespace) as api:
        descs = checkpoint_as_a_user(api, "nc1", dest)
        assert [d.media_type for d in descs] == [CHECKPOINT_MEDIA, CHECKPOINT_CONFIG_MEDIA]
        assert (dest / "inventory.img").is_file() and list(dest.glob("pages-*.img")), sorted(dest.iterdir())
        # nerdctl sent no options (not runc.v2): the task is resumed, as with --leave-running.
        assert tasks(c)["nc1"][1] == "RUNNING"
        assert set(c.ctr("images", "ls", "-q").stdout.split()) == images_before  # its index image is deleted
        with pytest.raises(ContainerdError, match="already exists"):
            checkpoint_to_dir(api, "nc1", dest)

        c.ctr("tasks", "kill", "-s", "KILL", "nc1")
        wait_status(c, "nc1", "STOPPED")
        c.ctr("tasks", "delete", "nc1")
        time.sleep(1.0)  # a fresh start would now stamp a later second
        blobs = set(c.ctr("content", "ls", "-q").stdout.split())
        log_uri = binary_log_uri(tmp_path, "nc1")  # nerdctl's own logging is a binary:// URI
        pid = restore_from_dir(api, "nc1", dest, stdout=log_uri, stderr=log_uri)
    wait_status(c, "nc1", "RUNNING")
    assert tasks(c)["nc1"][0] == pid > 0
    assert (tmp_path / "nc1.env").read_text().split()[:2] == ["nc1", c.namespace]  # its logger runs
    first = read_tmp_c(pid)
    assert before <= first < before + 50000, (before, first)
    assert wait_counter(c, "nc1", first) > first  # and it keeps counting
    # The re-tarred checkpoint blob is gone again, as nerdctl deletes it after Create.
    assert set(c.ctr("content", "ls", "-q").stdout.split()) == blobs
    remove(c, "nc1")


def test_checkpoint_with_exit_stops_the_task_and_restores(containerd, tmp_path: Path):
    # What nerdctl sends io.containerd.runc.v2 without --leave-running (and the GPU test uses).
    c = containerd
    c.ctr("run", "-d", "--runtime", RUNTIME, DEMO_IMAGE, "nc2", "sh", "-c", STAMPED_COUNTER)
    wait_counter(c, "nc2", 0)
    pid = tasks(c)["nc2"][0]
    before = read_tmp_c(pid)
    with Client(c.address, c.namespace) as api:
        checkpoint_as_a_user(api, "nc2", tmp_path / "ck", options=runc_checkpoint_options(exit_after=True))
        wait_status(c, "nc2", "STOPPED")
        assert not Path(f"/proc/{pid}").exists()
        c.ctr("tasks", "delete", "nc2")
        new_pid = restore_from_dir(api, "nc2", tmp_path / "ck", stdout=f"file://{tmp_path}/out.log")
    wait_status(c, "nc2", "RUNNING")
    first = read_tmp_c(new_pid)
    assert before <= first < before + 50000, (before, first)
    assert wait_counter(c, "nc2", first) > first
    remove(c, "nc2")


def test_start_checkpoint_of_a_non_checkpoint_dir_is_one_line(containerd, tmp_path: Path):
    with Client(containerd.address, containerd.namespace) as api:
        with pytest.raises(ContainerdError) as e:
            restore_from_dir(api, "nosuch", tmp_path)
    assert str(e.value) == f"{tmp_path} holds no CRIU image (no inventory.img)"
