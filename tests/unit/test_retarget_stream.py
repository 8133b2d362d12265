"""runtime/retarget.py's tar walk: members as Go's tar (Podman's export) writes them."""

from __future__ import annotations

import io
import tarfile

from gpusnap.gpu.nodes import DeviceRemap
from gpusnap.runtime.retarget import BLOCK, rewrite_archive


def _header(name: str, size: int, typeflag: bytes = tarfile.REGTYPE) -> bytes:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.type = size, 0o600, typeflag
    return info.tobuf(format=tarfile.USTAR_FORMAT)


def _pax(records: dict[str, str]) -> bytes:
    body = b""
    for key, value in records.items():
        line = f" {key}={value}\n".encode()
        n = len(line) + 1
        while len(str(n)) + len(line) != n:  # the length counts its own digits
            n = len(str(n)) + len(line)
        body += str(n).encode() + line
    return _header("PaxHeaders/x", len(body), tarfile.XHDTYPE) + body + b"\0" * (-len(body) % BLOCK)


def _go_big_member(name: str, data: bytes) -> bytes:
    """A member as Go writes one of 8 GiB or more: its size in a PAX record
    only, the header's size field left 0 (scaled down here)."""
    return (_pax({"size": str(len(data))}) + _header(name, 0) + data
            + b"\0" * (-len(data) % BLOCK))


def test_a_member_whose_size_is_only_in_its_pax_record_is_copied_whole(tmp_path):
    pages = bytes(range(256)) * 40  # 10240 bytes, not a multiple of the block
    after = b"still read as a member"
    src = tmp_path / "big.tar"
    src.write_bytes(_go_big_member("checkpoint/pages-1.img", pages)
                    + _header("checkpoint/after.img", len(after)) + after
                    + b"\0" * (-len(after) % BLOCK) + b"\0" * (2 * BLOCK))
    out = tmp_path / "out.tar"
    with open(out, "wb") as f:
        rewrite_archive(src, f.fileno(), DeviceRemap(container_paths="keep"), {"moves": []})
    with tarfile.open(out) as tar:
        names = tar.getnames()
        assert tar.extractfile("checkpoint/pages-1.img").read() == pages
        assert tar.extractfile("checkpoint/after.img").read() == after
    assert names[-1] == "checkpoint/after.img" and "checkpoint/gpusnap-plan.json" in names


def test_a_pax_path_record_names_the_member(tmp_path):
    long_name = "checkpoint/" + "d" * 120 + "/pages-2.img"
    data = b"x" * 700
    src = tmp_path / "long.tar"
    src.write_bytes(_pax({"path": long_name, "size": str(len(data))}) + _header("short", 0)
                    + data + b"\0" * (-len(data) % BLOCK) + b"\0" * (2 * BLOCK))
    buf = tmp_path / "out.tar"
    with open(buf, "wb") as f:
        rewrite_archive(src, f.fileno(), DeviceRemap(container_paths="keep"), None)
    with tarfile.open(fileobj=io.BytesIO(buf.read_bytes())) as tar:
        assert tar.getnames() == [long_name]
        assert tar.extractfile(long_name).read() == data


def _member(name: str, data: bytes) -> bytes:
    return _header(name, len(data)) + data + b"\0" * (-len(data) % BLOCK)


def test_a_plan_that_moves_nothing_is_carried_with_every_member_as_it_was(tmp_path):
    # spec.dump written as no JSON encoder would: any edit would show
    spec = b'{"ociVersion":  "1.0.2", "linux": {"devices": [{"path": "/dev/nvidia0"}]}}'
    src = tmp_path / "in.tar"
    src.write_bytes(_member("spec.dump", spec) + _member("config.dump", b'{ "id": "x" }')
                    + _member("checkpoint/gpusnap-plan.json", b'{"moves": ["an older one"]}')
                    + _member("checkpoint/pages-1.img", b"p" * 600) + b"\0" * (2 * BLOCK))
    out = tmp_path / "out.tar"
    with open(out, "wb") as f:
        rewrite_archive(src, f.fileno(), DeviceRemap(), {"moves": ["this restore's"]})
    with tarfile.open(out) as tar:
        assert tar.extractfile("spec.dump").read() == spec
        assert tar.extractfile("config.dump").read() == b'{ "id": "x" }'
        # one plan, this restore's: an older restore's never overwrites it on extraction
        assert tar.getnames().count("checkpoint/gpusnap-plan.json") == 1
        assert tar.extractfile("checkpoint/gpusnap-plan.json").read() == \
            b'{"moves": ["this restore\'s"]}'
        assert tar.extractfile("checkpoint/pages-1.img").read() == b"p" * 600


def test_a_streamed_restore_that_moves_nothing_carries_only_its_plan():
    from gpusnap.runtime.retarget import edit_members

    head = {"spec.dump": b'{"ociVersion":  "1.0.2"}', "config.dump": b'{ "id": "x" }'}
    assert edit_members(head, DeviceRemap(), {"moves": []}) == \
        {"checkpoint/gpusnap-plan.json": b'{"moves": []}'}


