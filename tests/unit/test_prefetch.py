"""pages/prefetch.py: a file chunked while Podman writes it stands for the export's
member only if it is still that file; otherwise the export is read."""

from __future__ import annotations

import os
import random
import threading
import time
from concurrent.futures import Future
from pathlib import Path

from gpusnap.oci import chunker
from gpusnap.oci.bundle import FileEntry
from gpusnap.pages import prefetch
PARAMS = chunker.ChunkParams(4096, 16384, 65536)


class _Sink:
    """submit(): keeps each chunk; its future is the chunk itself."""

    def __init__(self) -> None:
        self.pieces: list[bytes] = []
        self.first_at: float | None = None

    def submit(self, piece: bytes) -> Future:
        if self.first_at is None:
            self.first_at = time.monotonic()
        self.pieces.append(piece)
        f: Future = Future()
        f.set_result(piece)
        return f


def _write_slowly(path: Path, data: bytes, done: threading.Event) -> threading.Thread:
    def run() -> None:
        time.sleep(0.02)  # the prefetcher starts before the file exists
        with open(path, "wb", buffering=0) as f:
            for off in range(0, len(data), 50_000):
                f.write(data[off:off + 50_000])
                time.sleep(0.01)
        done.done_at = time.monotonic()
        done.set()
    t = threading.Thread(target=run)
    t.start()
    return t


def _start(userdata: Path, sink: _Sink, writer_done) -> prefetch.Prefetch:
    (userdata / "shm").mkdir(exist_ok=True)
    return prefetch.Prefetch.for_podman(userdata, sink.submit, lambda size: PARAMS, writer_done)


def _entry(path: Path, name: str = prefetch.DEVSHM) -> FileEntry:
    st = os.stat(path)
    return FileEntry(path=name, type="file", size=st.st_size, mtime=int(st.st_mtime))


def test_the_file_read_while_written_stands_for_the_member(tmp_path):
    data = random.Random(1).randbytes(1_000_000)
    sink, done = _Sink(), threading.Event()
    target = tmp_path / prefetch.DEVSHM
    with _start(tmp_path, sink, done.is_set) as early:
        _write_slowly(target, data, done).join()
        futures = early.take(_entry(target))
        early.finish()
    assert futures is not None and early.taken_bytes == len(data)
    assert b"".join(f.result() for f in futures) == data
    assert sink.first_at < done.done_at  # chunks went out while the file grew


def test_a_file_replaced_after_it_was_read_is_read_from_the_export(tmp_path):
    sink, done = _Sink(), threading.Event()
    target = tmp_path / prefetch.DEVSHM
    with _start(tmp_path, sink, done.is_set) as early:
        _write_slowly(target, b"a" * 200_000, done).join()
        time.sleep(0.05)
        replacement = tmp_path / "other"
        replacement.write_bytes(b"b" * 200_000)
        os.replace(replacement, target)  # same size, another inode
        assert early.take(_entry(target)) is None


def test_a_member_of_another_size_is_read_from_the_export(tmp_path):
    sink, done = _Sink(), threading.Event()
    target = tmp_path / prefetch.DEVSHM
    with _start(tmp_path, sink, done.is_set) as early:
        _write_slowly(target, b"x" * 300_000, done).join()
        entry = _entry(target)
        entry.size -= 512
        assert early.take(entry) is None


def test_other_members_and_a_file_podman_never_wrote_are_left_to_the_export(tmp_path):
    sink, done = _Sink(), threading.Event()
    with _start(tmp_path, sink, done.is_set) as early:
        assert early.take(FileEntry(path="config.dump", type="file", size=10)) is None
        done.set()  # Podman finished without a /dev/shm tar: the thread ends by itself
        assert early.take(FileEntry(path=prefetch.DEVSHM, type="file", size=10)) is None
    assert sink.pieces == []


def test_a_failed_push_stops_the_prefetch_without_waiting_for_podman(tmp_path):
    sink = _Sink()
    target = tmp_path / prefetch.DEVSHM
    target.write_bytes(b"y" * 100_000)  # Podman still writing: never done
    t0 = time.monotonic()
    try:
        with _start(tmp_path, sink, lambda: False):
            time.sleep(0.05)
            raise RuntimeError("upload failed")
    except RuntimeError:
        pass
    assert time.monotonic() - t0 < 5


def test_the_estimate_counts_the_shm_files_as_tar_would(tmp_path):
    shm = tmp_path / "shm"
    (shm / "d").mkdir(parents=True)
    (shm / "a").write_bytes(b"1" * 1000)
    (shm / "d" / "b").write_bytes(b"")
    # two directories, two files: one header each, data in 512-byte blocks, the end
    assert prefetch.shm_estimate(tmp_path)() == 4 * 512 + 1024 + 1024


def test_a_failed_upload_of_an_early_chunk_fails_finish(tmp_path):
    taken = threading.Event()

    def submit(piece: bytes) -> Future:
        taken.wait(5)  # fails after take() counted on the early chunks
        raise OSError("the registry went away")
    (tmp_path / "shm").mkdir()
    target = tmp_path / prefetch.DEVSHM
    target.write_bytes(b"z" * 200_000)
    done = threading.Event()
    done.set()
    with prefetch.Prefetch.for_podman(tmp_path, submit, lambda size: PARAMS, done.is_set) as early:
        try:
            futures = early.take(_entry(target))
            taken.set()
            early.finish()
        except OSError as exc:
            assert "went away" in str(exc)
        else:
            raise AssertionError(f"finish() passed over the failure ({futures})")
