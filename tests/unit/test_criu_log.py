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


def test_the_action_scripts_own_line_comes_before_crius_fallout(tmp_path):
    """The line a failed agent step leaves (packaging/bin/criu-action), as a GPU
    restore whose agent was killed mid-fill wrote it, is what the user reads."""
    path = _write(tmp_path, "(00.090738) Error (criu/util.c:1534): rlimit: Can't setup "
                            "RLIMIT_NOFILE for self: Operation not permitted\n"
                            "(00.968858) \t[/opt/gpusnap/libexec/criu-action]\n"
                            "gpusnap: post-restore: gpusnap's agent (pid 12492) stopped before it "
                            "finished; the restore stops, the checkpoint is unchanged: restore it "
                            "again\n"
                            "(01.477726) Error (criu/util.c:657): exited, status=1\n")
    assert log.first_error(path).startswith("post-restore: gpusnap's agent (pid 12492) stopped")


def test_a_log_cut_off_mid_way_says_criu_ended_early(tmp_path):
    assert log.ended_early(_write(tmp_path, "(00.01) Info dumping\n(00.2) Dumping pages\n"))
    assert not log.ended_early(_write(tmp_path, "(00.01) Info\n(02.1) Dumping finished successfully\n"))
    assert not log.ended_early(_write(tmp_path, "(00.01) Error (criu/x.c:1): no\n(00.02) Info\n"))
    assert not log.ended_early(tmp_path / "missing.log")


def test_a_restored_tasks_error_comes_before_restoring_failed(tmp_path):
    """A task's error carries its pid after the time (CRIU's log of a restore
    whose archive lacked a file the process held open, CI 2026-11-28)."""
    path = _write(tmp_path, "(00.052707) Error (criu/util.c:1534): rlimit: Can't setup "
                            "RLIMIT_NOFILE for self: Operation not permitted\n"
                            "(00.279865)      1: Error (criu/files-reg.c:2353): Can't open file "
                            "tmp/c.new on restore: No such file or directory\n"
                            "(00.281750) Error (criu/cr-restore.c:2331): Restoring FAILED.\n")
    assert log.first_error(path) == ("Error (criu/files-reg.c:2353): Can't open file tmp/c.new "
                                     "on restore: No such file or directory")
