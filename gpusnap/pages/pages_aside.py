"""CRIU's memory pages kept out of Podman's tar, on both ends of a registry move.

Podman copies every image of a checkpoint into its export tar, one thread, and
extracts every one from an import tar: a large part of the source's stop and
of the target's (docs/benchmarks.md), for bytes
gpusnap had already read (push) or could write itself (pull). So:

- push: once CRIU has dumped, the post-dump action moves each ``pages-*.img``
  into the push's staging folder (a rename: same filesystem) and leaves an
  absolute symlink in its place. Podman's export then holds symlinks; the push
  chunks the files they point at. A kept export is made whole (``materialize``)
  before anyone is told to restore it elsewhere.
- restore REF: the pull writes each pages file into a folder of its own,
  beside Podman's storage, and hands Podman a symlink.

CRIU cannot follow those links itself: the restored tasks read their pages
from inside the container's mount namespace, where the absolute path leads
nowhere. So the pre-restore action (still in the host's namespace) puts each
file in place of its link (``bring_back``): a rename on the same filesystem;
across filesystems a *relative* link, which does resolve there, because the
tasks open the images through CRIU's directory descriptor, a host mount, and
``..`` climbs the host's tree from it (a copy, slow at tens of GiB, is only made
where the pages must outlive their folder: a failed push's local checkpoint).

Pages in RAM (pages/memory.py): where the host can spare the memory, the push
links every ``pages-N.img`` CRIU may write into a folder on /dev/shm before the
dump (``prelink``), so CRIU writes them there at memory speed instead of to
the disk; post-dump only drops the links CRIU did not use. Links a push
killed before its dump left are no later dump's: pre-dump drops every link
but its own push's (``drop_others``). Podman's own import
refuses a relative link that leaves its folder, so the tars keep absolute ones.
"""

from __future__ import annotations

import errno
import fnmatch
import os
import shutil
import tarfile
from pathlib import Path

from gpusnap.oci.bundle import FileEntry
from gpusnap.pages.memory import in_ram as path_in_ram
from gpusnap.runtime.storage import PULL_PREFIX, PUSH_PREFIX

PATTERN = "pages-*.img"
PAGEMAP_PATTERN = "pagemap-*.img"
PARENT = "parent"  # CRIU's link to a parent images folder (criu/include/image.h)


def enabled() -> bool:
    """GPUSNAP_PAGES_ASIDE=0 sends the pages through Podman's tar, as Podman
    alone would (a way around should this ever misbehave; the benchmarks compare the two)."""
    return os.environ.get("GPUSNAP_PAGES_ASIDE", "1") != "0"


def is_pages(path: str) -> bool:
    """A member ``checkpoint/pages-N.img`` of a Podman checkpoint archive."""
    folder, _, name = path.rpartition("/")
    return folder == "checkpoint" and fnmatch.fnmatch(name, PATTERN)


def prelink(images: Path, aside: Path, count: int) -> int:
    """Links ``pages-1.img`` .. ``pages-<count>.img`` in ``images`` to files of
    the same names in ``aside``, made before a dump: CRIU opens its page images
    with O_CREAT|O_TRUNC, which follows a link and creates the file it names.
    (CRIU numbers them from 1, one per task's memory and shared segment.)
    Names already there are left alone. Returns the links made."""
    made = 0
    for n in range(1, count + 1):
        path = images / f"pages-{n}.img"
        if path.is_symlink() or path.exists():
            continue
        os.symlink(aside / path.name, path)
        made += 1
    return made


def drop_links(images: Path, aside: Path) -> int:
    """Remove every pages link of ``images`` into ``aside``: a dump that failed
    while the container runs on. Left behind, a later `podman container
    checkpoint` would have CRIU write through them into a folder that is gone."""
    dropped = 0
    for path in images.glob(PATTERN):
        if _prelinked(path, aside):
            path.unlink()
            dropped += 1
    return dropped


