"""A local checkpoint kept aside where post-resume failed (runtime/kept_checkpoint.py):
Podman's restore without --keep removes its checkpoint once runc returns, and
driver 580 refuses for good a process whose restore it once refused. The real
Podman half is in tests/integration/test_checkpoint_restore.py; the GPU
half, G15 (tests/gpu/test_gpu_faults.py)."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from gpusnap import MANIFEST_NAME, journal
from gpusnap.action import action
from gpusnap.errors import GpusnapError
from gpusnap.gpu.cuda import ProcessState
from gpusnap.ops import doctor, leftovers, restore as ops_restore
from gpusnap.pages import fill_plan
from gpusnap.runtime import kept_checkpoint as kc, podman
from tests.unit.fakes import FakeDriver
from tests.unit.fakes import UUID0, gpu
from tests.unit.test_plan import manifest
from tests.unit.test_post_resume import CRIU, TRAIN


@pytest.fixture
def userdata(tmp_path, monkeypatch) -> Path:
    """A Podman container's userdata, as a restore without --keep finds it."""
    monkeypatch.setenv("GPUSNAP_STATE_DIR", str(tmp_path / "state"))
    ud = tmp_path / "storage/overlay-containers/c0ffee/userdata"
    (ud / "checkpoint/sub").mkdir(parents=True)
    (ud / "config.json").write_text("{}")
    (ud / "checkpoint/inventory.img").write_bytes(b"inv")
    (ud / "checkpoint/pages-1.img").write_bytes(b"p" * 4096)
    (ud / "checkpoint/sub/x").write_text("x")
    (ud / "checkpoint/pages-2.img").symlink_to(tmp_path / "elsewhere")
    (ud / "devshm-checkpoint.tar").write_bytes(b"shm")
    (ud / "network.status").write_text("[]")
    return ud


def _podman_drops(ud: Path) -> None:
    """What Podman's restore without --keep removes once runc returns."""
    podman.drop_checkpoint(SimpleNamespace(userdata=ud))


def test_kept_files_are_the_same_files_and_come_back_where_podman_looks(userdata):
    inode = (userdata / "checkpoint/pages-1.img").stat().st_ino
    aside = kc.keep_aside(userdata / "checkpoint", "CUDA_ERROR_OUT_OF_MEMORY")
    assert aside == userdata / kc.KEPT_NAME
    assert (aside / "checkpoint/pages-1.img").stat().st_ino == inode  # a link, not a copy
    assert os.readlink(aside / "checkpoint/pages-2.img") == str(userdata.parent.parent.parent.parent
                                                                / "elsewhere")
    _podman_drops(userdata)
    assert kc.why_kept(userdata)["why"] == "CUDA_ERROR_OUT_OF_MEMORY"
    assert kc.put_back(userdata)
    assert (userdata / "checkpoint/pages-1.img").read_bytes() == b"p" * 4096
    assert (userdata / "checkpoint/sub/x").read_text() == "x"
    assert (userdata / "checkpoint/pages-2.img").is_symlink()
    assert (userdata / "devshm-checkpoint.tar").read_bytes() == b"shm"
    assert (userdata / "network.status").exists()
    assert not (userdata / kc.KEPT_NAME).exists() and not (userdata / kc.WHY_NAME).exists()
    assert kc.why_kept(userdata) is None and not kc.put_back(userdata)


def test_put_back_replaces_what_a_later_incomplete_dump_left(userdata):
    kc.keep_aside(userdata / "checkpoint", "refused")
    _podman_drops(userdata)
    (userdata / "checkpoint").mkdir()
    (userdata / "checkpoint/core-1.img").write_bytes(b"half")  # no inventory.img: incomplete
    (userdata / "dump.log").write_text("later")
    assert kc.put_back(userdata)
    assert sorted(p.name for p in (userdata / "checkpoint").iterdir()) == \
        ["inventory.img", "pages-1.img", "pages-2.img", "sub"]
    assert (userdata / "dump.log").read_text() == "later"  # only what was kept is put back


