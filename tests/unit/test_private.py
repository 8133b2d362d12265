"""Checkpoint data and state are root only: folders 0700, files 0600, from the
moment they exist (gpusnap/private.py and the places that write through it)."""

from __future__ import annotations

import hashlib
import json
import os
import stat
import threading
from pathlib import Path

import pytest

from gpusnap import private


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.fixture
def loose_umask():
    """umask 000: whatever gpusnap makes gets exactly the mode it asks for."""
    old = os.umask(0)
    yield
    os.umask(old)


def test_private_dir_makes_missing_parents_private_and_narrows_an_old_one(tmp_path, loose_umask):
    made = private.private_dir(tmp_path / "a" / "b" / "c")
    assert [mode(p) for p in (made.parent.parent, made.parent, made)] == [0o700] * 3
    old = tmp_path / "old"
    old.mkdir(mode=0o755)
    private.private_dir(old)
    assert mode(old) == 0o700


def test_private_dir_refuses_a_file(tmp_path):
    (tmp_path / "f").write_text("")
    with pytest.raises(NotADirectoryError):
        private.private_dir(tmp_path / "f")


def test_files_are_0600_from_the_first_byte(tmp_path, loose_umask):
    seen = []
    path = tmp_path / "f"
    with private.open_private(path, "w") as f:
        seen.append(mode(path))  # while it is being written
        f.write("x")
    assert seen == [0o600] and mode(path) == 0o600
    path.chmod(0o644)  # written by an older version
    with private.open_private(path, "a") as f:
        f.write("y")
    assert mode(path) == 0o600 and path.read_text() == "xy"
    with pytest.raises(ValueError):
        private.open_private(path, "r")


def test_write_private_replaces_atomically_and_leaves_no_temp_file(tmp_path, loose_umask):
    path = tmp_path / "state.json"
    path.write_text("old")
    path.chmod(0o644)
    private.write_private(path, '{"new": 1}')
    assert path.read_text() == '{"new": 1}' and mode(path) == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]


def test_restrict_tree_narrows_what_criu_made_and_leaves_links(tmp_path):
    root = tmp_path / "checkpoint"
    (root / "sub").mkdir(parents=True)
    (root / "core-1.img").write_bytes(b"x")
    (root / "core-1.img").chmod(0o644)
    (root / "sub").chmod(0o755)
    (root / "link").symlink_to("/etc/hostname")
    target_mode = mode(Path("/etc/hostname"))
    private.restrict_tree(root)
    assert mode(root / "core-1.img") == 0o600 and mode(root / "sub") == 0o700
    assert mode(Path("/etc/hostname")) == target_mode  # a link is not followed


def test_private_umask_binds_a_0600_socket(tmp_path):
    import socket

    before = os.umask(0o022)
    os.umask(before)
    s = socket.socket(socket.AF_UNIX)
    with private.private_umask():
        s.bind(str(tmp_path / "s.sock"))
    s.close()
    assert mode(tmp_path / "s.sock") == 0o600
    after = os.umask(before)
    assert after == before  # put back


# --- the places that write checkpoint data and state ---------------------------------


def test_chunk_cache_is_private_and_narrows_an_old_one(tmp_path, loose_umask):
    from gpusnap.oci.cache import ChunkCache

    root = tmp_path / "cache" / "chunks"
    cache = ChunkCache(root, max_bytes=1 << 20)
    data = b"process memory"
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    cache.put_blob(digest, data)
    cache.remember("sha256:" + "1" * 64, digest, 3)
    for dirpath, dirs, files in os.walk(tmp_path / "cache"):
        assert mode(Path(dirpath)) == 0o700, dirpath
        for name in files:
            assert mode(Path(dirpath) / name) == 0o600, name
    blob = cache._path("blobs", digest)
    blob.chmod(0o644)  # as an older gpusnap left them
    blob.parent.chmod(0o755)
    root.chmod(0o755)
    cache = ChunkCache(root, max_bytes=1 << 20)
    cache.prune()
    assert (mode(root), mode(blob.parent), mode(blob)) == (0o700, 0o700, 0o600)


@pytest.mark.parametrize("name", ["out.tar", "out.tar.zst"])
def test_pulled_archive_is_0600_while_written_and_after(tmp_path, loose_umask, name):
    from gpusnap.oci import bundle, tarfiles

    out = tmp_path / name
    (tmp_path / name).write_text("an older export")
    out.chmod(0o644)
    writer = tarfiles.ArchiveWriter(out)
    assert mode(writer.partial) == 0o600
    writer.add(bundle.FileEntry("f", "file", size=5), [b"12345"])
    writer.commit()
    assert mode(out) == 0o600
    assert not list(tmp_path.glob(".*partial"))


