"""The registry format's pieces without a registry: references, credentials,
chunking, the config/manifest, archive streams, the chunk cache."""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import random
import tarfile

import pytest

from gpusnap.errors import GpusnapError
from gpusnap.oci import auth, bundle, chunker, reference, tarfiles
from gpusnap.oci.cache import ChunkCache
from gpusnap.ops.push import _Counted, chunk_params, layer_scale


@pytest.mark.parametrize("text,expected", [
    ("127.0.0.1:5000/ckpt/app:v1", ("127.0.0.1:5000", "ckpt/app", "v1", None)),
    ("localhost/app", ("localhost", "app", "latest", None)),
    ("reg.example.com/a/b/c@sha256:" + "a" * 64, ("reg.example.com", "a/b/c", None, "sha256:" + "a" * 64)),
    ("[::1]:5000/x:t", ("[::1]:5000", "x", "t", None)),
])
def test_reference_parse(text, expected):
    ref = reference.parse(text)
    assert (ref.registry, ref.repository, ref.tag, ref.digest) == expected
    assert reference.parse(str(ref)) == ref


def test_a_source_that_names_a_registry_is_read_as_a_reference_even_when_malformed():
    """restore/inspect SOURCE: what names a registry host is parsed as a reference
    (a typo gets the reference's error, not "no such file"); files and containers
    are not."""
    for meant in ("127.0.0.1:5000/nc/counter@sha256:1234", "127.0.0.1:5000/NC/Counter:v1",
                  "localhost/app", "reg.example.com/a/b:v1", "[::1]:5000/x:t"):
        assert reference.names_registry(meant), meant
    for other in ("web", "web-1", "my_ctr.v2", "c.tar.zst", "out/c.tar.zst", "./c.tar",
                  "/var/tmp/ckpt", "ckpt/dir", "127.0.0.1:5000"):
        assert not reference.names_registry(other), other
    with pytest.raises(GpusnapError, match="bad digest"):
        reference.parse("127.0.0.1:5000/nc/counter@sha256:1234")
    with pytest.raises(GpusnapError, match="bad repository name 'NC/Counter'"):
        reference.parse("127.0.0.1:5000/NC/Counter:v1")


@pytest.mark.parametrize("text,why", [
    ("app:v1", "names no registry"),
    ("my-container", "names no registry"),
    ("reg.io/App:v1", "bad repository name"),
    ("reg.io/app:bad tag", "bad tag"),
    ("reg.io/app@sha256:xyz", "bad digest"),
    ("registry..example.com/x/y:z", "names no registry"),  # urllib3's traceback before
    ("127.0.0.1:99999/a/b:c", "port 99999 is not a port"),
    ("127.0.0.1:0/a/b:c", "port 0 is not a port"),
])
def test_reference_errors(text, why):
    with pytest.raises(GpusnapError, match=why):
        reference.parse(text)
    assert reference.try_parse(text) is None


def test_docker_hub_endpoint():
    assert reference.parse("docker.io/library/x:1").endpoint == "registry-1.docker.io"


def test_credentials_most_specific_key_wins(tmp_path):
    def enc(u, p):
        return base64.b64encode(f"{u}:{p}".encode()).decode()
    f = tmp_path / "auth.json"
    f.write_text(json.dumps({"auths": {
        "reg.io": {"auth": enc("host", "1")},
        "reg.io/team": {"auth": enc("team", "2")},
        "https://other.io:5000": {"auth": enc("other", "3")},
    }}))
    assert auth.find_credentials("reg.io", "team/app", str(f)).username == "team"
    assert auth.find_credentials("reg.io", "elsewhere/app", str(f)).username == "host"
    assert auth.find_credentials("other.io:5000", "x", str(f)).password == "3"
    assert auth.find_credentials("none.io", "x", str(f)) is None


def test_credentials_search_order(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "run"))
    monkeypatch.setenv("REGISTRY_AUTH_FILE", str(tmp_path / "first.json"))
    files = auth.auth_files()
    assert files[0] == tmp_path / "first.json"
    assert files[1] == tmp_path / "run/containers/auth.json"
    assert files[-1].name == "config.json"