def test_only_a_podman_containers_own_complete_checkpoint_is_kept(tmp_path, userdata):
    bare = tmp_path / "images"
    bare.mkdir()
    (bare / "inventory.img").write_bytes(b"inv")
    assert kc.keep_aside(bare, "x") is None  # containerd, CRIU by hand
    (userdata / "config.json").unlink()
    assert kc.keep_aside(userdata / "checkpoint", "x") is None
    (userdata / "config.json").write_text("{}")
    (userdata / "checkpoint/inventory.img").unlink()
    assert kc.keep_aside(userdata / "checkpoint", "x") is None
    assert not (userdata / kc.KEPT_NAME).exists()


def test_a_link_that_fails_leaves_nothing_half_made_and_is_journaled(userdata, monkeypatch):
    link, calls = os.link, []

    def failing(*args, **kw):
        calls.append(args)
        if len(calls) == 2:
            raise OSError(18, "Invalid cross-device link")
        return link(*args, **kw)

    monkeypatch.setattr(os, "link", failing)
    kc.after_failed_resume(str(userdata / "checkpoint"), "refused")
    assert sorted(p.name for p in userdata.iterdir()) == \
        ["checkpoint", "config.json", "devshm-checkpoint.tar", "network.status"]
    (rec,) = [e for e in journal.read() if e["event"] == "checkpoint-not-kept"]
    assert "cross-device" in rec["error"]


def test_a_later_keep_replaces_an_older_and_a_restore_that_held_drops_it(userdata):
    kc.keep_aside(userdata / "checkpoint", "first")
    (userdata / "checkpoint/inventory.img").unlink()
    (userdata / "checkpoint/inventory.img").write_bytes(b"newer")
    kc.keep_aside(userdata / "checkpoint", "second")
    assert kc.why_kept(userdata)["why"] == "second"
    assert (userdata / kc.KEPT_NAME / "checkpoint/inventory.img").read_bytes() == b"newer"
    assert [k["container"] for k in kc.found(userdata.parents[2])] == ["c0ffee"]
    kc.after_resume(str(userdata / "checkpoint"))
    assert kc.why_kept(userdata) is None and kc.found(userdata.parents[2]) == []
    assert [e["event"] for e in journal.read()] == ["kept-checkpoint-dropped"]


def test_a_failed_post_resume_keeps_the_checkpoint_podman_drops_next(userdata, tmp_path,
                                                                     monkeypatch):
    """CRIU names its images folder by a /proc fd of its own, closed by
    post-resume: pre-restore's resolved path is the one used."""
    (userdata / "checkpoint" / MANIFEST_NAME).write_text(
        manifest(gpu(0, UUID0), used={UUID0: 8 << 30}).to_json())
    monkeypatch.setattr(fill_plan, "SETTINGS", tmp_path / "page-fill.json")
    fill_plan.SETTINGS.write_text('{"enabled": false, "read_ahead": false}')
    fd = os.open(userdata / "checkpoint", os.O_RDONLY)
    try:
        action.pre_restore(f"/proc/self/fd/{fd}", CRIU, action.fill_settings())
    finally:
        os.close(fd)
    monkeypatch.setenv("GPUSNAP_WAIT_RESUME_SETTLE", "0.2")
    monkeypatch.setenv("CRTOOLS_INIT_PID", "70")
    monkeypatch.setenv("CRTOOLS_IMAGE_DIR", f"/proc/self/fd/{fd}")
    monkeypatch.setattr(action, "cuda_processes", lambda pid: TRAIN)
    driver = FakeDriver({77: ProcessState.CHECKPOINTED},
                        fail={("restore", 77): "CUDA_ERROR_OUT_OF_MEMORY"})
    assert action._run("post-resume", CRIU, driver=driver) == 1
    _podman_drops(userdata)
    (rec,) = [e for e in journal.read() if e["event"] == "checkpoint-kept"]
    assert "CUDA_ERROR_OUT_OF_MEMORY" in rec["why"] and kc.why_kept(userdata) is not None
    # the same restore, the driver answering: what an earlier failure kept goes
    driver = FakeDriver({77: ProcessState.CHECKPOINTED})
    assert action._run("post-resume", CRIU, driver=driver) == 0
    assert kc.why_kept(userdata) is None


