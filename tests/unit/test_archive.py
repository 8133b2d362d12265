"""gpusnap.archive: checkpoint directories and export archives (zstd, gzip, tar) read back,
and every damaged or foreign file turned into one GpusnapError."""

from __future__ import annotations

import gzip
import io
import json
import random
import subprocess
import tarfile
from pathlib import Path

import pytest

from gpusnap import MANIFEST_NAME, archive
from gpusnap.errors import GpusnapError
from gpusnap.gpu.manifest import SCHEMA


def noise(size: int, seed: int = 0) -> bytes:
    """Incompressible but reproducible bytes."""
    return random.Random(seed).randbytes(size)


CONFIG = {"name": "trainer", "id": "c0ffee" * 10 + "abcd", "rootfsImageName": "localhost/cuda:1",
          "createdTime": "2024-05-01T10:00:00Z", "runtime": "runc"}
SPEC = {"linux": {"devices": [{"path": "/dev/nvidia0", "type": "c", "major": 195, "minor": 0},
                              {"path": "/dev/nvidiactl", "type": "c", "major": 195, "minor": 255}]}}
MANIFEST = {
    "schema": SCHEMA, "quiesced_by": "gpusnap", "driver_version": "580.159.04",
    "cuda_driver_version": "13.0", "criu_version": "4.1.1",
    "gpus": [{"index": 0, "uuid": "GPU-11111111-2222-3333-4444-555555555555",
              "name": "NVIDIA H100", "minor": 0, "pci_bus_id": "00000000:18:00.0",
              "memory_total": 85899345920, "compute_capability": "9.0", "mig_enabled": False}],
    "processes": [{"pid": 42, "comm": "python3", "gpus": ["GPU-11111111-2222-3333-4444-555555555555"],
                   "gpu_memory": {"GPU-11111111-2222-3333-4444-555555555555": 3 << 30}}],
    "timing": {"lock": 0.01, "checkpoint": 1.5}, "host": {"hostname": "gpu1"},
    "created": "2024-05-01T10:00:01Z",
}
# relative path -> contents: a small Podman export, CRIU images under checkpoint/
FILES = {
    "config.dump": json.dumps(CONFIG).encode(),
    "spec.dump": json.dumps(SPEC).encode(),
    "stats-dump": b'{"CheckpointDuration": 1}',
    "network.status": b"[]",
    "rootfs-diff.tar": b"r" * 3000,
    "checkpoint/inventory.img": b"i" * 20,
    "checkpoint/core-1.img": b"c" * 700,
    "checkpoint/mm-1.img": b"m" * 300,
    "checkpoint/mm-42.img": b"m" * 310,
    "checkpoint/pagemap-1.img": b"p" * 64,
    "checkpoint/pages-1.img": noise(8192, 1),
    "checkpoint/pages-2.img": noise(4096, 2),
    f"checkpoint/{MANIFEST_NAME}": json.dumps(MANIFEST).encode(),
}


def make_dir(root: Path, files: dict[str, bytes] = FILES) -> Path:
    for name, data in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return root


def tar_bytes(members: list[tuple[str, bytes]], trailer: bool = True) -> bytes:
    """A tar stream of ``members``; without ``trailer`` it stops right after the last one."""
    out = b""
    for name, data in members:
        info = tarfile.TarInfo(name)
        info.size = len(data)
        out += info.tobuf(tarfile.PAX_FORMAT) + data + b"\0" * (-len(data) % tarfile.BLOCKSIZE)
    return out + (b"\0" * 2 * tarfile.BLOCKSIZE if trailer else b"")


