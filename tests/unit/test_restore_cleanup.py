"""ops/restore.py: an import Podman failed, whose half-created container cannot
be removed either, still says why the import failed first (a coldstart run on an
H200 reported only "podman rm ...: unlinkat ... io.pressure"), then what is left."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest

from gpusnap.errors import GpusnapError
from gpusnap.gpu.plan import Plan
from gpusnap.ops import restore
from gpusnap.runtime.stream import ImportStream
from gpusnap.runtime import podman


def _container(tmp_path: Path) -> podman.Container:
    (tmp_path / "userdata").mkdir()
    (tmp_path / "userdata" / "restore.log").write_text("(00.1) Error (criu/cr-restore.c:1): boom\n")
    return podman.Container(id="c0ffee", name="r2-1", status="created", pid=0, image="img",
                            checkpointed=False, userdata=tmp_path / "userdata", devices=[])


def _failed_import(tmp_path: Path, source: str) -> GpusnapError:
    """The error of an import of r2-1 from ``source`` that Podman failed."""
    contents = type("C", (), {"json_file": lambda self, n: {"name": "r2-1"}})()
    with pytest.raises(GpusnapError) as err:
        restore.import_archive(contextlib.nullcontext(ImportStream(tmp_path / "fifo")), contents,
                               Plan([], [], False), "r2-1", False, False, source)
    return err.value


def test_the_import_error_comes_first_and_the_leftover_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUSNAP_STATE_DIR", str(tmp_path / "state"))

    def failed_restore(*a, **k):
        raise GpusnapError("podman container restore failed: CRIU restore failed")

    def stuck(name):
        raise GpusnapError(f"podman rm {name}: unlinkat .../io.pressure: operation not permitted")

    monkeypatch.setattr(podman, "restore", failed_restore)
    monkeypatch.setattr(podman, "find", lambda name: _container(tmp_path))
    monkeypatch.setattr(podman, "remove", stuck)
    error = _failed_import(tmp_path, "REF")
    msg = error.message
    assert msg.startswith("podman container restore failed: CRIU restore failed"), msg
    assert "CRIU's log is kept in" in msg and "boom" in msg
    assert "the half-restored container r2-1 is left" in msg and "podman rm -f r2-1" in msg


def test_a_criu_killed_mid_restore_is_named_with_its_first_error(tmp_path, monkeypatch):
    """runc's 'read unixpacket: EOF' means CRIU died (on a GPU it dies with the
    restored processes: runc moved it into their cgroup); the line says so, with
    CRIU's own first error where its log has one, and to run the restore again."""
    monkeypatch.setenv("GPUSNAP_STATE_DIR", str(tmp_path / "state"))

    def died(*a, **k):
        raise GpusnapError("podman container restore: OCI runtime error: runc: read unixpacket @->@: EOF")

    monkeypatch.setattr(podman, "restore", died)
    monkeypatch.setattr(podman, "find", lambda name: _container(tmp_path))
    monkeypatch.setattr(podman, "remove", lambda name: None)
    error = _failed_import(tmp_path, "ARCHIVE")
    msg = error.message
    assert msg.startswith("CRIU stopped before the restore of r2-1 was complete"), msg
    assert "boom" in msg and "unixpacket" not in msg and "ARCHIVE is unchanged" in msg
    assert error.hint == "the checkpoint needs nothing: run the same restore again"


def test_a_restore_that_met_a_full_disk_says_so_where_crius_log_could_not(tmp_path, monkeypatch):
    """A GPU fault run filled the disk under a restore: CRIU's log ended mid-way, its
    copy failed, and the line said only Podman's "log file: PATH", a file removed
    with the container. The disk's state is read before the container goes."""
    import errno

    from gpusnap import journal
    from gpusnap.partial import disk_full
    monkeypatch.setenv("GPUSNAP_STATE_DIR", str(tmp_path / "state"))
    ctr = _container(tmp_path)
    (ctr.userdata / "restore.log").write_text("(00.05) Collecting 46/69 (flags 0)\n")  # cut

    def vague(*a, **k):
        raise GpusnapError(f"podman container restore: log file: {ctr.userdata}/restore.log")

    def no_room(log, verb, container):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(podman, "restore", vague)
    monkeypatch.setattr(podman, "find", lambda name: ctr)
    monkeypatch.setattr(podman, "remove", lambda name: None)
    monkeypatch.setattr(journal, "copy_log", no_room)
    monkeypatch.setattr(restore, "full_at", lambda folder: disk_full(folder / "-")
                        if folder == ctr.userdata else "")
    error = _failed_import(tmp_path, "REF")
    msg = error.message
    assert msg.startswith(f"podman container restore: the disk is full (No space left on device "
                          f"in {ctr.userdata})"), msg
    assert "CRIU's log could not be kept: No space left on device in " in msg, msg
    assert msg.endswith("nothing was restored, REF is unchanged"), msg


def test_full_at_says_a_filesystem_without_room_is_full(tmp_path, monkeypatch):
    import os

    from gpusnap import partial
    assert partial.full_at(tmp_path) == ""  # the test's own disk has room
    room = os.statvfs(tmp_path)
    monkeypatch.setattr(partial.os, "statvfs", lambda p: type("S", (), {
        "f_bfree": 3, "f_frsize": room.f_frsize})())
    assert partial.full_at(tmp_path) == f"the disk is full (No space left on device in {tmp_path})"
    assert partial.full_at(tmp_path / "gone") != ""  # statvfs is asked, not the folder