def test_a_running_container_whose_checkpoint_was_kept_is_told_to_stop_it_first(
        userdata, monkeypatch):
    """Only while it runs the very processes the failed restore left: one started
    afresh since (another init) is not told to go back to the kept state."""
    kc.keep_aside(userdata / "checkpoint", "refused", init_pid=os.getpid())
    ctr = SimpleNamespace(name="job", userdata=userdata, running=True, pid=os.getpid(),
                          checkpoint_dir=userdata / "checkpoint")
    monkeypatch.setattr(podman, "exists", lambda name: True)
    monkeypatch.setattr(podman, "inspect", lambda name: ctr)
    with pytest.raises(GpusnapError, match="job is running; there is nothing to restore") as err:
        ops_restore.run("job", None, keep=False, tcp_established=False)
    assert "`podman stop -t 0 job`, then `gpusnap restore job`" in err.value.hint
    ctr.pid = os.getppid()
    with pytest.raises(GpusnapError) as err:
        ops_restore.run("job", None, keep=False, tcp_established=False)
    assert not err.value.hint
    assert kc.why_kept(userdata) is not None


def test_a_put_back_cut_short_is_still_found_and_finished(userdata, monkeypatch):
    kc.keep_aside(userdata / "checkpoint", "refused")
    _podman_drops(userdata)
    rename, moved = os.rename, []

    def cut(src, dst):
        if Path(src).name == "checkpoint":
            raise OSError(28, "No space left on device")
        moved.append(Path(src).name)
        return rename(src, dst)

    monkeypatch.setattr(os, "rename", cut)
    with pytest.raises(OSError):
        kc.put_back(userdata)
    assert sorted(moved) == ["devshm-checkpoint.tar", "network.status"]  # the folder last
    assert kc.why_kept(userdata) is not None  # still there for a rerun
    monkeypatch.setattr(os, "rename", rename)
    assert kc.put_back(userdata) and (userdata / "checkpoint/inventory.img").is_file()


def test_a_put_back_that_fails_is_one_line_saying_where_the_copy_is(userdata, monkeypatch):
    kc.keep_aside(userdata / "checkpoint", "refused")

    def full(*a):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(kc, "put_back", full)
    ctr = SimpleNamespace(name="job", id="c0ffee", userdata=userdata)
    with pytest.raises(GpusnapError, match="still in .*gpusnap-kept-checkpoint") as err:
        ops_restore._put_back(ctr, {"why": "refused"})
    assert "gpusnap restore job" in err.value.hint


def test_a_kept_copy_reads_podmans_config_from_userdata(userdata):
    (userdata / "config.dump").write_text('{"name": "job"}')
    kc.keep_aside(userdata / "checkpoint", "refused")
    _podman_drops(userdata)
    ctr = SimpleNamespace(name="job", userdata=userdata)
    contents = ops_restore._kept_contents(ctr)
    assert contents.json_file("config.dump") == {"name": "job"}
    assert "checkpoint/inventory.img" in contents.sizes


def test_a_copy_sharing_a_checkpoint_podman_kept_goes_before_a_dump_rewrites_it(userdata):
    kc.keep_aside(userdata / "checkpoint", "refused")  # Podman kept its own (--keep)
    kc.before_dump(str(userdata / "checkpoint"))
    assert kc.why_kept(userdata) is None
    kc.keep_aside(userdata / "checkpoint", "refused")
    _podman_drops(userdata)  # the only copy now: a dump writes new files beside it
    (userdata / "checkpoint").mkdir()
    kc.before_dump(str(userdata / "checkpoint"))
    assert kc.why_kept(userdata) is not None


def test_a_fresh_start_gives_the_kept_state_up(userdata):
    kc.keep_aside(userdata / "checkpoint", "refused")
    kc.at_create(userdata)
    assert kc.why_kept(userdata) is None
    assert [e["why"] for e in journal.read()] == ["the container was started afresh"]


def test_a_damaged_note_still_names_the_kept_copy(userdata):
    kc.keep_aside(userdata / "checkpoint", "refused")
    (userdata / kc.KEPT_NAME / kc.WHY_NAME).write_text("[1, 2]")
    assert kc.why_kept(userdata) == {"why": "unknown", "at": None}
    assert kc.found(userdata.parents[2])[0]["why"] == "unknown"