def tar_of_dir(root: Path) -> bytes:
    """As `tar -C root -cf - .` would write it: ./-prefixed names, directories included."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        tar.add(root, arcname=".")
    return buf.getvalue()


def zstd(data: bytes) -> bytes:
    return subprocess.run(["zstd", "-q", "-c"], input=data, capture_output=True, check=True).stdout


def gz(data: bytes) -> bytes:
    return gzip.compress(data, mtime=0)


def write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


@pytest.fixture
def userdata(tmp_path: Path) -> Path:
    return make_dir(tmp_path / "userdata")


@pytest.fixture(params=["zstd", "gzip", "tar"])
def exported(request, tmp_path: Path, userdata: Path) -> Path:
    raw = tar_of_dir(userdata)
    data = {"zstd": zstd, "gzip": gz, "tar": lambda b: b}[request.param](raw)
    return write(tmp_path / f"ctr.{request.param}", data)


# --- round trip ---------------------------------------------------------------------------

def test_archive_holds_every_file_with_its_size(exported: Path):
    contents = archive.read(str(exported))
    assert contents.sizes == {name: len(data) for name, data in FILES.items()}


def test_archive_keeps_the_metadata_files_and_nothing_else(exported: Path):
    contents = archive.read(str(exported))
    assert set(contents.files) == {"config.dump", "spec.dump", "stats-dump", "network.status",
                                   f"checkpoint/{MANIFEST_NAME}"}
    assert contents.json_file("config.dump") == CONFIG


def test_archive_reads_the_gpu_manifest(exported: Path):
    manifest = archive.read(str(exported)).manifest
    assert manifest is not None
    assert manifest.gpus == MANIFEST["gpus"]
    assert [p.pid for p in manifest.processes] == [42]


def test_summary_describes_container_images_and_gpus(exported: Path):
    s = archive.read(str(exported)).summary()
    assert s["source"] == str(exported)
    assert s["container"] == {"name": "trainer", "id": CONFIG["id"], "image": "localhost/cuda:1",
                              "created": "2024-05-01T10:00:00Z"}
    assert s["runtime"] == "runc"
    assert s["devices"] == ["/dev/nvidia0", "/dev/nvidiactl"]
    images = {n: len(d) for n, d in FILES.items() if n.startswith("checkpoint/")}
    assert s["criu"] == {"processes": 2, "memory_pages_bytes": 8192 + 4096,
                         "images_bytes": sum(images.values())}
    assert s["rootfs_diff_bytes"] == 3000
    assert s["total_bytes"] == sum(len(d) for d in FILES.values())
    gpu = s["gpu"]
    assert gpu["quiesced_by"] == "gpusnap" and gpu["driver"] == "580.159.04"
    assert gpu["gpu_memory_bytes"] == 3 << 30
    assert gpu["processes"][0]["comm"] == "python3"
    assert gpu["timing"] == {"lock": 0.01, "checkpoint": 1.5}


def test_directory_and_its_archive_summarise_alike(exported: Path, userdata: Path):
    from_archive = archive.read(str(exported)).summary()
    from_dir = archive.read(str(userdata)).summary()
    assert from_dir["source"] == str(userdata)
    del from_archive["source"], from_dir["source"]
    assert from_archive == from_dir


def test_checkpoint_without_manifest_has_no_gpu_section(tmp_path: Path):
    files = {k: v for k, v in FILES.items() if MANIFEST_NAME not in k}
    path = write(tmp_path / "cpu.tar.zst", zstd(tar_of_dir(make_dir(tmp_path / "d", files))))
    contents = archive.read(str(path))
    assert contents.manifest is None
    assert contents.summary()["gpu"] is None


def test_bare_criu_image_dir_is_presented_as_checkpoint(tmp_path: Path):
    images = make_dir(tmp_path / "images", {"inventory.img": b"x" * 5, "pages-1.img": b"p" * 4096,
                                            MANIFEST_NAME: json.dumps(MANIFEST).encode()})
    contents = archive.read(str(images))
    assert contents.sizes["checkpoint/pages-1.img"] == 4096
    assert contents.sizes["checkpoint/inventory.img"] == 5
    assert contents.manifest is not None and contents.manifest.criu_version == "4.1.1"
    assert not contents.is_podman_checkpoint


def gpusnap_export(big: bytes) -> bytes:
    """gpusnap's own order: the manifest first, then the config files, then the images."""
    return tar_bytes([(MANIFEST_NAME, json.dumps(MANIFEST).encode()),
                      ("config.dump", FILES["config.dump"]), ("spec.dump", FILES["spec.dump"]),
                      ("checkpoint/inventory.img", b"i" * 20), ("checkpoint/pages-1.img", big)])


