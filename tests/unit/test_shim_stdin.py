"""shim/stdio.py: CloseIO never cuts off what a client wrote to the stdin FIFO.

ctr sends CloseIO as soon as its own stdin reaches EOF, with up to a pipe's
worth still in the FIFO: the process gets all of it, then EOF (containerd's
shim keeps a writer of its own on the FIFO for this)."""

from __future__ import annotations

import fcntl
import os
import threading
import time

from gpusnap.shim.stdio import Paths, ProcessIO


def test_close_io_lets_the_fifo_drain_before_the_process_sees_eof(tmp_path):
    fifo = str(tmp_path / "stdin")
    os.mkfifo(fifo)
    io = ProcessIO(Paths(stdin=fifo))
    child = os.dup(io.stdio.stdin)  # what runc hands the process
    got: list[bytes] = []

    def process() -> None:
        with os.fdopen(child, "rb") as f:
            got.append(f.read())
    reader = threading.Thread(target=process)
    reader.start()
    io.started()
    data = os.urandom(1_000_000)
    with open(fifo, "wb", buffering=0) as client:  # ctr: writes everything, then CloseIO
        client.write(data)  # returns once the last of it is in the FIFO
        io.close_io()  # up to a pipe's worth not yet read from the FIFO
    reader.join(10)
    assert not reader.is_alive() and got == [data]
    io.close()


def test_the_shims_own_handle_on_the_fifo_reads_nothing(tmp_path):
    # a reader of its own would keep a client writing after the copy ended
    # blocked on a full FIFO instead of getting EPIPE
    fifo = str(tmp_path / "stdin")
    os.mkfifo(fifo)
    io = ProcessIO(Paths(stdin=fifo))
    io.started()
    def mode() -> int:
        with io._lock:  # the copy thread swaps the handle under it
            return fcntl.fcntl(io._stdin_keep, fcntl.F_GETFL) & os.O_ACCMODE
    deadline = time.monotonic() + 5  # swapped once the copy's reader is open
    while mode() != os.O_WRONLY and time.monotonic() < deadline:
        time.sleep(0.01)
    assert mode() == os.O_WRONLY
    io.close_io()
    io.close()