def test_parse_bearer_challenge():
    scheme, params = auth.parse_challenge(
        'Bearer realm="https://auth.io/token",service="reg.io",scope="repository:a:pull"')
    assert scheme == "bearer"
    assert params == {"realm": "https://auth.io/token", "service": "reg.io",
                      "scope": "repository:a:pull"}


def _chunks(data: bytes, params: chunker.ChunkParams) -> list[bytes]:
    return list(chunker.split(io.BytesIO(data), params, len(data)))


def test_chunks_rejoin_and_respect_bounds():
    params = chunker.ChunkParams(64 << 10, 256 << 10, 1 << 20)
    data = random.Random(1).randbytes(12 << 20)
    chunks = _chunks(data, params)
    assert b"".join(chunks) == data
    assert all(params.min_size <= len(c) <= params.max_size for c in chunks[:-1])
    mean = len(data) / len(chunks)
    assert 0.6 * params.avg_size < mean < 1.5 * params.avg_size


def test_zero_data_cuts_at_max_size():
    params = chunker.ChunkParams(64 << 10, 256 << 10, 1 << 20)
    assert [len(c) for c in _chunks(bytes(3 << 20), params)] == [1 << 20] * 3


def test_inserted_page_changes_only_the_chunks_around_it():
    """Content-defined: boundaries move with the data (a fixed grid would lose
    every chunk after the insertion)."""
    params = chunker.ChunkParams(64 << 10, 256 << 10, 1 << 20)
    rnd = random.Random(2)
    data = rnd.randbytes(16 << 20)
    changed = data[:5 << 20] + rnd.randbytes(4096) + data[5 << 20:]
    before = {hashlib.sha256(c).digest() for c in _chunks(data, params)}
    after = _chunks(changed, params)
    new = [c for c in after if hashlib.sha256(c).digest() not in before]
    assert sum(map(len, new)) <= 3 * params.max_size
    assert len(new) <= 3


def test_no_chunk_crosses_a_segment_so_segments_chunk_alone_alike():
    """Worker processes chunk a file's segments apart (gpusnap/oci/segments.py):
    their chunks must be the ones a single stream over the whole file cuts."""
    params = chunker.ChunkParams(4096, 16384, 65536)
    data = random.Random(3).randbytes(3 * params.segment + 12345)
    whole = _chunks(data, params)
    ends, pos = set(), 0
    for c in whole:
        pos += len(c)
        ends.add(pos)
    assert {k * params.segment for k in (1, 2, 3)} <= ends
    apart = [c for k in range(4) for c in _chunks(data[k * params.segment:(k + 1) * params.segment], params)]
    assert apart == whole


def test_chunk_sizes_grow_with_files_and_checkpoints():
    assert chunk_params(10 << 10, 1).avg_size == 256 << 10
    assert chunk_params(64 << 20, 1).avg_size == 256 << 10
    assert chunk_params(1 << 30, 1).avg_size == 2 << 20
    assert chunk_params(2 << 30, 1).avg_size == 4 << 20
    assert chunk_params(80 << 30, 1).avg_size == 4 << 20
    assert layer_scale(1 << 30) == 1
    assert layer_scale(200 << 30) > 1
    # worst case stays under the manifest's layer limit
    size = 200 << 30
    assert size / chunk_params(size, layer_scale(size)).avg_size < bundle.MAX_LAYERS


def _bundle() -> bundle.Bundle:
    c = bundle.Chunk("sha256:" + "1" * 64, 10, "sha256:" + "2" * 64, 5)
    files = [bundle.FileEntry("checkpoint", "dir", mode=0o700),
             bundle.FileEntry("checkpoint/pages-1.img", "file", size=20, chunks=[c, c]),
             bundle.FileEntry("link", "symlink", linkname="checkpoint")]
    return bundle.Bundle(files=files, summary={"container": {"name": "web"}}, gpu_manifest=None,
                         chunking={}, compression={"algorithm": "zstd"})