def drop_others(images: Path, aside: Path | None) -> list[str]:
    """Before a dump: every pages or pagemap link of ``images`` but those into
    ``aside`` (the dump's own push folder: prelink's), removed. CRIU opens its
    images with O_TRUNC, through any link: one a push killed before its dump
    left (into its folder, maybe still in RAM) or a restore's (bring_back's,
    into a pull's folder) would have it write this dump's memory into files
    that are not this dump's. The names removed."""
    dropped = []
    for path in sorted(images.glob(PATTERN)) + sorted(images.glob(PAGEMAP_PATTERN)):
        if path.is_symlink() and not (aside is not None and _prelinked(path, aside)):
            path.unlink()
            dropped.append(path.name)
    return dropped


def _prelinked(path: Path, aside: Path) -> bool:
    return path.is_symlink() and Path(os.readlink(path)).parent == aside


def set_aside(images: Path, aside: Path) -> tuple[int, int]:
    """Move the pages files of ``images`` into ``aside`` (same filesystem), a
    symlink left for each; (files, bytes). Files CRIU wrote through ``prelink``'s
    links are in ``aside`` already (the links it did not use are dropped); one
    that cannot be moved there (another filesystem) stays where it is, in
    Podman's export. Any other failure puts back what moved and raises: the
    dump must end as CRIU wrote it, or as described here."""
    moved: list[Path] = []
    files = total = 0
    try:
        for path in sorted(images.glob(PATTERN)):
            if _prelinked(path, aside):
                target = aside / path.name
                if target.is_file():
                    os.chmod(target, 0o600)  # process memory: root only (CRIU writes 0644)
                    files, total = files + 1, total + target.stat().st_size
                else:
                    path.unlink()  # a link CRIU did not need
                continue
            if path.is_symlink() or not path.is_file():
                continue
            target = aside / path.name
            size = path.stat().st_size
            try:
                os.rename(path, target)
            except OSError as exc:
                if exc.errno == errno.EXDEV:
                    continue
                raise
            moved.append(path)
            files, total = files + 1, total + size
            os.chmod(target, 0o600)
            os.symlink(target, path)
    except OSError:
        for path in moved:
            if path.is_symlink():
                path.unlink()
            os.rename(aside / path.name, path)
        raise
    return files, total


def staging_folder(link_target: str) -> Path | None:
    """The push's or pull's staging folder a pages link points into, or None:
    the only files a link in an image directory may name here."""
    path = Path(link_target)
    if not path.is_absolute():
        return None
    return next((p for p in path.parents if p.name.startswith((PUSH_PREFIX, PULL_PREFIX))),
                None)


def bring_back(images: Path, copy: bool = False) -> int:
    """Each absolute pages symlink of ``images`` that names a file of ours made
    readable to the restored tasks: the file renamed into its place, or where
    it lies on another filesystem a relative link to it (``copy``: a copy, for
    pages that must outlive their folder). A pagemap rewritten against a parent
    (pages/parent_pages.py) likewise, and the parent folder its folder names
    becomes ``images/parent`` (a relative link). Files."""
    done = 0
    links = sorted(images.glob(PATTERN)) + sorted(images.glob(PAGEMAP_PATTERN))
    for link in links:
        if not link.is_symlink():
            continue
        path = os.readlink(link)
        if staging_folder(path) is None or not os.path.isfile(path):
            continue
        # Unlinked first: a rename over an existing name makes ext4 write the
        # file's data out at once (auto_da_alloc), gigabytes while CRIU reads them.
        link.unlink()
        try:
            os.rename(path, link)
        except OSError as exc:
            if exc.errno != errno.EXDEV:
                os.symlink(path, link)
                raise
            if copy:
                tmp = link.with_name(f".{link.name}.copy")
                try:
                    shutil.copyfile(path, tmp)
                    os.rename(tmp, link)
                except OSError:  # a full disk: the link back, the pages where they were
                    tmp.unlink(missing_ok=True)
                    os.symlink(path, link)
                    raise
            else:
                os.symlink(relative_link(path, images), link)
        done += 1
        parent = Path(path).parent / PARENT
        if parent.is_symlink() and not os.path.lexists(images / PARENT):
            os.symlink(relative_link(os.readlink(parent), images), images / PARENT)
    return done


