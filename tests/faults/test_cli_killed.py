"""gpusnap SIGKILLed in each registry phase: migrate's export and upload, pull,
and restore REF's download and Podman restore. (A killed `gpusnap checkpoint
--export` is tests/integration/test_faults.py's.)

After each kill: the source container runs or is restorable, no tag and no
archive under its final name exist unless complete, `gpusnap doctor` lists
what was left half-written and `--fix` removes it, and the same command run
again completes.
"""

from __future__ import annotations

import shlex
import shutil
from pathlib import Path

from gpusnap.runtime.fifo_pump import referenced
from tests.conftest import (assert_continued, born, gpusnap_json, journal_mark, journal_since,
                            podman, read_counter, run, wait_counter)
from tests.faults.conftest import (cached_blobs, doctor, doctor_fix, say, settled, sigkill, start_cli, status, tag_exists,
                                   unique_repo, wait_quiet, when)

STAGING = (Path("/var/tmp"), Path("/var/lib/containers"))


def staged(prefix: str) -> set[Path]:
    return {p for d in STAGING for p in d.glob(f"{prefix}*")}


def container_id(name: str) -> str:
    return podman("inspect", name, "--format", "{{.Id}}").stdout.strip()


def export_of(mark: int, cid: str) -> Path | None:
    for e in journal_since(mark):
        if e.get("event") == "export-started" and e.get("container") == cid:
            return Path(e["export"])
    return None


def test_migrate_killed_during_export(registry, loaded):
    before, cid, mark = read_counter(loaded), container_id(loaded), journal_mark()
    token = born(loaded)
    repo = unique_repo()
    cli = start_cli("migrate", loaded, registry.ref(f"{repo}:v1"), *registry.flags())

    def exporting() -> bool:
        export = export_of(mark, cid)
        partial = export and export.with_name(f".{export.name}.partial")
        return bool(partial and partial.exists() and partial.stat().st_size > 0)

    when(exporting, cli, "the export started writing")
    sigkill(cli)
    export = export_of(mark, cid)
    wait_quiet(export.parent)  # Podman and the FIFO pump end without the CLI
    assert not export.exists(), "a half-written export under its final name"
    assert not tag_exists(registry, repo, "v1")
    if status(loaded) != "running":  # dumped before the kill: the local checkpoint is kept
        gpusnap_json("restore", loaded)
    assert_continued(loaded, before, token)
    left = doctor()["leftovers"]
    assert str(export.with_name(f".{export.name}.partial")) in left, left
    removed = doctor_fix()["removed"]
    assert not export.with_name(f".{export.name}.partial").exists(), removed
    shutil.rmtree(export.parent, ignore_errors=True)
    pushed = gpusnap_json("migrate", loaded, registry.ref(f"{repo}:v1"), *registry.flags())
    assert pushed["chunks"] > 0 and tag_exists(registry, repo, "v1")


def _migrate_killed_mid_upload(registry, loaded) -> tuple[str, str, Path]:
    """`gpusnap migrate` SIGKILLed once the dump is complete and 10 chunks are
    uploaded (the upload reads the export while Podman writes it; killed
    before, see test_migrate_killed_during_export): (repo, container id, the
    export the journal names)."""
    cid, mark = container_id(loaded), journal_mark()
    repo = unique_repo()
    cli = start_cli("migrate", loaded, registry.ref(f"{repo}:v1"), *registry.flags())

    def checkpointed() -> list[dict]:
        return [e for e in journal_since(mark) if e.get("event") == "checkpointed"
                and e.get("container") == cid]

    when(lambda: len(registry.linked_blobs(repo)) >= 10 and bool(checkpointed()), cli,
         "10 chunks were uploaded and the checkpoint was complete")
    sigkill(cli)
    return repo, cid, Path(checkpointed()[0]["export"])


def test_migrate_killed_during_upload_resumes_from_the_kept_archive(registry, loaded):
    before, token = read_counter(loaded), born(loaded)
    repo, cid, kept = _migrate_killed_mid_upload(registry, loaded)
    ref = registry.ref(f"{repo}:v1")
    assert not tag_exists(registry, repo, "v1"), "a manifest for a push that never finished"
    # The container is checkpointed and stopped; the complete export the journal
    # names is all that is left of it, and doctor points at it.
    assert status(loaded) == "exited"
    assert kept.is_file() and not referenced(str(kept))
    try:
        shown = [k for k in doctor()["kept"] if k["export"] == str(kept)]
        assert shown and shown[0]["container"] in (cid, loaded), doctor()["kept"]
        printed = shown[0]["again"].strip("`")  # this push's own reference and flags
        assert printed.startswith(f"gpusnap push {kept} {ref}"), shown
        fixed = doctor_fix()
        assert kept.is_file() and not any(str(kept.parent) in r for r in fixed["removed"]), \
            "doctor --fix removed the only copy of a stopped container"
        again = gpusnap_json(*shlex.split(printed)[1:])  # doctor's command, as printed
        assert 0 < again["chunks_sent"] < again["chunks"], again  # only what was missing
        podman("rm", loaded)
        gpusnap_json("restore", ref, *registry.flags())
        assert_continued(loaded, before, token)
    finally:
        shutil.rmtree(kept.parent, ignore_errors=True)


