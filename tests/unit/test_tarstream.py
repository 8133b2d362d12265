"""tarstream: headers by tarfile, member data straight from the stream, for a
plain file (lseek), a zstd archive (a pipe) and a growing file's reader."""

from __future__ import annotations

import io
import os
import subprocess
import tarfile
from pathlib import Path

import pytest

from gpusnap.oci.tarfiles import archive_entries
from gpusnap.tarstream import TarStream

FILES = {"config.dump": b"{}", "checkpoint/pages-1.img": os.urandom(3 << 20) + b"x" * 7,
         "checkpoint/long/" + "n" * 150: b"pax path", "empty": b"",
         "devshm-checkpoint.tar": bytes(2 << 20)}


def _tar(path: Path) -> Path:
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in FILES.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        info = tarfile.TarInfo("checkpoint/dir")
        info.type = tarfile.DIRTYPE
        tar.addfile(info)
    return path


@pytest.fixture(params=["plain", "zstd", "source"])
def archive(request, tmp_path) -> tuple[Path, object]:
    plain = _tar(tmp_path / "a.tar")
    if request.param == "zstd":
        subprocess.run(["zstd", "-q", str(plain), "-o", str(tmp_path / "a.tar.zst")], check=True)
        return tmp_path / "a.tar.zst", None
    if request.param == "source":  # a reader that hands out short pieces, like a pipe
        class Pipe(io.RawIOBase):
            def __init__(self) -> None:
                self.f = open(plain, "rb")

            def readable(self) -> bool:
                return True

            def readinto(self, b) -> int:
                return self.f.readinto(memoryview(b)[:7001])

            def close(self) -> None:
                self.f.close()
                super().close()
        return plain, Pipe()
    return plain, None


def test_every_member_read_in_pieces_is_its_bytes(archive):
    path, source = archive
    got = {}
    with archive_entries(path, source) as entries:
        for entry, data in entries:
            if data is None:
                continue
            buf = bytearray(1 << 20)
            out = bytearray()
            while n := data.readinto(buf):
                out += buf[:n]
            got[entry.path] = bytes(out)
    assert got == FILES


def test_members_whose_data_is_not_read_are_skipped(archive):
    path, source = archive
    stream = TarStream(path, source)
    names = [m.name for m in stream.tar]
    assert names[:2] == ["config.dump", "checkpoint/pages-1.img"] and "checkpoint/dir" in names
    assert stream.close(read_to_end=True) is None


def test_a_truncated_plain_archive_is_an_error(tmp_path):
    plain = _tar(tmp_path / "a.tar")
    cut = tmp_path / "cut.tar"
    cut.write_bytes(plain.read_bytes()[:(1 << 20)])
    stream = TarStream(cut)
    member = next(m for m in stream.tar if m.name == "checkpoint/pages-1.img")
    with pytest.raises(tarfile.ReadError):
        stream.data(member).read()
    stream.close(read_to_end=False)
