"""runtime/follow.py: reading an export while another process still writes it."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from gpusnap.runtime.follow import follow


def _writer(partial: Path, final: Path, pieces: list[bytes], done: threading.Event,
            rename: bool = True, delay: float = 0.01) -> threading.Thread:
    def run() -> None:
        time.sleep(delay)  # the reader starts before the file exists
        with open(partial, "wb", buffering=0) as f:
            for piece in pieces:
                f.write(piece)
                time.sleep(delay)
        if rename:
            os.replace(partial, final)
        done.set()
    t = threading.Thread(target=run)
    t.start()
    return t


def test_reads_everything_written_while_it_grows_and_after_the_rename(tmp_path):
    partial, final = tmp_path / ".a.tar.partial", tmp_path / "a.tar"
    pieces = [bytes([i]) * (1000 + i) for i in range(20)]
    done = threading.Event()
    t = _writer(partial, final, pieces, done)
    with follow([partial, final], done.is_set, buffer=4096) as f:
        got = f.read()
    t.join()
    assert got == b"".join(pieces)


def test_a_writer_that_finished_before_the_reader_opened_is_found_under_the_final_name(tmp_path):
    partial, final = tmp_path / ".a.tar.partial", tmp_path / "a.tar"
    final.write_bytes(b"complete")
    with follow([partial, final], lambda: True) as f:
        assert f.read() == b"complete"


def test_no_file_once_finished_is_an_empty_stream(tmp_path):
    with follow([tmp_path / "never"], lambda: True) as f:
        assert f.read() == b""


def test_only_the_podman_seen_reading_config_first_gets_the_short_tar():
    from gpusnap.runtime.stream import config_only_opens, config_tar
    assert config_only_opens("4.3.1") == 2
    assert config_only_opens("4.9.4") == 0  # not seen: whole archive on every open
    assert config_only_opens("5.2.0") == 0 and config_only_opens("") == 0
    assert config_tar({"config.dump": b"{}"}) is None  # spec.dump missing: the whole archive
    import io
    import tarfile
    tar = config_tar({"config.dump": b"{}", "spec.dump": b"[]"})
    with tarfile.open(fileobj=io.BytesIO(tar)) as t:
        assert t.getnames() == ["config.dump", "spec.dump"]


def test_a_head_goes_ahead_of_the_file_once_its_writer_has_begun(tmp_path):
    """The head is asked for only when the file has its first byte (the GPU
    manifest exists by then), and an empty file that ends gets no head."""
    partial, final = tmp_path / ".a.tar.partial", tmp_path / "a.tar"
    partial.write_bytes(b"")  # made before the dump, written after it
    asked: list[int] = []

    def head() -> bytes:
        asked.append(partial.stat().st_size if partial.exists() else final.stat().st_size)
        return b"HEAD"
    done = threading.Event()
    t = _writer(partial, final, [b"a" * 100, b"b" * 100], done)
    with follow([partial, final], done.is_set, head=head, buffer=16) as f:
        got = f.read()
    t.join()
    assert got == b"HEAD" + b"a" * 100 + b"b" * 100
    assert len(asked) == 1 and asked[0] > 0

    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    with follow([empty], lambda: True, head=head) as f:
        assert f.read() == b""
    assert len(asked) == 1


def test_a_skip_waits_for_the_writer_and_moves_on_without_reading(tmp_path):
    """A member whose data is not needed: the head, the buffer and then the
    file are passed over; what follows is read as written."""
    partial, final = tmp_path / ".a.tar.partial", tmp_path / "a.tar"
    pieces = [bytes([65 + i]) * 1000 for i in range(10)]  # written slowly, after the skip began
    done = threading.Event()
    t = _writer(partial, final, pieces, done)
    with follow([partial, final], done.is_set, head=lambda: b"HEAD", buffer=64) as f:
        assert f.read(6) == b"HEADAA"
        f.skip(5000)  # past the head's end, the buffer and into bytes not yet written
        assert f.read(3) == b"FFF"
        f.skip(10_000)  # beyond what the writer ever writes: the stream ends
        assert f.read() == b""
    t.join()
    assert [f.name for f in tmp_path.iterdir()] == ["a.tar"]
