"""pages/pages_aside.py: CRIU's pages moved out of Podman's tar and back."""

from __future__ import annotations

import io
import os
import tarfile

import pytest

from gpusnap.pages import pages_aside
from gpusnap.oci.bundle import FileEntry
from gpusnap.oci.tarfiles import entry_from_tarinfo


def _images(tmp_path):
    images = tmp_path / "userdata" / "checkpoint"
    images.mkdir(parents=True)
    (images / "pages-1.img").write_bytes(b"A" * 8192)
    (images / "pages-2.img").write_bytes(b"B" * 4096)
    (images / "pagemap-1.img").write_bytes(b"map")
    aside = tmp_path / ".gpusnap-push-x" / "pages"
    aside.mkdir(parents=True)
    return images, aside


def test_set_aside_leaves_links_and_bring_back_puts_the_files_in_place(tmp_path):
    images, aside = _images(tmp_path)
    assert pages_aside.set_aside(images, aside) == (2, 12288)
    link = images / "pages-1.img"
    assert link.is_symlink() and os.readlink(link) == str(aside / "pages-1.img")
    assert not (images / "pagemap-1.img").is_symlink()  # only the pages move
    assert pages_aside.bring_back(images) == 2
    assert not link.is_symlink() and link.read_bytes() == b"A" * 8192
    assert list(aside.iterdir()) == []


def test_bring_back_leaves_links_that_are_not_ours(tmp_path):
    images, _ = _images(tmp_path)
    elsewhere = tmp_path / "elsewhere.img"
    elsewhere.write_bytes(b"x")
    (images / "pages-3.img").symlink_to(elsewhere)
    assert pages_aside.bring_back(images) == 0
    assert (images / "pages-3.img").is_symlink() and elsewhere.exists()


