"""A real process holding a container's turn (gpu/turn.py), as a guardian
still giving back the GPUs of the last checkpoint does, for as long as the
block runs."""

from __future__ import annotations

import subprocess
import sys
from contextlib import contextmanager
from typing import Iterator

# takes the turn, says whether it did, and holds it until stdin closes
HOLDER = ("import sys; from gpusnap.gpu import turn; "
          "t = turn.try_take(int(sys.argv[1]), sys.argv[2]); "
          "print('held' if t else 'busy', flush=True); sys.stdin.read()")


def start(init_pid: int, role: str = "guardian") -> subprocess.Popen:
    """The holder, once it holds the turn (its state folder: this process's)."""
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(init_pid), role],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    said = proc.stdout.readline().strip()
    if said != "held":
        stop(proc)
        raise AssertionError(f"the holder could not take the turn of {init_pid}: {said!r}")
    return proc


def stop(proc: subprocess.Popen) -> None:
    proc.stdin.close()
    proc.wait(timeout=10)


@contextmanager
def holding(init_pid: int, role: str = "guardian") -> Iterator[subprocess.Popen]:
    proc = start(init_pid, role)
    try:
        yield proc
    finally:
        stop(proc)
