"""criu/log.py: CRIU's first real error, with what it means where gpusnap knows."""

from __future__ import annotations

from gpusnap.criu import log


def _write(tmp_path, text: str):
    path = tmp_path / "restore.log"
    path.write_text(text)
    return path


def test_timestamped_errors_count_and_the_rlimit_one_does_not(tmp_path):
    path = _write(tmp_path, "(00.000799) Error (criu/util.c:1534): rlimit: Can't setup "
                            "RLIMIT_NOFILE for self: Operation not permitted\n"
                            "(00.0123) Info nothing\n"
                            "(00.07) Error (criu/files.c:9): can't open fd 3\n"
                            "(00.08) Error (criu/cr-restore.c:1): Restoring FAILED.\n")
    assert log.first_error(path) == "Error (criu/files.c:9): can't open fd 3"


def test_a_childs_error_without_time_is_explained(tmp_path):
    path = _write(tmp_path, 'Error (criu/util.c:642): execvp("ip", ...) failed: No such file\n')
    assert log.first_error(path).endswith("(CRIU saves and restores the container's network "
                                          "namespace with ip(8): install iproute2)")


def test_a_mount_without_mapping_names_cgroups_on_a_v2_host(tmp_path, monkeypatch):
    path = _write(tmp_path, "(00.07) Error (criu/mount.c:1): mnt: No mapping for 150:(null) "
                            "mountpoint\n")
    monkeypatch.setattr(log, "_cgroup_note", lambda: "")
    assert log.first_error(path).endswith("(a mount the checkpoint holds has no counterpart here)")
    monkeypatch.undo()
    mounts = "cgroup2 /sys/fs/cgroup cgroup2 rw 0 0\n"
    monkeypatch.setattr(log.Path, "read_text", lambda self, *a, **k: mounts)
    assert "cgroup v1 host does not restore on this cgroup v2 host" in log._cgroup_note()
    mounts = "tmpfs /sys/fs/cgroup tmpfs ro 0 0\ncgroup2 /sys/fs/cgroup/unified cgroup2 rw 0 0\n"
    assert log._cgroup_note() == ""


def test_no_log_no_error(tmp_path):
    assert log.first_error(tmp_path / "missing.log") is None