def test_set_aside_that_fails_half_way_puts_everything_back(tmp_path, monkeypatch):
    images, aside = _images(tmp_path)
    real = os.symlink
    calls = []

    def flaky(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        real(src, dst)
    monkeypatch.setattr(os, "symlink", flaky)
    with pytest.raises(OSError):
        pages_aside.set_aside(images, aside)
    for name, data in (("pages-1.img", b"A" * 8192), ("pages-2.img", b"B" * 4096)):
        assert not (images / name).is_symlink() and (images / name).read_bytes() == data
    assert list(aside.iterdir()) == []


def _tar_with_links(tmp_path, aside):
    archive = tmp_path / "export.tar"
    with tarfile.open(archive, "w", format=tarfile.PAX_FORMAT) as tar:
        data = b'{"name": "c"}'
        info = tarfile.TarInfo("config.dump")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
        link = tarfile.TarInfo("checkpoint/pages-1.img")
        link.type, link.linkname = tarfile.SYMTYPE, str(aside / "pages-1.img")
        tar.addfile(link)
    return archive


def test_materialize_makes_a_kept_export_hold_its_pages(tmp_path):
    images, aside = _images(tmp_path)
    pages_aside.set_aside(images, aside)
    archive = _tar_with_links(tmp_path, aside)
    assert pages_aside.materialize(archive)
    with tarfile.open(archive) as tar:
        member = tar.getmember("checkpoint/pages-1.img")
        assert member.isfile() and tar.extractfile(member).read() == b"A" * 8192
        assert tar.extractfile("config.dump").read() == b'{"name": "c"}'
    assert not pages_aside.materialize(archive)  # whole already: left alone


def test_a_pushed_link_stands_for_its_file_and_a_pull_writes_one(tmp_path):
    images, aside = _images(tmp_path)
    pages_aside.set_aside(images, aside)
    with tarfile.open(_tar_with_links(tmp_path, aside)) as tar:
        entry = entry_from_tarinfo(tar.getmember("checkpoint/pages-1.img"))
    path = pages_aside.target(entry)
    assert path == aside / "pages-1.img"
    as_file = pages_aside.as_file(entry, path)
    assert as_file.type == "file" and as_file.size == 8192
    # the pull's side: the file written into its folder, a link for Podman
    pulled = tmp_path / ".gpusnap-pull-y"
    pulled.mkdir()
    link = pages_aside.write(pulled, FileEntry("checkpoint/pages-1.img", "file", size=6,
                                               mtime=1000), [b"abc", b"def"])
    assert link.type == "symlink" and link.linkname == str(pulled / "pages-1.img")
    assert (pulled / "pages-1.img").read_bytes() == b"abcdef"
    assert not pages_aside.is_pages("checkpoint/pagemap-1.img")
    assert not pages_aside.is_pages("other/pages-1.img")


def test_materialize_that_fails_leaves_the_archive_as_it_was(tmp_path, monkeypatch):
    images, aside = _images(tmp_path)
    pages_aside.set_aside(images, aside)
    archive = _tar_with_links(tmp_path, aside)
    before = archive.read_bytes()

    def full(src, tmp):
        tmp.write_bytes(b"half")
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(pages_aside, "_rewrite", full)
    with pytest.raises(OSError):
        pages_aside.materialize(archive)
    assert archive.read_bytes() == before
    assert not list(tmp_path.glob(".export.tar.whole"))


def test_prelinked_pages_are_written_through_the_links_and_unused_links_go(tmp_path):
    images = tmp_path / "userdata" / "checkpoint"
    images.mkdir(parents=True)
    ram = tmp_path / "shm" / ".gpusnap-push-r"
    ram.mkdir(parents=True)
    assert pages_aside.prelink(images, ram, 4) == 4
    # as CRIU opens them: O_CREAT|O_TRUNC follows the link and makes the file
    for n, data in ((1, b"A" * 8192), (2, b"B" * 4096)):
        fd = os.open(images / f"pages-{n}.img", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.write(fd, data)
        os.close(fd)
    (images / "pages-9.img").write_bytes(b"C" * 512)  # past the links: on the images' disk
    assert pages_aside.set_aside(images, ram) == (3, 8192 + 4096 + 512)
    assert sorted(p.name for p in images.glob("pages-*")) == ["pages-1.img", "pages-2.img",
                                                             "pages-9.img"]
    assert (ram / "pages-1.img").read_bytes() == b"A" * 8192
    assert os.stat(ram / "pages-1.img").st_mode & 0o777 == 0o600
    assert (images / "pages-9.img").is_symlink()  # moved (same filesystem here) and linked


def test_a_file_on_another_filesystem_stays_in_the_export(tmp_path, monkeypatch):
    images, aside = _images(tmp_path)
    real = os.rename

    def exdev(src, dst):
        if str(src).endswith("pages-2.img"):
            raise OSError(18, "Invalid cross-device link")
        real(src, dst)
    monkeypatch.setattr(os, "rename", exdev)
    assert pages_aside.set_aside(images, aside) == (1, 8192)
    assert not (images / "pages-2.img").is_symlink()


def test_drop_links_removes_every_link_into_the_folder(tmp_path):
    images = tmp_path / "checkpoint"
    images.mkdir()
    ram = tmp_path / ".gpusnap-push-r"
    ram.mkdir()
    pages_aside.prelink(images, ram, 3)
    (ram / "pages-1.img").write_bytes(b"x")
    (images / "pages-7.img").write_bytes(b"mine")
    assert pages_aside.drop_links(images, ram) == 3
    assert [p.name for p in images.iterdir()] == ["pages-7.img"]


def test_bring_back_across_filesystems_links_relatively_or_copies(tmp_path, monkeypatch):
    images, aside = _images(tmp_path)
    pages_aside.set_aside(images, aside)
    real = os.rename

    def exdev(src, dst):
        if str(src).startswith(str(aside)):
            raise OSError(18, "Invalid cross-device link")
        real(src, dst)
    monkeypatch.setattr(os, "rename", exdev)
    assert pages_aside.bring_back(images) == 2
    link = images / "pages-1.img"
    assert link.is_symlink() and not os.readlink(link).startswith("/")
    assert os.path.realpath(link) == os.path.realpath(aside / "pages-1.img")
    assert link.read_bytes() == b"A" * 8192
    # the links again, then the copy a failed push's local checkpoint needs
    for name in ("pages-1.img", "pages-2.img"):
        (images / name).unlink()
        (images / name).symlink_to(aside / name)
    assert pages_aside.bring_back(images, copy=True) == 2
    assert not link.is_symlink() and link.read_bytes() == b"A" * 8192


def test_a_rewritten_pagemap_and_its_parent_are_brought_back(tmp_path):
    """pages/parent_pages.py: the pull's folder holds the compact pages file, the
    rewritten pagemap and a link to round 1's claimed folder; CRIU must find
    all three through the images folder, and the next dump no stale parent."""
    images = tmp_path / "userdata" / "checkpoint"
    images.mkdir(parents=True)
    pull = tmp_path / ".gpusnap-pull-abc"
    claimed = tmp_path / ".gpusnap-pull-claimed-gpusnap-prepared-x-1"
    pull.mkdir()
    claimed.mkdir()
    (claimed / "pages-8.img").write_bytes(b"R" * 4096)
    (pull / "pages-8.img").write_bytes(b"N" * 4096)
    (pull / "pagemap-9.img").write_bytes(b"rewritten")
    (pull / "parent").symlink_to(claimed)
    (images / "pages-8.img").symlink_to(pull / "pages-8.img")
    (images / "pagemap-9.img").symlink_to(pull / "pagemap-9.img")
    assert pages_aside.bring_back(images) == 2
    assert (images / "pagemap-9.img").read_bytes() == b"rewritten"
    parent = images / "parent"
    assert not os.readlink(parent).startswith("/")  # resolves from CRIU's folder descriptor
    assert (parent / "pages-8.img").read_bytes() == b"R" * 4096
    assert not pages_aside.drop_stale_parent(images)  # still there: kept
    claimed.joinpath("pages-8.img").unlink()
    claimed.rmdir()  # the restore is over and its folder gone
    assert pages_aside.drop_stale_parent(images) and not os.path.lexists(parent)


def test_a_copy_back_that_meets_a_full_disk_leaves_the_link_and_the_pages(tmp_path, monkeypatch):
    import errno
    import shutil

    aside = tmp_path / ".gpusnap-push-ram"
    aside.mkdir()
    (aside / "pages-1.img").write_bytes(b"p" * 4096)
    images = tmp_path / "checkpoint"
    images.mkdir()
    (images / "pages-1.img").symlink_to(aside / "pages-1.img")
    real_rename = os.rename

    def across(src, dst):
        if str(src).startswith(str(aside)):
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        return real_rename(src, dst)

    def full(src, dst):
        open(dst, "wb").write(b"half")
        raise OSError(errno.ENOSPC, "No space left on device", str(dst))
    monkeypatch.setattr(os, "rename", across)
    monkeypatch.setattr(shutil, "copyfile", full)
    with pytest.raises(OSError):
        pages_aside.bring_back(images, copy=True)
    assert os.readlink(images / "pages-1.img") == str(aside / "pages-1.img")
    assert (aside / "pages-1.img").read_bytes() == b"p" * 4096
    assert not (images / ".pages-1.img.copy").exists()


def test_before_a_dump_every_pages_link_but_the_dumps_own_goes(tmp_path):
    """CRIU writes its images through any link (O_TRUNC): links a push killed
    before its dump left, or a restore left into a pull's folder, must not
    take this dump's memory; the dump's own push links stay."""
    images = tmp_path / "checkpoint"
    images.mkdir()
    mine, killed = tmp_path / ".gpusnap-push-mine", tmp_path / ".gpusnap-push-killed"
    pages_aside.prelink(images, killed, 4)
    for name in ("pages-1.img", "pages-2.img"):  # this push links those names anew
        (images / name).unlink()
    pages_aside.prelink(images, mine, 2)
    (images / "pagemap-1.img").symlink_to("../pull/pagemap-1.img")  # a restore's, relative
    (images / "pages-9.img").write_bytes(b"a file, not a link")
    assert pages_aside.drop_others(images, mine) == ["pages-3.img", "pages-4.img",
                                                     "pagemap-1.img"]
    assert sorted(p.name for p in images.iterdir()) == ["pages-1.img", "pages-2.img",
                                                        "pages-9.img"]
    assert pages_aside.drop_others(images, None) == ["pages-1.img", "pages-2.img"]