def test_pull_killed_leaves_no_archive_and_resumes_from_the_cache(registry, loaded, tmp_path,
                                                                  cache_dir):
    ref = registry.ref(f"{unique_repo()}:v1")
    token = born(loaded)
    gpusnap_json("push", loaded, ref, "--leave-running", *registry.flags())
    out = tmp_path / "pulled.tar.zst"
    cli = start_cli("pull", ref, "-o", str(out), *registry.flags())
    when(lambda: cached_blobs(cache_dir) >= 10, cli, "10 chunks were fetched")
    sigkill(cli)
    partial = out.with_name(f".{out.name}.partial")
    wait_quiet(partial)  # the zstd writing it ends with its input
    assert not out.exists(), "a half-written pull under its final name"
    # Hidden and named .partial: no tool takes it for an archive. `pull` keeps no
    # journal, so doctor cannot find it; the same pull run again overwrites it.
    assert not partial.exists() or partial.name.startswith(".")
    again = gpusnap_json("pull", ref, "-o", str(out), *registry.flags())
    assert again["bytes_from_cache"] > 0 and again["bytes_fetched"] < again["bytes"]
    assert not partial.exists()
    copy = f"{loaded}-copy"
    try:
        gpusnap_json("restore", str(out), "--name", copy)
        assert_continued(copy, read_counter(copy), token)
    finally:
        run(["podman", "rm", "-f", "-t", "0", copy])
    still = read_counter(loaded)
    assert wait_counter(loaded, still) > still  # the source ran on throughout
    assert born(loaded) == token


def _migrated(registry, name: str) -> str:
    """Checkpointed to a new tag and removed here: what a target host restores."""
    ref = registry.ref(f"{unique_repo()}:v1")
    gpusnap_json("migrate", name, ref, *registry.flags())
    assert status(name) == "exited"
    podman("rm", name)
    return ref


def test_restore_ref_killed_during_download_restores_nothing(registry, loaded, cache_dir):
    before, token = read_counter(loaded), born(loaded)
    ref = _migrated(registry, loaded)
    earlier = staged(".gpusnap-pull-")
    cli = start_cli("restore", ref, *registry.flags())
    when(lambda: cached_blobs(cache_dir) >= 10, cli, "10 chunks were fetched")
    sigkill(cli)
    mine = staged(".gpusnap-pull-") - earlier
    assert mine, "no staging directory: the kill came too late to test anything"
    # Podman imports while the chunks arrive: it made the container from the
    # config already. The pump cuts its stream once the CLI is gone, and when
    # Podman has failed removes the half-made container.
    for work in mine:
        wait_quiet(work)
    assert status(loaded) == "gone", "a container from a half-downloaded checkpoint"
    for work in mine:
        assert not (work / "checkpoint.tar").exists()
    settled(mine)
    assert {str(w) for w in mine} <= set(doctor()["leftovers"])
    doctor_fix()
    assert not [w for w in mine if w.exists()]
    res = gpusnap_json("restore", ref, *registry.flags())
    assert res["pull"]["bytes_from_cache"] > 0
    assert_continued(loaded, before, token)


def _podman_restoring(where: set[Path]) -> bool:
    return any(referenced(str(w)) for w in where)


def test_restore_ref_killed_during_podman_restore(registry, loaded, capsys):
    before, token = read_counter(loaded), born(loaded)
    ref = _migrated(registry, loaded)
    earlier = staged(".gpusnap-pull-")
    cli = start_cli("restore", ref, *registry.flags())
    when(lambda: _podman_restoring(staged(".gpusnap-pull-") - earlier), cli,
         "Podman started the restore")
    sigkill(cli)
    mine = staged(".gpusnap-pull-") - earlier
    for work in mine:
        wait_quiet(work)
    # Podman finished on its own, or left nothing that runs: either way REF restores it.
    was = status(loaded)
    if was != "running":
        run(["podman", "rm", "-f", "-t", "0", loaded])
        gpusnap_json("restore", ref, *registry.flags())
    assert_continued(loaded, before, token)
    say(capsys, f"CLI killed while Podman restored: the container was {was} afterwards")
    settled(mine)
    assert {str(w) for w in mine if w.exists()} <= set(doctor_fix()["removed"])
    assert not [w for w in mine if w.exists()], "the staged archive stayed behind"


def test_migrate_killed_during_upload_leaves_an_export_that_restores_here(registry, loaded):
    """The kept export of row 2 holds symlinks to the memory pages beside it
    (pages/pages_aside.py: the push had set them aside); with the container
    removed, `gpusnap restore FILE` still brings it back (pre-restore puts the
    files in place)."""
    import tarfile

    before, token = read_counter(loaded), born(loaded)
    _, _, kept = _migrate_killed_mid_upload(registry, loaded)
    assert status(loaded) == "exited"
    try:
        with tarfile.open(kept) as tar:
            assert any(m.issym() and "pages-" in m.name for m in tar), "no pages set aside"
        podman("rm", loaded)
        gpusnap_json("restore", str(kept))
        assert_continued(loaded, before, token)
    finally:
        shutil.rmtree(kept.parent, ignore_errors=True)