def _damaged_zstd(tmp_path, name: str = "damaged"):
    """A tar of incompressible pages, zstd-compressed (raw blocks, which only
    the frame's checksum guards) with one byte flipped in the pages."""
    import os
    import subprocess

    pages = os.urandom(1 << 20)
    tar = tmp_path / f"{name}.tar"
    tar.write_bytes(_header("checkpoint/pages-1.img", len(pages)) + pages + b"\0" * (2 * BLOCK))
    subprocess.run(["zstd", "-q", "-f", str(tar), "-o", str(tar) + ".zst"], check=True)
    good = tar.read_bytes()
    raw = bytearray((tmp_path / f"{name}.tar.zst").read_bytes())
    at = raw.index(pages[1000:1064])  # stored as it is in a raw block
    raw[at] ^= 0x01
    bad = tmp_path / f"{name}-bad.tar.zst"
    bad.write_bytes(bytes(raw))
    return tmp_path / f"{name}.tar.zst", bad, good


def _served(archive, tmp_path) -> tuple[bytes, str]:
    import os
    import threading

    from gpusnap.runtime import fifo_pump

    error = tmp_path / "pump.error"
    error.unlink(missing_ok=True)
    r, w = os.pipe()
    threading.Thread(target=fifo_pump._serve_one, args=(w, str(archive), error)).start()
    out = b""
    with os.fdopen(r, "rb") as f:
        while chunk := f.read(1 << 16):
            out += chunk
    return out, error.read_text() if error.exists() else ""


def test_a_zst_archive_whose_checksum_fails_never_reaches_its_end_blocks(tmp_path):
    from gpusnap.runtime.stream import BROKEN_END

    good_zst, bad_zst, good = _damaged_zstd(tmp_path)
    out, error = _served(good_zst, tmp_path)
    assert out == good and error == ""
    out, error = _served(bad_zst, tmp_path)
    assert out.endswith(BROKEN_END) and not out.endswith(b"\0" * (2 * BLOCK))
    assert "is damaged: zstd" in error


def test_a_retargeted_zst_archive_whose_checksum_fails_ends_broken(tmp_path):
    import pytest

    from gpusnap.errors import GpusnapError
    from gpusnap.runtime.stream import BROKEN_END

    _, bad_zst, _ = _damaged_zstd(tmp_path)
    out = tmp_path / "out.tar"
    with open(out, "wb") as f, pytest.raises(GpusnapError, match="not a (valid|readable)"):
        rewrite_archive(bad_zst, f.fileno(), DeviceRemap(container_paths="keep"), {"moves": []})
    assert out.read_bytes().endswith(BROKEN_END)


def test_a_damaged_zst_archive_with_long_padding_is_refused_too(tmp_path):
    # zstd killed by EPIPE while it still wrote the padding reported no error
    import os
    import subprocess

    import pytest

    from gpusnap.errors import GpusnapError

    pages = os.urandom(1 << 20)
    tar = tmp_path / "padded.tar"
    tar.write_bytes(_header("checkpoint/pages-1.img", len(pages)) + pages + b"\0" * (2 * BLOCK)
                    + b"\0" * (2 << 20))
    subprocess.run(["zstd", "-q", "-f", str(tar), "-o", str(tar) + ".zst"], check=True)
    raw = bytearray((tmp_path / "padded.tar.zst").read_bytes())
    raw[raw.index(pages[5000:5064])] ^= 0x01
    bad = tmp_path / "padded-bad.tar.zst"
    bad.write_bytes(bytes(raw))
    with open(tmp_path / "out.tar", "wb") as f, pytest.raises(GpusnapError):
        rewrite_archive(bad, f.fileno(), DeviceRemap(container_paths="keep"), {"moves": []})
    with open(tmp_path / "good.tar", "wb") as f:  # the undamaged one still passes
        rewrite_archive(tmp_path / "padded.tar.zst", f.fileno(), DeviceRemap(container_paths="keep"),
                        {"moves": []})


def test_a_damaged_zst_archive_padded_past_the_pumps_hold_never_reaches_its_end_blocks(tmp_path):
    """The end blocks followed by 2 MiB of zeros (more than the 64 KiB held back
    for zstd's checksum): the zeros are held too, and given only once it passed."""
    import os
    import subprocess

    from gpusnap.runtime.stream import BROKEN_END

    pages = os.urandom(1 << 20)
    tar = tmp_path / "padded.tar"
    good = (_header("checkpoint/pages-1.img", len(pages)) + pages + bytes(3 << 20) + b"x" * 512
            + b"\0" * (2 * BLOCK) + bytes(2 << 20))
    tar.write_bytes(good)
    subprocess.run(["zstd", "-q", "-f", str(tar), "-o", str(tar) + ".zst"], check=True)
    out, error = _served(tmp_path / "padded.tar.zst", tmp_path)
    assert out == good and error == ""
    raw = bytearray((tmp_path / "padded.tar.zst").read_bytes())
    raw[raw.index(pages[5000:5064])] ^= 0x01
    bad = tmp_path / "padded-bad.tar.zst"
    bad.write_bytes(bytes(raw))
    out, error = _served(bad, tmp_path)
    # everything up to the last data, none of the zeros after it: no end blocks
    assert len(out) == good.index(b"x" * 512) + 512 + len(BROKEN_END) and out.endswith(BROKEN_END)
    assert "is damaged: zstd" in error