def test_config_round_trip_and_manifest():
    b = _bundle()
    again = bundle.Bundle.from_json(b.to_json(), "x")
    assert again.files == b.files and again.summary == b.summary
    body = bundle.build_manifest(b, "sha256:" + "3" * 64, 99, {"a": "b"}, None)
    m = bundle.parse_manifest(body, "", "ref")
    assert m["artifactType"] == bundle.ARTIFACT_TYPE
    assert len(m["layers"]) == 1  # one blob, used twice
    assert m["layers"][0]["annotations"][bundle.TITLE].startswith("chunk-")
    notes = bundle.annotations(b, "4.1.1", "x86_64")
    assert notes["io.gpusnap.container.name"] == "web"
    assert notes["io.gpusnap.gpu.count"] == "0"
    assert notes["io.gpusnap.criu.version"] == "4.1.1"


def test_other_artifacts_are_refused():
    image = json.dumps({"schemaVersion": 2, "mediaType": bundle.OCI_MANIFEST,
                        "config": {"mediaType": "application/vnd.oci.image.config.v1+json"}})
    with pytest.raises(GpusnapError, match="not a gpusnap checkpoint"):
        bundle.parse_manifest(image.encode(), "", "ref")
    with pytest.raises(GpusnapError, match="not readable"):
        bundle.Bundle.from_json(b'{"schema": "other"}', "ref")


def test_directory_to_archive_round_trip(tmp_path):
    src = tmp_path / "src"
    (src / "checkpoint").mkdir(parents=True)
    (src / "checkpoint" / "pages-1.img").write_bytes(os.urandom(70000))
    (src / "config.dump").write_text("{}")
    (src / "spec.dump").write_text("{}")
    (src / "attach").write_text("podman runtime file, not exported")
    (src / "gpusnap-manifest.json").write_text("{}")
    out = tmp_path / "out.tar"
    writer = tarfiles.ArchiveWriter(out)
    names = []
    for entry, data in tarfiles.directory_entries(src):
        names.append(entry.path)
        writer.add(entry, [data.read()] if data else [])
    writer.commit()
    assert names[0] == "gpusnap-manifest.json"  # restore checks read it first
    assert "attach" not in names
    with tarfile.open(out) as tar:
        got = tar.extractfile("checkpoint/pages-1.img").read()
    assert got == (src / "checkpoint" / "pages-1.img").read_bytes()
    assert not list(tmp_path.glob(".*partial"))
    with tarfiles.archive_entries(out) as entries:
        assert [e.path for e, _ in entries] == names


def test_archive_writer_refuses_short_data(tmp_path):
    writer = tarfiles.ArchiveWriter(tmp_path / "x.tar")
    with pytest.raises(GpusnapError, match="damaged"):
        writer.add(bundle.FileEntry("f", "file", size=10), [b"12345"])
    writer.abort()
    assert list(tmp_path.iterdir()) == []


def test_cache_checks_what_it_returns(tmp_path):
    cache = ChunkCache(tmp_path / "c", max_bytes=10)
    data = b"chunk bytes"
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    cache.put_blob(digest, data)
    assert cache.get_blob(digest) == data
    assert oct((tmp_path / "c").stat().st_mode & 0o777) == "0o700"
    path = cache._path("blobs", digest)
    path.write_bytes(b"damaged")
    assert cache.get_blob(digest) is None and not path.exists()
    cache.remember("sha256:" + "1" * 64, digest, 11)
    assert cache.blob_for("sha256:" + "1" * 64) == (digest, 11)
    cache.put_blob(digest, data)
    assert cache.has_blob(digest)
    assert cache.prune(keep=frozenset([digest])) == 0  # a prefetched checkpoint's: kept
    assert cache.prune() == len(data)  # over max_bytes: dropped
    assert not cache.has_blob(digest)


