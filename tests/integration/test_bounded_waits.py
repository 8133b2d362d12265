"""Every wait has a bound: each kind of stall, driven with real processes.

The import stream's pump that dies under a reading Podman (the remap hang of
issue 36: Podman in open(2) on the FIFO, no writer ever), a Podman that never
opens its stream, a reader that opens it once more than Podman 4.3 does, and a
registry that takes the connection and sends nothing. Each ends within its
bound with one line, and the checkpoint stays restorable.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from gpusnap import archive, waits
from gpusnap.errors import GpusnapError
from gpusnap.gpu.nodes import DeviceRemap
from gpusnap.gpu.plan import Plan
from gpusnap.ops import restore as ops_restore
from gpusnap.runtime import stream as stream_module
from gpusnap.runtime.fifo_pump import referrers
from tests.conftest import (assert_continued, assert_one_line_error, born, gpusnap, gpusnap_json,
                            podman, read_counter, wait_counter)

# A remap that moves nothing still sends the archive through the rewriting
# pump, as a restore onto other GPUs does: the path that hung.
NO_MOVES = {"remap": DeviceRemap(container_paths="keep").to_dict(), "plan": None}


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def exported(counter, tmp_path) -> tuple[str, Path, int, str]:
    """The counter container, exported (zstd) and removed: (name, archive, its
    last count, its born token)."""
    out = tmp_path / "c.tar.zst"
    gpusnap_json("checkpoint", counter, "--export", str(out), "--leave-running")
    last, token = read_counter(counter), born(counter)
    podman("rm", "-f", "-t", "0", counter)
    return counter, out, last, token


def _leftover_fifo_dirs(near: Path) -> list[Path]:
    return list(near.glob(stream_module.FIFO_DIR_PREFIX + "*"))


def test_a_remapped_import_goes_through_the_pump_and_restores(exported, tmp_path):
    """The path `restore --gpu-map` takes, end to end through real Podman: the
    pump rewrites every open's stream (it died parsing its own arguments)."""
    name, path, last, token = exported
    contents = archive.read(str(path), head_only=True)
    plan = Plan((), (), DeviceRemap(container_paths="keep"))
    with_stream = stream_module.import_fifo(path, near=tmp_path, retarget=NO_MOVES)
    ops_restore.import_archive(with_stream, contents, plan, None, False, False, str(path))
    first = read_counter(name)  # restored, not restarted: it counts on from where it was
    assert last <= first < last + 40, (last, first)
    assert_continued(name, first, token)
    assert not _leftover_fifo_dirs(tmp_path)


@contextlib.contextmanager
def _pump_killed(opener):
    """The import stream, with its pump SIGKILLed before Podman opens the FIFO."""
    with opener as stream:
        os.kill(stream.pump_pid, signal.SIGKILL)
        yield stream


def test_an_import_whose_stream_stalls(exported, tmp_path):
    """Podman opens the FIFO and no writer ever comes: the CLI sees the pump
    gone, unblocks Podman, says so in one line, and leaves nothing behind."""
    name, path, last, token = exported
    before = _sha(path)
    contents = archive.read(str(path), head_only=True)
    plan = Plan((), (), DeviceRemap(container_paths="keep"))
    started = time.monotonic()
    with pytest.raises(GpusnapError) as failed:
        ops_restore.import_archive(
            _pump_killed(stream_module.import_fifo(path, near=tmp_path, retarget=NO_MOVES)),
            contents, plan, None, False, False, str(path))
    assert time.monotonic() - started < 60
    message = failed.value.message
    assert "import stream of archive.tar stopped before Podman had read it" in message, message
    assert "\n" not in message and f"{path} is unchanged" in message
    assert podman("container", "exists", name, check=False).returncode == 1
    assert not _leftover_fifo_dirs(tmp_path)
    assert _sha(path) == before
    # restorable from what is on disk, as the line says
    gpusnap_json("restore", str(path))
    assert read_counter(name) >= last
    assert_continued(name, read_counter(name), token)


def test_an_import_stream_podman_never_opens(tmp_path, monkeypatch):
    """A reader that never opens the FIFO (a stand-in that only sleeps): the
    wait for its first open ends at its bound, the pump with it."""
    monkeypatch.setenv("GPUSNAP_WAIT_IMPORT_OPEN", "2")
    src = tmp_path / "a.tar"
    src.write_bytes(stream_module.tar_member("config.dump", b"{}") + b"\0" * 1024)
    started = time.monotonic()
    with pytest.raises(waits.WaitExpired) as failed:
        with stream_module.import_fifo(src, near=tmp_path, retarget=NO_MOVES) as stream:
            fifo = stream.path
            waits.run(["sleep", "600"], "podman container restore",
                      waits.Bound.of("PODMAN_RESTORE"), watch=stream.check)
    assert time.monotonic() - started < 30
    assert failed.value.message == "Podman opening the checkpoint stream: no answer within 2 s"
    assert "GPUSNAP_WAIT_IMPORT_OPEN" in failed.value.hint
    assert not referrers(str(fifo)), "the pump outlived the wait"
    assert not _leftover_fifo_dirs(tmp_path)


