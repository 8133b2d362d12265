"""Interrupted transfers: the registry SIGKILLed mid-push and mid-pull (one clear
line each), then started again on the same storage; the same command sends only
the chunks the registry lacked, and reads back from the chunk cache what was
fetched. A disk that fills up during a pull leaves nothing under the name."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tarfile
import time
import uuid
from pathlib import Path
from typing import Callable

import pytest

from tests.conftest import GPUSNAP, assert_one_line_error, run
from tests.integration.oci_registry import (PASSWORD, Registry, make_large_checkpoint,
                                            make_registry)
from tests.integration.test_registry import fetch_manifest, gs, gs_json

SIZE = 512 << 20  # about 256 chunks of 2 MiB: several seconds of transfer on 2 cores


@pytest.fixture
def registry(tmp_path) -> Registry:
    reg = make_registry(tmp_path / "registry")
    yield reg
    reg.stop()
    shutil.rmtree(reg.storage, ignore_errors=True)  # hundreds of MiB: not kept for pytest


@pytest.fixture
def source(tmp_path) -> Path:
    d = tmp_path / "ckpt"
    make_large_checkpoint(d, SIZE, seed=uuid.uuid4().int % 10**6)
    yield d
    shutil.rmtree(d, ignore_errors=True)
    for archive in tmp_path.glob("*.tar"):
        archive.unlink()


def start(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    proc = subprocess.Popen([GPUSNAP, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    proc.stdin.write(PASSWORD + "\n")
    proc.stdin.close()
    proc.stdin = None  # written and closed: communicate() must not flush it
    return proc


def kill_registry_when(reg: Registry, proc: subprocess.Popen, done: Callable[[], int],
                       at: int) -> int:
    """SIGKILL the registry once ``done()`` reaches ``at`` while ``proc`` runs."""
    deadline = time.monotonic() + 300
    while proc.poll() is None and time.monotonic() < deadline:
        n = done()
        if n >= at:
            reg.kill()
            return n
        time.sleep(0.02)
    rc = proc.poll()
    proc.kill()
    proc.wait()
    raise AssertionError(f"the transfer ended (rc {rc}) before {at} chunks were done: "
                         f"{done()}")


def finished(proc: subprocess.Popen) -> subprocess.CompletedProcess:
    out, err = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def cached_blobs(cache: Path) -> dict[str, int]:
    return {f"sha256:{p.name}": p.stat().st_size
            for p in (cache / "blobs/sha256").glob("*/*") if p.is_file()}


def _sha256(f) -> str:
    h = hashlib.sha256()
    while piece := f.read(4 << 20):
        h.update(piece)
    return h.hexdigest()


def same_pages(archive: Path, source: Path) -> bool:
    """The archive's pages-1.img holds the source directory's bytes."""
    with tarfile.open(archive) as tar, open(source / "checkpoint/pages-1.img", "rb") as orig:
        return _sha256(tar.extractfile("checkpoint/pages-1.img")) == _sha256(orig)


def test_push_stopped_by_a_dead_registry_resumes_with_what_it_lacked(registry, source, cache_dir,
                                                                     capsys):
    repo = f"ckpt/resume-{uuid.uuid4().hex[:8]}"
    ref = registry.ref(f"{repo}:v1")
    proc = start("push", str(source), ref, *registry.flags())
    at_kill = kill_registry_when(registry, proc, lambda: len(registry.linked_blobs(repo)), 60)
    res = finished(proc)
    assert_one_line_error(res, f"cannot reach registry {registry.host}",
                          hint="then push again: chunks the registry already has are not sent again")
    present = registry.linked_blobs(repo)
    assert len(present) >= at_kill

    registry.start()
    again = gs_json("push", str(source), ref, *registry.flags())
    listed = fetch_manifest(registry, ref)["layers"]  # a chunk may repeat (same bytes twice)
    layers = {layer["digest"]: layer["size"] for layer in listed}
    lacked = {d: s for d, s in layers.items() if d not in present}
    with capsys.disabled():
        print(f"\n  push resumed: {len(present)} of {len(layers)} chunks were in the registry "
              f"when it died; the re-run sent {again['chunks_sent']} "
              f"({again['bytes_sent']} bytes)")
    assert 0 < len(lacked) < len(layers)
    # the manifest lists each distinct blob once; a chunk that repeats (a segment's
    # short tail between two stamps of the test data) is one of them
    assert again["layers"] == len(listed) <= again["chunks"]
    assert again["chunks_sent"] == len(lacked)
    assert again["bytes_sent"] == sum(lacked.values())

    out = source.parent / "check.tar"
    gs_json("pull", ref, "-o", str(out), "--no-cache", *registry.flags())
    assert same_pages(out, source)


def test_pull_stopped_by_a_dead_registry_resumes_from_the_chunk_cache(registry, source,
                                                                      cache_dir, capsys):
    ref = registry.ref(f"ckpt/resume-{uuid.uuid4().hex[:8]}:v1")
    pushed = gs_json("push", str(source), ref, *registry.flags())
    out = source.parent / "pulled.tar"
    pull_cache = cache_dir.parent / "pull-cache"  # the push's cache holds no blobs; be sure
    env = {**os.environ, "GPUSNAP_CACHE_DIR": str(pull_cache)}

    proc = start("pull", ref, "-o", str(out), *registry.flags(), env=env)
    kill_registry_when(registry, proc, lambda: len(cached_blobs(pull_cache)), 60)
    res = finished(proc)
    assert_one_line_error(res, f"cannot reach registry {registry.host}")
    assert not out.exists() and not list(out.parent.glob(f".{out.name}*"))  # not even a partial
    cached = cached_blobs(pull_cache)

    registry.start()
    res = run([GPUSNAP, "pull", ref, "-o", str(out), "--json", *registry.flags()],
              input=PASSWORD + "\n", env=env)
    assert res.returncode == 0, res.stderr
    again = json.loads(res.stdout)
    listed = fetch_manifest(registry, ref)["layers"]  # a chunk may repeat (same bytes twice)
    layers = {layer["digest"]: layer["size"] for layer in listed}
    from_cache = sum(size for digest, size in cached.items() if digest in layers)
    with capsys.disabled():
        print(f"\n  pull resumed: {len(cached)} of {len(layers)} chunks were cached when the "
              f"registry died; the re-run fetched {again['bytes_fetched']} bytes, "
              f"{again['bytes_from_cache']} from the cache")
    assert 0 < from_cache < pushed["bytes_stored"]
    assert again["bytes_from_cache"] == from_cache
    assert again["bytes_fetched"] == pushed["bytes_stored"] - from_cache
    assert same_pages(out, source)


def test_a_blob_left_half_linked_by_a_killed_registry_is_sent_again(registry, cache_dir,
                                                                      tmp_path):
    """docker-registry writes a blob's link file in place: SIGKILLed between the
    truncate and the write, it answers 500 for that blob from then on. The next
    push must not stop there: it sends the blob again, which rewrites the link."""
    small = tmp_path / "small-ckpt"
    make_large_checkpoint(small, 24 << 20, seed=11)
    repo = f"ckpt/halflink-{uuid.uuid4().hex[:8]}"
    ref = registry.ref(f"{repo}:v1")
    first = gs_json("push", str(small), ref, *registry.flags())
    listed = fetch_manifest(registry, ref)["layers"]  # a chunk may repeat (same bytes twice)
    layers = {layer["digest"]: layer["size"] for layer in listed}
    broken = sorted(layers)[0]
    link = (registry.storage / "docker/registry/v2/repositories" / repo / "_layers/sha256"
            / broken.split(":", 1)[1] / "link")
    link.write_text("")
    assert broken not in registry.linked_blobs(repo)

    again = gs_json("push", str(small), ref, *registry.flags())
    assert again["chunks"] == first["chunks"]
    assert again["chunks_sent"] == 1
    assert again["bytes_sent"] == layers[broken]
    assert broken in registry.linked_blobs(repo)
    out = tmp_path / "check.tar"
    gs_json("pull", ref, "-o", str(out), "--no-cache", *registry.flags())
    assert same_pages(out, small)


@pytest.mark.parametrize("suffix", [".tar", ".tar.zst"])
def test_disk_full_on_pull_is_one_line_and_leaves_no_file(registry, cache_dir, tmp_path, suffix):
    small = tmp_path / "small-ckpt"
    make_large_checkpoint(small, 96 << 20, seed=7)
    ref = registry.ref(f"ckpt/full-{uuid.uuid4().hex[:8]}:v1")
    gs_json("push", str(small), ref, *registry.flags())
    mnt = tmp_path / "full"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32m", "tmpfs", str(mnt)], check=True)
    try:
        out = mnt / f"ckpt{suffix}"
        res = gs("pull", ref, "-o", str(out), *registry.flags())
        assert_one_line_error(res, f"writing {out} failed", "No space left on device",
                              "pull elsewhere")
        assert list(mnt.iterdir()) == []  # neither the archive nor its partial file
    finally:
        subprocess.run(["umount", str(mnt)], check=True)
