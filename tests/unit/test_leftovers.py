"""What `gpusnap doctor --fix` may remove (ops/leftovers.py): a push's folder
that holds all that is left of a container it stopped is never among it,
however far back the journal's line went; a copy push's folder is litter."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from gpusnap import journal
from gpusnap.ops import leftovers, uploads
from gpusnap.ops.push_source import mark_only_copy
from gpusnap.runtime.storage import PUSH_PREFIX


@pytest.fixture
def staging(tmp_path: Path, monkeypatch) -> Path:
    monkeypatch.setenv("GPUSNAP_STATE_DIR", str(tmp_path / "state"))
    root = tmp_path / "var-tmp"
    root.mkdir()
    monkeypatch.setattr(leftovers, "_staging_roots", lambda: {root})
    monkeypatch.setattr(uploads, "live_work_dirs", lambda: set())
    monkeypatch.setattr(leftovers, "referenced", lambda path: False)
    monkeypatch.setattr("tempfile.gettempdir", lambda: str(tmp_path / "tmp"))
    return root


def _push_folder(root: Path, name: str) -> tuple[Path, Path]:
    work = root / f"{PUSH_PREFIX}{name}"
    work.mkdir()
    export = work / "checkpoint.tar"
    export.write_bytes(b"\0" * 1024)
    old = time.time() - 3600
    os.utime(work, (old, old))
    return work, export


def test_a_stopped_containers_export_is_kept_with_its_own_commands(staging):
    work, export = _push_folder(staging, "stopped")
    mark_only_copy(work, "web", export, f"`gpusnap push {export} REF`",
                   f"`podman rm web; gpusnap restore {export}`")
    os.utime(work, (time.time() - 3600,) * 2)
    for _ in range(600):  # the journal's line about it is long gone
        journal.record("pushed", ref="r/x:1")
    kept = leftovers.kept()
    assert [k["export"] for k in kept] == [str(export)]
    assert kept[0]["back"] == f"`podman rm web; gpusnap restore {export}`"
    assert work not in leftovers.find()


def test_a_copy_pushs_export_is_litter_though_the_journal_names_it(staging):
    work, export = _push_folder(staging, "copy")
    journal.record("checkpointed", container="abc", export=str(export), leave_running=True)
    assert leftovers.kept() == []
    assert work in leftovers.find()


def test_a_journal_line_from_before_marks_still_keeps_its_export(staging):
    work, export = _push_folder(staging, "old")
    journal.record("checkpointed", container="abc", export=str(export))  # no leave_running
    assert [k["export"] for k in leftovers.kept()] == [str(export)]
    assert work not in leftovers.find()


def _fake_dump(tmp_path, monkeypatch):
    """podman_source.checkpointed over a dump that writes Podman's export and
    stops the container (no Podman): (the staging root, the container)."""
    from types import SimpleNamespace

    from gpusnap.ops import checkpoint as ops_checkpoint, podman_source

    monkeypatch.setenv("GPUSNAP_STATE_DIR", str(tmp_path / "state"))
    root = tmp_path / "staging"
    root.mkdir()
    monkeypatch.setattr(podman_source, "staging_dir", lambda *a: root)
    monkeypatch.setattr(podman_source.kept_pages, "sweep", lambda: None)
    monkeypatch.setattr(podman_source.pages_aside, "enabled", lambda: False)
    container = SimpleNamespace(name="web", id="abc", userdata=tmp_path / "userdata",
                                checkpoint_dir=tmp_path / "userdata" / "checkpoint",
                                graph_root=None, runtime="runc")
    plan = SimpleNamespace(container=container, estimate_bytes=1, export=None, keep=False)

    def make_plan(source, export, *a, **k):
        plan.export = Path(export)
        return plan

    def dump(p):
        time.sleep(0.3)
        p.export.write_bytes(b"tar")  # Podman's export, the container stopped
    monkeypatch.setattr(ops_checkpoint, "plan", make_plan)
    monkeypatch.setattr(ops_checkpoint, "require_space", lambda *a: None)
    monkeypatch.setattr(ops_checkpoint, "run", dump)
    monkeypatch.setattr(podman_source, "_push_source", lambda *a: None)
    return root, container


def test_a_second_ctrl_c_while_migrate_waits_for_its_dump_keeps_the_export(tmp_path, monkeypatch):
    # The first Ctrl-C stops the upload; the push waits for the dump, which
    # stops the container. A second Ctrl-C in that wait must not let the
    # clean-up remove the export: it is all that is left of the container.
    from gpusnap.ops import podman_source

    root, container = _fake_dump(tmp_path, monkeypatch)

    def second_ctrl_c(jobs):
        raise KeyboardInterrupt
    monkeypatch.setattr(podman_source, "futures_wait", second_ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        with podman_source.checkpointed("web", False, None, True, container, None):
            raise KeyboardInterrupt  # the first, in the upload
    exports = list(root.glob(f"{PUSH_PREFIX}*/checkpoint.tar"))
    assert [e.read_bytes() for e in exports] == [b"tar"]


def test_an_upload_that_fails_not_in_gpusnaps_words_still_says_where_the_export_is(
        tmp_path, monkeypatch):
    # An OSError (or a bug) in the upload after the dump stopped the container:
    # the line says where its checkpoint is kept and how back, as a
    # GpusnapError's does (it said only the OSError's words before).
    from gpusnap.ops import podman_source
    from gpusnap.ops.push_source import KeptError

    root, container = _fake_dump(tmp_path, monkeypatch)
    with pytest.raises(KeptError) as failed:
        with podman_source.checkpointed("web", False, None, True, container, None):
            raise OSError(5, "Input/output error")
    export = next(root.glob(f"{PUSH_PREFIX}*/checkpoint.tar"))
    assert export.read_bytes() == b"tar"
    assert "OSError: [Errno 5] Input/output error" in failed.value.message
    assert f"checkpoint is kept in {export}" in failed.value.message


def test_a_killed_pulls_fetch_scratch_in_ram_is_found(staging, tmp_path, monkeypatch):
    shm = tmp_path / "shm"
    scratch = shm / "gpusnap-fetch-abc"
    scratch.mkdir(parents=True)
    (scratch / "seg-1").write_bytes(b"\0" * 4096)
    os.utime(scratch, (time.time() - 3600,) * 2)
    monkeypatch.setattr(leftovers, "SCRATCH_ROOTS", (shm,))
    assert scratch in leftovers.find()


def test_a_stopped_container_whose_pages_lie_aside_keeps_them_and_says_restore_it(staging):
    # pages set aside (in RAM, the default GPU path): the local checkpoint links
    # to them; doctor never offers `podman rm`, and --fix never takes the pages
    work, export = _push_folder(staging, "aside")
    aside = staging / f"{PUSH_PREFIX}pages"
    aside.mkdir()
    (aside / "pages-1.img").write_bytes(b"p")
    os.utime(aside, (time.time() - 3600,) * 2)
    from gpusnap.ops import podman_source
    # the mark podman_source.checkpointed writes where the pages lie aside
    mark_only_copy(work, "web", export, "`gpusnap push x REF`",
                   podman_source._back_aside("web", aside), holds=(aside,))
    os.utime(work, (time.time() - 3600,) * 2)
    kept = leftovers.kept()
    assert len(kept) == 1 and kept[0]["holds"] == [str(aside)]
    assert kept[0]["again"] == "`gpusnap push x REF`"  # the export's links lead to ASIDE
    assert kept[0]["back"].startswith("`gpusnap restore web`") and "podman rm" not in kept[0]["back"]
    found = leftovers.find()
    assert work not in found and aside not in found