def test_head_only_stops_after_the_metadata_of_a_gpusnap_export(tmp_path: Path):
    path = write(tmp_path / "big.tar.zst", zstd(gpusnap_export(noise(4 << 20, 3))))
    head = archive.read(str(path), head_only=True)
    assert "checkpoint/pages-1.img" not in head.sizes  # never read that far
    assert head.manifest is not None and head.json_file("config.dump") == CONFIG
    assert archive.read(str(path)).sizes["checkpoint/pages-1.img"] == 4 << 20


# --- damaged or foreign files -------------------------------------------------------------

def test_missing_file_is_one_clear_error(tmp_path: Path):
    with pytest.raises(GpusnapError, match=r"^no such file: .*nowhere\.tar\.zst$"):
        archive.read(str(tmp_path / "nowhere.tar.zst"))


def test_unreadable_path_is_a_gpusnap_error(tmp_path: Path):
    with pytest.raises(GpusnapError, match="cannot read"):
        archive.read_archive(tmp_path)  # a directory cannot be opened as a file


@pytest.mark.parametrize("data", [b"", b"hello, this is just text\n" * 50, noise(3000, 4)],
                         ids=["empty", "text", "random"])
def test_file_that_is_no_archive_is_rejected(tmp_path: Path, data: bytes):
    path = write(tmp_path / "x.tar", data)
    with pytest.raises(GpusnapError) as info:
        archive.read(str(path))
    assert info.value.message.startswith(f"{path} is not a readable checkpoint archive")
    assert "checkpoint --export" in info.value.hint


def test_compressed_text_is_rejected(tmp_path: Path):
    for name, data in (("t.zst", zstd(b"not a tar " * 1000)), ("t.gz", gz(b"plain" * 99))):
        with pytest.raises(GpusnapError, match="is not a readable checkpoint archive"):
            archive.read(str(write(tmp_path / name, data)))


def test_zstd_magic_followed_by_garbage_is_rejected(tmp_path: Path):
    path = write(tmp_path / "bad.zst", b"\x28\xb5\x2f\xfd" + noise(500, 5))
    with pytest.raises(GpusnapError) as info:
        archive.read(str(path))
    assert str(path) in info.value.message
    assert "damaged or truncated" in str(info.value)


