"""The registry fails under a migration: SIGKILLed during `migrate`'s upload and
during `restore REF`'s download, and its disk full during an upload.
(tests/integration/test_registry_resume.py kills it under pushes and pulls of
checkpoint directories; here the source is a live container, whose state must
survive.)"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import assert_continued, assert_one_line_error, born, gpusnap_json, podman, \
    read_counter
from tests.faults.conftest import (cached_blobs, finished, kept_in,
                                   migrate_until_the_registry_dies, say, start_cli, status,
                                   tag_exists, unique_repo, when)
from tests.faults.netreg import make_registry


def _staged() -> set[Path]:
    return {p for d in ("/var/tmp", "/var/lib/containers") for p in Path(d).glob(".gpusnap-pull-*")}


def test_registry_killed_during_migrate_upload(registry, loaded, capsys):
    before, token = read_counter(loaded), born(loaded)
    repo = unique_repo()
    ref = registry.ref(f"{repo}:v1")
    res = migrate_until_the_registry_dies(registry, loaded, repo)
    assert_one_line_error(res, f"cannot reach registry {registry.host}",
                          f"{loaded} is checkpointed and stopped", "kept in")
    kept = kept_in(res.stderr)
    try:
        assert kept.is_file() and status(loaded) == "exited"
        registry.start()
        assert not tag_exists(registry, repo, "v1"), "a tag for a push that failed"
        # the hint's own command, as printed: this push's reference and flags
        printed = re.search(r"`(gpusnap push [^`]+)` tries again", res.stderr)
        assert printed and str(kept) in printed.group(1) and ref in printed.group(1), res.stderr
        again = gpusnap_json(*shlex.split(printed.group(1))[1:])
        assert 0 < again["chunks_sent"] < again["chunks"], again
        say(capsys, f"{res.stderr.splitlines()[0]} / re-push sent {again['chunks_sent']} of "
                    f"{again['chunks']} chunks")
        podman("rm", loaded)
        gpusnap_json("restore", ref, *registry.flags())
        assert_continued(loaded, before, token)
    finally:
        shutil.rmtree(kept.parent, ignore_errors=True)


def test_registry_killed_during_restore_download(registry, loaded, cache_dir, capsys):
    before, token = read_counter(loaded), born(loaded)
    ref = registry.ref(f"{unique_repo()}:v1")
    gpusnap_json("migrate", loaded, ref, *registry.flags())
    podman("rm", loaded)
    earlier = _staged()
    cli = start_cli("restore", ref, *registry.flags())
    when(lambda: cached_blobs(cache_dir) >= 10, cli, "10 chunks were fetched")
    registry.kill()
    res = finished(cli)
    assert_one_line_error(res, f"cannot reach registry {registry.host}")
    assert status(loaded) == "gone", "restored from a partial download"
    assert not _staged() - earlier, "the staged partial download stayed behind"
    registry.start()
    again = gpusnap_json("restore", ref, *registry.flags())
    assert again["pull"]["bytes_from_cache"] > 0  # what was fetched is not fetched again
    say(capsys, f"{res.stderr.splitlines()[0]} / re-run: {again['pull']['bytes_from_cache']} "
                f"bytes from the cache, {again['pull']['bytes_fetched']} fetched")
    assert_continued(loaded, before, token)


@pytest.fixture
def small_registry(tmp_path):
    """A registry whose storage is a 48 MiB tmpfs: the loaded container does not fit."""
    store = tmp_path / "small-registry"
    (store / "storage").mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=48m", "tmpfs", str(store / "storage")],
                   check=True)
    reg = make_registry(store)
    yield reg
    reg.stop()
    subprocess.run(["umount", "-l", str(store / "storage")])


def test_registry_disk_full_during_migrate(small_registry, loaded, capsys):
    before, token = read_counter(loaded), born(loaded)
    repo = unique_repo()
    res = subprocess.run(["/usr/local/bin/gpusnap", "migrate", loaded,
                          small_registry.ref(f"{repo}:v1"), *small_registry.flags()],
                         capture_output=True, text=True, timeout=300)
    assert_one_line_error(res, f"registry {small_registry.host}",
                          f"{loaded} is checkpointed and stopped", "kept in")
    assert "(HTTP 5" in res.stderr and "its free space" in res.stderr, res.stderr  # whose fault
    kept = kept_in(res.stderr)
    say(capsys, res.stderr.splitlines()[0])
    try:
        assert not tag_exists(small_registry, repo, "v1")
        podman("rm", loaded)
        gpusnap_json("restore", str(kept))  # back on the source host
        assert_continued(loaded, before, token)
    finally:
        shutil.rmtree(kept.parent, ignore_errors=True)