def test_export_pump_writes_a_0600_archive(tmp_path, loose_umask):
    """The FIFO pump behind `gpusnap checkpoint --export` (zstd into the partial file)."""
    from gpusnap.runtime import fifo_pump

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    partial = tmp_path / ".ckpt.tar.zst.partial"

    def podman():
        with open(fifo, "wb") as f:
            f.write(b"tar bytes" * 1000)

    writer = threading.Thread(target=podman)
    writer.start()
    assert fifo_pump.export(str(fifo), str(partial), "1", None) == 0
    writer.join()
    assert mode(partial) == 0o600 and partial.read_bytes()[:4] == b"\x28\xb5\x2f\xfd"


def test_gpu_manifest_is_0600(tmp_path, loose_umask):
    from gpusnap.gpu import manifest as gpu_manifest
    from tests.conftest import foreign_h100_manifest

    path = gpu_manifest.write(foreign_h100_manifest(), tmp_path)
    assert mode(path) == 0o600 and [p.name for p in tmp_path.iterdir()] == [path.name]


@pytest.fixture
def state(tmp_path, monkeypatch, loose_umask) -> Path:
    path = tmp_path / "run" / "gpusnap"
    monkeypatch.setenv("GPUSNAP_STATE_DIR", str(path))
    return path


def _all_private(root: Path) -> None:
    for dirpath, _, files in os.walk(root):
        assert mode(Path(dirpath)) == 0o700, dirpath
        for name in files:
            assert mode(Path(dirpath) / name) == 0o600, (dirpath, name)


def test_hook_request_and_journal_state_files_are_private(state, monkeypatch):
    from gpusnap import journal, requests
    from gpusnap.gpu import inventory as inventory_module
    from gpusnap.gpu.nodes import DeviceRemap
    from gpusnap.gpu.plan import Plan
    from gpusnap.action import prestart as hook
    from tests.unit.fakes import UUID0, gpu, inventory

    monkeypatch.setattr(inventory_module, "read_inventory", lambda *a: inventory(gpu(0, UUID0, minor=0)))
    hook.record_assignment("abc", [{"path": "/dev/nvidia0", "minor": 0}])
    # the stash holds the spec, and so the container's environment
    stash = hook.stash_live_remap(os.getpid(), Plan((), (), DeviceRemap()),
                                  {"process": {"env": ["API_KEY=k"]}})
    requests.put(1234, lock_timeout_ms=5)
    journal.record("x")
    _all_private(state)
    assert {p.relative_to(state).as_posix() for p in state.rglob("*") if p.is_file()} == {
        "containers/abc.json", stash.relative_to(state).as_posix(), "requests/1234.json",
        "journal.jsonl"}


def test_criu_action_markers_and_restore_state_are_private(state, monkeypatch, tmp_path):
    from gpusnap import MANIFEST_NAME
    from gpusnap.action import action
    image_dir = tmp_path / "images"
    image_dir.mkdir()
    (image_dir / MANIFEST_NAME).write_text("{}")
    action.pre_restore(str(image_dir), os.getpid(), action.fill_settings())
    monkeypatch.setenv("CRTOOLS_SCRIPT_ACTION", "pre-restore")
    monkeypatch.setenv("CRTOOLS_IMAGE_DIR", str(image_dir))
    assert action.main() == 0
    _all_private(state)
    assert json.loads((state / "actions" / f"{os.getpid()}-restore.json").read_text())


def test_stale_action_markers_go_but_a_live_runs_temp_file_stays(state):
    from gpusnap.action import action, step_state
    folder = step_state.folder()
    (folder / "999999999-pre-dump").write_text("0")
    live_tmp = folder / f".{os.getppid()}-restore.json.77.tmp"
    live_tmp.write_text("{}")
    os.environ["CRTOOLS_SCRIPT_ACTION"] = "pre-restore"
    try:
        action.main()
    finally:
        del os.environ["CRTOOLS_SCRIPT_ACTION"]
    assert not (folder / "999999999-pre-dump").exists() and live_tmp.exists()


def test_shim_state_and_exec_spec_are_private(tmp_path, loose_umask):
    from gpusnap.shim import bundle as bundle_state

    bundle_state.write_state(str(tmp_path), "/run/containerd/runc/ns", "runc")
    assert mode(tmp_path / bundle_state.SHIM_STATE) == 0o600