def _read(fifo: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["tar", "-tf", str(fifo)], capture_output=True, text=True, timeout=30)


def test_a_reader_that_opens_a_streamed_import_once_more(tmp_path):
    """Podman 4.3 opens a streamed import three times (two config-only opens,
    then the archive). A reader that opens once more gets no tar at once,
    never a wait: the pipe can be read once."""
    head = stream_module.config_tar({"config.dump": b"{}", "spec.dump": b"{}"})
    body = stream_module.tar_member("checkpoint/pages-1.img", b"x" * 4096) + b"\0" * 1024
    with stream_module.import_piped(tmp_path, head, 2) as (stream, sink):
        writer = threading.Thread(target=lambda: (sink.write(body), sink.done(), sink.close()))
        writer.start()
        assert _read(stream.path).stdout.split() == ["config.dump", "spec.dump"]
        assert _read(stream.path).stdout.split() == ["config.dump", "spec.dump"]
        assert _read(stream.path).stdout.split() == ["checkpoint/pages-1.img"]
        started = time.monotonic()
        once_more = _read(stream.path)
        assert once_more.returncode != 0 and time.monotonic() - started < 10, once_more
        stream.check()  # the pump still serves: nothing to report
        writer.join(timeout=10)


def test_a_reader_that_opens_a_file_import_once_more(tmp_path):
    """An archive on disk is served whole on every open, whatever their count."""
    plain = tmp_path / "a.tar"
    plain.write_bytes(stream_module.tar_member("config.dump", b"{}")
                      + stream_module.tar_member("spec.dump", b"{}") + b"\0" * 1024)
    src = tmp_path / "a.tar.zst"
    subprocess.run(["zstd", "-q", str(plain), "-o", str(src)], check=True)
    with stream_module.import_fifo(src, near=tmp_path) as stream:
        for _ in range(5):
            listing = _read(stream.path)
            assert listing.returncode == 0, listing.stderr
            assert "config.dump" in listing.stdout.split()


@pytest.fixture
def silent_registry():
    """A TCP server that accepts every connection and never sends a byte."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.getsockname()[1]}"
    stop.set()
    thread.join(timeout=5)
    for conn in held:
        conn.close()
    server.close()


@pytest.mark.parametrize("verb", ["restore", "pull"])
def test_a_registry_that_sends_nothing(silent_registry, verb, tmp_path):
    env = {**os.environ, "GPUSNAP_WAIT_REGISTRY": "1"}
    args = [verb, f"{silent_registry}/nc/counter:v1", "--plain-http"]
    if verb == "pull":
        args += ["-o", str(tmp_path / "x.tar")]
    started = time.monotonic()
    res = gpusnap(*args, env=env)
    assert time.monotonic() - started < 60
    assert_one_line_error(res, f"cannot reach registry {silent_registry}: it sent nothing for 1 s")
    assert not (tmp_path / "x.tar").exists()


def test_an_export_whose_stream_stops_never_stalls(counter, tmp_path, monkeypatch):
    """The export's pump dies before Podman opens its FIFO: Podman would wait in
    open(2) for a reader until its hour-long bound. The CLI reads the stream
    into nothing instead, so Podman ends as it would; one line says what
    happened, and the container runs on (--leave-running)."""
    from gpusnap.ops import checkpoint as ops_checkpoint

    real = stream_module._pump

    def dead_pump(*args, **kw):
        proc = real(*args, **kw)
        os.killpg(proc.pid, signal.SIGKILL)  # its own session: zstd with it
        return proc

    monkeypatch.setattr(stream_module, "_pump", dead_pump)
    out = tmp_path / "c.tar.zst"
    before, token = read_counter(counter), born(counter)
    started = time.monotonic()
    with pytest.raises(GpusnapError) as failed:
        ops_checkpoint.run(ops_checkpoint.plan(counter, str(out), True, False, 10_000))
    assert time.monotonic() - started < 60
    message = failed.value.message
    assert f"writing {out} failed: its stream stopped while Podman wrote it" in message, message
    assert "\n" not in message and "the container is still running" in message, message
    assert list(tmp_path.iterdir()) == []  # no archive, no partial one, no FIFO folder
    wait_counter(counter, before)  # it runs on
    assert born(counter) == token
    monkeypatch.setattr(stream_module, "_pump", real)
    gpusnap_json("checkpoint", counter, "--export", str(out), "--leave-running")
    assert out.stat().st_size > 0