def test_registry_packages_missing_is_one_clear_error(monkeypatch):
    """The GPU hosts lack requests/zstandard: only the registry commands need them."""
    from gpusnap.oci.registry import RegistryClient, RegistryOptions

    monkeypatch.setitem(__import__("sys").modules, "requests", None)
    client = RegistryClient(reference.parse("reg.io/a:b"), RegistryOptions())  # no request yet
    with pytest.raises(GpusnapError, match="needs? the Python package 'requests'"):
        client.ping()


def test_byte_budget_bounds_bytes_and_lets_a_big_chunk_through_alone():
    import threading

    from gpusnap.oci.transfer import ByteBudget

    budget = ByteBudget(10)
    budget.acquire(6)
    assert budget.fits(4) and not budget.fits(5)
    got = threading.Event()

    def big() -> None:
        budget.acquire(25)  # larger than the whole budget: waits until it is alone
        got.set()

    t = threading.Thread(target=big)
    t.start()
    assert not got.wait(0.2)
    budget.release(6)
    assert got.wait(5)
    t.join()
    assert budget.used == 25 and not budget.fits(1)


def test_podman_checkpoint_image_annotations_and_refusal():
    from gpusnap.oci import podman_image

    assert podman_image.criu_number("4.1.1") == "40101"
    assert podman_image.criu_number("3.17") == "31700"
    assert podman_image.criu_number(None) == ""
    info = {"version": {"Version": "4.3.1"},
            "host": {"arch": "amd64", "kernel": "6.1", "cgroupVersion": "v2",
                     "ociRuntime": {"name": "crun", "version": "crun 1.8"},
                     "conmon": {"version": "conmon 2.1"},
                     "distribution": {"distribution": "debian", "version": "12"}}}
    config = {"name": "ctr", "rootfsImageName": "localhost/app:latest", "runtime": "runc"}
    notes = podman_image.annotations(config, info, "4.1.1")
    # Podman restores only with the runtime the checkpoint was made by.
    assert notes[podman_image.RUNTIME_NAME] == "runc"
    assert notes[podman_image.NAME] == "ctr"
    assert notes[podman_image.PREFIX + "criu.version"] == "40101"
    body = podman_image.manifest("sha256:" + "c" * 64, 10, "sha256:" + "l" * 64, 99, notes)
    with pytest.raises(bundle.PodmanCheckpointImage) as err:
        bundle.parse_manifest(body, podman_image.OCI_MANIFEST, "reg/x:v1")
    assert "podman container restore reg/x:v1" in err.value.hint
    summary = podman_image.summary(json.loads(body), "reg/x:v1")
    assert summary["container"]["name"] == "ctr" and summary["stored_bytes"] == 99
    with pytest.raises(GpusnapError, match="which OCI runtime"):
        podman_image.annotations({"name": "ctr"}, {"host": {}}, None)


def test_a_push_taken_again_rewinds_the_bar_by_what_its_attempt_reported():
    seen: list[tuple[int, int]] = []
    first = _Counted(lambda raw, network: seen.append((raw, network)))
    first(100, 40)
    first(50, 0)
    first.rewind()
    first.rewind()  # once: the second has nothing to take back
    assert seen == [(100, 40), (50, 0), (-150, 0)]
    _Counted(None)(10, 10)  # no bar: counted, nothing called


def test_a_push_taken_again_counts_what_every_try_sent(monkeypatch):
    """bytes_sent is the network's cost: a --leave-running snapshot refused after
    its chunks went out still sent them."""
    from gpusnap.ops import push as push_ops
    from gpusnap.ops.checkpoint import StaleSnapshot
    tries = []

    def once(job, counted):
        tries.append(counted)
        counted(1000, 300)
        if len(tries) == 1:
            raise StaleSnapshot("web", ["/tmp/c"])
        return {"bytes_sent": 300}
    monkeypatch.setattr(push_ops, "_push_once", once)
    result = push_ops._push_tries(object(), None, "web")
    assert result["bytes_sent"] == 600
    assert result["retaken"] == {"tries": 2, "files": ["/tmp/c"], "bytes_sent_before": 300}