def test_doctor_tells_a_needed_copy_from_one_whose_container_runs_again(userdata, monkeypatch):
    kc.keep_aside(userdata / "checkpoint", "refused", init_pid=os.getpid())
    ctr = SimpleNamespace(name="job", running=False, pid=0)
    monkeypatch.setattr(podman, "find", lambda cid: ctr)
    check = doctor._kept_aside_check(userdata.parents[2], [], fix=False)
    assert check.level == "warning" and check.detail.startswith("job: refused")
    assert "`gpusnap restore NAME`" in check.fix
    ctr.running, ctr.pid = True, os.getpid()  # the same processes, none stuck: back on the GPU
    check = doctor._kept_aside_check(userdata.parents[2], [], fix=False)
    assert "job: runs on its GPU again" in check.detail and "--fix" in check.fix
    stuck = [{"pid": os.getpid()}]
    assert doctor._kept_aside_check(userdata.parents[2], stuck, fix=True).detail.startswith(
        "job: refused")  # still off its GPU: never dropped
    check = doctor._kept_aside_check(userdata.parents[2], [], fix=True)
    assert check.ok and "dropped job's" in check.detail and kc.why_kept(userdata) is None


def _kept_with_pages_elsewhere(tmp_path: Path, userdata: Path) -> Path:
    """A checkpoint kept aside whose pages link (relative, another filesystem's
    way) into a restore's staging folder; the folder."""
    staging = tmp_path / "storage" / ".gpusnap-pull-abc"
    staging.mkdir()
    (staging / "pages-3.img").write_bytes(b"p")
    rel = os.path.relpath(staging / "pages-3.img", userdata / "checkpoint")
    (userdata / "checkpoint/pages-3.img").symlink_to(rel)
    kc.keep_aside(userdata / "checkpoint", "refused")
    return staging


def test_leftovers_keep_the_staging_a_relative_pages_link_names(tmp_path, userdata, monkeypatch):
    """pre-restore leaves a relative link where the pages lie on another
    filesystem; the kept copy holds the same link, one folder deeper."""
    staging = _kept_with_pages_elsewhere(tmp_path, userdata)
    (userdata / "checkpoint/pages-3.img").unlink()
    monkeypatch.setattr(leftovers, "storage_root", lambda: tmp_path / "storage")
    assert leftovers.linked_from_checkpoints() == {staging}


def test_a_failed_restore_ref_leaves_the_pages_its_kept_checkpoint_links_to(tmp_path, userdata,
                                                                            monkeypatch):
    # restore REF's pages folder is discarded once Podman is done; where the
    # restore's last step failed, the checkpoint kept for `gpusnap restore NAME`
    # links into it (on another filesystem): it stays.
    from gpusnap.ops import restore_ref

    staging = _kept_with_pages_elsewhere(tmp_path, userdata)
    monkeypatch.setattr(leftovers, "storage_root", lambda: tmp_path / "storage")
    assert restore_ref._held_by_a_kept_checkpoint(staging, restored=False)
    assert not restore_ref._held_by_a_kept_checkpoint(staging, restored=True)
    assert not restore_ref._held_by_a_kept_checkpoint(tmp_path / "storage" / ".gpusnap-pull-x",
                                                      restored=False)


def test_leftovers_keep_round_ones_folder_a_kept_final_round_names_as_its_parent(
        tmp_path, userdata, monkeypatch):
    # a pre-copy's final round restored onto round 1's claimed folder (CRIU's
    # parent): kept for `gpusnap restore NAME`, it needs that folder's pages too
    real = tmp_path / "ram"
    real.mkdir()
    (tmp_path / "storage" / "ram").symlink_to(real)  # the storage path through a link
    claimed = real / "gpusnap-prepared-claimed"
    claimed.mkdir()
    # relative between real paths, made in userdata/checkpoint (pages_aside.relative_link)
    rel = os.path.relpath(claimed, os.path.realpath(userdata / "checkpoint"))
    (userdata / "checkpoint" / "parent").symlink_to(rel)
    kc.keep_aside(userdata / "checkpoint", "refused")
    monkeypatch.setattr(leftovers, "storage_root", lambda: tmp_path / "storage")
    assert claimed in leftovers.linked_from_checkpoints()
