"""The libc calls of the restore's path (the page fill, the remote syscalls,
the malloc arena limit) take the libc this process has loaded: looking it up
by name (ctypes.util.find_library) runs ldconfig -p, a process on the
critical path of every restore."""

from __future__ import annotations

import subprocess

from gpusnap.oci import malloc
from gpusnap.pages import page_fill, remote_syscall


def test_no_process_is_started_to_find_libc(monkeypatch):
    started = []

    def popen(args, *a, **kw):
        started.append(args)
        raise OSError("no process in this test")

    monkeypatch.setattr(subprocess, "Popen", popen)
    monkeypatch.setattr(malloc, "_done", False)
    fill, remote = page_fill.libc(), remote_syscall._libc()
    assert malloc.one_heap_for_all_threads()
    assert started == []
    # the calls each module declares are there to be made
    assert fill.process_vm_writev.restype is not None and fill.mmap is not None
    assert remote.ptrace.restype is not None