def test_a_refusal_of_gpusnaps_hook_is_said_in_its_own_words(tmp_path, monkeypatch):
    """G9 on two H200s (2026-11-29): the OCI hook refused a GPU taken after the
    plan, and the line carried runc's and CRIU's wrapping around its words."""
    import subprocess

    monkeypatch.setenv("GPUSNAP_STATE_DIR", str(tmp_path / "state"))
    ctr = _container(tmp_path)
    (ctr.userdata / "restore.log").write_text(
        "(00.07) Error (criu/action-scripts.c:156): One of more action scripts failed\n")
    said = ("gpusnap: cannot restore here: GPU 1 here has 4.0 GiB free, GPU 0 of the "
            "checkpoint's processes used 9.1 GiB (override: GPUSNAP_SKIP_CHECKS=memory)")
    stderr = ("Error: OCI runtime error: runc: error running hook #0: error running hook: "
              f"exit status 1, stdout: , stderr: {said}\n")
    monkeypatch.setattr(podman, "_run", lambda *a, **k: subprocess.CompletedProcess(
        a, 125, "", stderr))
    monkeypatch.setattr(podman, "find", lambda name: ctr)
    monkeypatch.setattr(podman, "remove", lambda name: None)
    error = _failed_import(tmp_path, "ARCHIVE")
    msg = error.message
    assert msg.startswith("podman container restore: gpusnap's OCI hook: cannot restore here: "
                          "GPU 1 here has 4.0 GiB free"), msg
    assert "runc" not in msg and "action scripts" not in msg, msg
    assert "CRIU's log is kept in" in msg and "ARCHIVE is unchanged" in msg


def test_a_local_restore_podman_failed_says_what_crius_log_says(tmp_path, monkeypatch):
    """A restore of a container's own checkpoint that Podman failed with only
    "log file: PATH" (CI, 2026-12-01: nothing to tell why) says CRIU's first
    error, and where a copy of its log is kept."""
    monkeypatch.setenv("GPUSNAP_STATE_DIR", str(tmp_path / "state"))
    ctr = _container(tmp_path)

    def vague(*a, **k):
        raise GpusnapError(f"podman container restore: log file: {ctr.userdata}/restore.log",
                           "`gpusnap inspect` shows what the checkpoint needs")

    monkeypatch.setattr(podman, "restore", vague)
    monkeypatch.setattr(podman, "find", lambda name: ctr)
    contents = type("C", (), {"manifest": None, "sizes": {}})()
    with pytest.raises(GpusnapError) as err:
        restore.restore_local("r2-1", contents, Plan([], [], False), False, False)
    msg = err.value.message
    assert msg.startswith("podman container restore: ") and "boom" in msg, msg
    assert "CRIU's log is kept in" in msg and "log file:" not in msg, msg
    assert err.value.hint == "`gpusnap inspect` shows what the checkpoint needs"


def _stranger(tmp_path: Path, created: str) -> podman.Container:
    ctr = _container(tmp_path)
    ctr.status, ctr.created = "exited", created
    return ctr


def test_a_container_that_took_the_name_meanwhile_is_never_removed(tmp_path, monkeypatch):
    # The name was free when the restore began; a container made under it while
    # the checkpoint downloaded is someone else's, whatever Podman then said.
    monkeypatch.setenv("GPUSNAP_STATE_DIR", str(tmp_path / "state"))
    removed = []
    monkeypatch.setattr(podman, "remove", lambda name, **k: removed.append(name))
    monkeypatch.setattr(podman, "find", lambda name: _stranger(tmp_path, "2020-01-01T00:00:00.5Z"))
    for said in ("the container name \"r2-1\" is already in use by c0ffee. You have to remove that "
                 "container to be able to reuse that name: that name is already in use",
                 "CRIU restore failed"):
        def failed_restore(*a, said=said, **k):
            raise GpusnapError(f"podman container restore failed: {said}")
        monkeypatch.setattr(podman, "restore", failed_restore)
        _failed_import(tmp_path, "REF")
    assert removed == []


def test_ctrl_c_during_the_import_removes_what_podman_half_made(tmp_path, monkeypatch):
    import time
    from datetime import datetime, timezone

    monkeypatch.setenv("GPUSNAP_STATE_DIR", str(tmp_path / "state"))
    removed = []
    monkeypatch.setattr(podman, "remove", lambda name, **k: removed.append(name))
    now = datetime.fromtimestamp(time.time(), timezone.utc).isoformat()
    monkeypatch.setattr(podman, "find", lambda name: _stranger(tmp_path, now))

    def interrupted(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(podman, "restore", interrupted)
    contents = type("C", (), {"json_file": lambda self, n: {"name": "r2-1"}})()
    with pytest.raises(KeyboardInterrupt):
        restore.import_archive(contextlib.nullcontext(ImportStream(tmp_path / "fifo")), contents,
                               Plan([], [], False), "r2-1", False, False, "REF")
    assert removed == ["r2-1"]


@pytest.mark.parametrize("created", ["2026-12-01T18:26:21.092364953Z",
                                     "2026-12-01T19:26:21.092364953+01:00"])
def test_podmans_creation_time_is_read_in_every_form_it_takes(tmp_path, created):
    from datetime import datetime

    ctr = _container(tmp_path)
    ctr.created = created
    at = datetime.fromisoformat("2026-12-01T18:26:21.092364+00:00").timestamp()
    assert ctr.made_before(at + 1) and not ctr.made_before(at - 1)