def drop_stale_parent(images: Path) -> bool:
    """Before a dump: a ``parent`` link bring_back left (Podman keeps the images
    with --keep) names a folder gone since; CRIU would fail on it."""
    link = images / PARENT
    if link.is_symlink() and PULL_PREFIX in os.readlink(link) and not link.exists():
        link.unlink()
        return True
    return False


def in_ram(images: Path) -> bool:
    """Some pages link of ``images`` names a file in RAM (pages/memory.py)."""
    return any(link.is_symlink() and path_in_ram(Path(os.readlink(link)))
               for link in images.glob(PATTERN))


def relative_link(path: str | Path, folder: Path) -> str:
    """``path`` as a link in ``folder`` that resolves without the host's root:
    from the real folder (``..`` follows the real parents, not a symlinked path)."""
    return os.path.relpath(os.path.realpath(path), os.path.realpath(folder))


def target(entry: FileEntry) -> Path | None:
    """The file a pages symlink of an archive points at, if it is there."""
    if entry.type != "symlink" or not is_pages(entry.path) or not entry.linkname.startswith("/"):
        return None
    path = Path(entry.linkname)
    return path if path.is_file() and not path.is_symlink() else None


def as_file(entry: FileEntry, path: Path) -> FileEntry:
    """The member the symlink stands for: its file's size, mode and time."""
    st = path.stat()
    # 0644 as CRIU wrote it (and Podman would have archived it); set_aside made it 0600
    return FileEntry(path=entry.path, type="file", mode=0o644, uid=entry.uid,
                     gid=entry.gid, uname=entry.uname, gname=entry.gname,
                     mtime=int(st.st_mtime), size=st.st_size, pax=dict(entry.pax))


def materialize(archive: Path) -> bool:
    """Rewrite a plain tar whose pages are symlinks into one that holds them
    (an export kept after a failed push: restorable anywhere). False: none were
    symlinks, the archive is left as it is."""
    with tarfile.open(archive) as src:
        if not any(m.issym() and is_pages(m.name.removeprefix("./")) for m in src):
            return False
    tmp = archive.with_name(f".{archive.name}.whole")
    try:
        _rewrite(archive, tmp)
    except BaseException:
        tmp.unlink(missing_ok=True)  # the archive (with its links) is as it was
        raise
    os.replace(tmp, archive)
    return True


def _rewrite(archive: Path, tmp: Path) -> None:
    with tarfile.open(archive) as src, tarfile.open(tmp, "w", format=tarfile.PAX_FORMAT) as dst:
        for member in src:
            if member.issym() and is_pages(member.name.removeprefix("./")) \
                    and Path(member.linkname).is_file():
                with open(member.linkname, "rb") as f:
                    info = dst.gettarinfo(fileobj=f, arcname=member.name)
                    info.uid, info.gid, info.uname, info.gname = (member.uid, member.gid,
                                                                  member.uname, member.gname)
                    info.mode = 0o644  # as CRIU wrote it (set_aside made it 0600)
                    dst.addfile(info, f)
            elif member.isfile():
                dst.addfile(member, src.extractfile(member))
            else:
                dst.addfile(member)


def path_in(folder: Path, entry: FileEntry) -> Path:
    return folder / entry.path.rpartition("/")[2]


def write(folder: Path, entry: FileEntry, pieces) -> FileEntry:
    """Write a pulled pages file into ``folder``; the symlink member that
    stands for it in the tar Podman imports."""
    path = path_in(folder, entry)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for piece in pieces:
            view = memoryview(piece)
            while view:
                view = view[os.write(fd, view):]
    finally:
        os.close(fd)
    return link_entry(entry, path)


def link_entry(entry: FileEntry, path: Path) -> FileEntry:
    """The symlink member that stands for ``entry``, written at ``path``."""
    os.utime(path, (entry.mtime, entry.mtime))
    return FileEntry(path=entry.path, type="symlink", mode=0o777, uid=entry.uid, gid=entry.gid,
                     uname=entry.uname, gname=entry.gname, mtime=entry.mtime,
                     linkname=str(path), pax=dict(entry.pax))