@pytest.mark.parametrize("kind", ["zstd", "gzip", "tar"])
def test_archive_cut_in_the_middle_is_rejected(tmp_path: Path, userdata: Path, kind: str):
    raw = tar_of_dir(userdata)
    data = {"zstd": zstd, "gzip": gz, "tar": lambda b: b}[kind](raw)
    path = write(tmp_path / "cut", data[: len(data) // 2])
    with pytest.raises(GpusnapError) as info:
        archive.read(str(path))
    assert str(path) in info.value.message


def test_zstd_archive_cut_between_two_members_is_rejected(tmp_path: Path):
    # The stream stops exactly at a tar header: tar alone sees a clean end, zstd
    # knows the frame after it is cut off. Nothing may pass as a whole checkpoint.
    members = [(n, FILES[n]) for n in ("config.dump", "spec.dump", "checkpoint/inventory.img")]
    head = zstd(tar_bytes(members, trailer=False))
    tail = zstd(tar_bytes([("checkpoint/pages-1.img", noise(50_000, 6))]))
    whole = write(tmp_path / "whole.tar.zst", head + tail)
    assert "checkpoint/pages-1.img" in archive.read(str(whole)).sizes  # concatenated frames are fine
    cut = write(tmp_path / "cut.tar.zst", head + tail[: len(tail) // 2])
    with pytest.raises(GpusnapError, match="damaged or truncated"):
        archive.read(str(cut))


def test_tar_without_a_checkpoint_is_the_wrong_kind(tmp_path: Path):
    path = write(tmp_path / "photos.tar.zst", zstd(tar_bytes([("holiday.jpg", b"\xff\xd8" * 100)])))
    with pytest.raises(GpusnapError) as info:
        archive.read(str(path))
    assert info.value.message == (f"{path} is not a Podman checkpoint archive "
                                  "(no spec.dump, config.dump and checkpoint/ inside)")


def test_podman_files_without_criu_images_are_the_wrong_kind(tmp_path: Path):
    members = [("config.dump", FILES["config.dump"]), ("spec.dump", FILES["spec.dump"])]
    with pytest.raises(GpusnapError, match="is not a Podman checkpoint archive"):
        archive.read(str(write(tmp_path / "half.tar", tar_bytes(members))))


def test_invalid_json_in_config_dump_is_a_clear_error(tmp_path: Path):
    files = dict(FILES, **{"config.dump": b"{not json"})
    path = write(tmp_path / "c.tar.zst", zstd(tar_of_dir(make_dir(tmp_path / "d", files))))
    contents = archive.read(str(path))
    with pytest.raises(GpusnapError, match=r"config\.dump is not valid JSON"):
        contents.summary()


def test_malformed_manifest_in_an_archive_is_a_gpusnap_error(tmp_path: Path):
    bad = dict(MANIFEST)
    del bad["gpus"]
    files = dict(FILES, **{f"checkpoint/{MANIFEST_NAME}": json.dumps(bad).encode()})
    path = write(tmp_path / "m.tar.zst", zstd(tar_of_dir(make_dir(tmp_path / "d", files))))
    contents = archive.read(str(path))
    with pytest.raises(GpusnapError) as info:
        contents.summary()
    assert info.value.message == f"{path}: GPU manifest: missing field(s) gpus"


@pytest.mark.parametrize("pack", ["zstd", "gzip", "tar"])
def test_an_archive_cut_between_two_files_is_said_to_be_cut_short(tmp_path: Path, userdata: Path,
                                                                 pack: str):
    # An interrupted copy that ends exactly after a member reads as a whole tar
    # to tarfile, one file short: pushed, it became a checkpoint without its pages.
    raw = tar_of_dir(userdata)
    with tarfile.open(fileobj=io.BytesIO(raw)) as tar:
        last = tar.getmembers()[-1]
    cut = raw[:last.offset]  # everything before the last member's header
    data = {"zstd": zstd, "gzip": gz, "tar": lambda b: b}[pack](cut)
    path = write(tmp_path / f"cut.{pack}", data)
    with pytest.raises(GpusnapError) as info:
        archive.read(str(path))
    assert info.value.message == (f"{path} is cut short (it ends between two files, before the "
                                  "tar's end): a copy or an export that did not finish")
    assert info.value.hint == "copy it again, or export the container again"


def test_an_archive_cut_inside_a_file_is_said_to_be_cut_short(tmp_path: Path, userdata: Path):
    data = gz(tar_of_dir(userdata))
    path = write(tmp_path / "cut.tar.gz", data[:len(data) // 2])
    with pytest.raises(GpusnapError, match=r"is cut short \(.*\): a copy or an export"):
        archive.read(str(path))


def test_a_folder_without_a_checkpoint_is_refused(tmp_path: Path):
    (tmp_path / "notes.txt").write_text("x")  # inspected as "container: None", exit 0, before
    with pytest.raises(GpusnapError, match=r"holds no checkpoint: neither a checkpoint/ folder"):
        archive.read(str(tmp_path))


@pytest.mark.parametrize("data", [b"[1]", b"[" * 100000], ids=["a-list", "too-deep"])
def test_a_config_of_the_wrong_shape_is_said_to_be_damaged(data: bytes):
    contents = archive.CheckpointContents(source="x.tar", files={"config.dump": data})
    with pytest.raises(GpusnapError) as info:  # AttributeError / RecursionError before
        contents.json_file("config.dump")
    assert info.value.message.startswith("x.tar: config.dump is ")
    assert info.value.hint == "the checkpoint is damaged: take it again"
