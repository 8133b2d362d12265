"""The restore checks catch a restart. Every restore test ends with
assert_continued (tests/conftest.py): the restored container must run the
process that wrote the original's /tmp/born token and counted past the value
read before the checkpoint. Here the restore is replaced by what a broken one
could leave, and the check must fail.
"""

from __future__ import annotations

import pytest

from tests.conftest import (COUNTER, DEMO_IMAGE, assert_continued, born, gpusnap_json, podman,
                            read_counter, wait_counter)


def test_a_fresh_podman_run_in_place_of_the_restore_fails_the_check(counter, tmp_path):
    wait_counter(counter, 40)  # a fresh start counts from 1: far below what is read next
    before, token = read_counter(counter), born(counter)
    gpusnap_json("checkpoint", counter, "--export", str(tmp_path / "c.tar.zst"))
    podman("rm", counter)
    podman("run", "-d", "--name", counter, "--network", "none", DEMO_IMAGE, "sh", "-c", COUNTER)
    with pytest.raises(AssertionError, match="started afresh"):
        assert_continued(counter, before, token)


def test_a_restored_container_started_again_fails_the_check(counter, tmp_path):
    before, token = read_counter(counter), born(counter)
    archive = tmp_path / "c.tar.zst"
    gpusnap_json("checkpoint", counter, "--export", str(archive))
    podman("rm", counter)
    gpusnap_json("restore", str(archive))
    assert_continued(counter, before, token)  # the real restore passes
    podman("restart", "-t", "0", counter)  # its rootfs kept (/tmp/born too), its process new
    with pytest.raises(AssertionError, match="started afresh"):
        assert_continued(counter, before, token)
