"""Run a system call inside another process, through ptrace, as CRIU's compel does.

Used for one thing: ``madvise(MADV_DONTNEED)`` on memory whose bytes gpusnap has
already copied out (pages/dump_ahead.py), so that CRIU finds no pages there and
does not copy them again on its one thread. Only x86-64 (the only architecture
the CUDA checkpoint API supports).

One thread of the process is seized and interrupted; its registers are saved,
pointed at a ``syscall`` instruction that is already in the process (the vDSO's
fallback path: nothing is written into its code, so its other threads can keep
running), and stepped through the call's entry and exit; then the saved
registers go back and the thread is let go. A thread interrupted inside a
blocking call is set up to make that call again, as the kernel itself would
have (compel's get_task_regs does the same), so the process sees nothing.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import signal
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

from gpusnap.waits import Bound

PTRACE_CONT, PTRACE_GETREGS, PTRACE_SETREGS, PTRACE_DETACH, PTRACE_SYSCALL = 7, 12, 13, 17, 24
PTRACE_SEIZE, PTRACE_INTERRUPT = 0x4206, 0x4207
PTRACE_EVENT_STOP = 128
WALL = 0x40000000  # __WALL: the thread may not be a thread-group leader
SYS_MADVISE = 28
MADV_DONTNEED = 4
# What a blocking call interrupted by a stop holds in rax (include/linux/errno.h)
ERESTARTSYS, ERESTARTNOINTR, ERESTARTNOHAND, ERESTART_RESTARTBLOCK = 512, 513, 514, 516
MAX_SIGNAL_STOPS = 16  # signals delivered while waiting for our own stop
# A helper thread asleep stops within microseconds: one that does not is left to
# the first thread's share after this, not the whole PTRACE bound.
HELPER_STOP_S = 1.0


class RemoteSyscallError(OSError):
    """The call could not be made; the process is as it was (nothing was run)."""


class _Regs(ctypes.Structure):
    """struct user_regs_struct (x86-64)."""

    _fields_ = [(name, ctypes.c_ulonglong) for name in (
        "r15", "r14", "r13", "r12", "rbp", "rbx", "r11", "r10", "r9", "r8", "rax", "rcx", "rdx",
        "rsi", "rdi", "orig_rax", "rip", "cs", "eflags", "rsp", "ss", "fs_base", "gs_base",
        "ds", "es", "fs", "gs")]


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.ptrace.restype = ctypes.c_long
    libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
    return libc


def supported() -> bool:
    return platform.machine() == "x86_64"


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def syscall_address(pid: int, proc: Path = Path("/proc")) -> int:
    """The address of a ``syscall`` instruction (0f 05) the process already maps:
    in its vDSO, else in any executable mapping. RemoteSyscallError if none."""
    areas: list[tuple[int, int, str]] = []
    for line in (proc / str(pid) / "maps").read_text().splitlines():
        parts = line.split()
        if len(parts) < 5 or "x" not in parts[1] or "r" not in parts[1]:
            continue
        start, end = (int(v, 16) for v in parts[0].split("-"))
        name = parts[5] if len(parts) > 5 else ""
        if name == "[vsyscall]":
            continue
        areas.append((start, end, name))
    areas.sort(key=lambda a: a[2] != "[vdso]")  # the vDSO first: small, always there
    with open(proc / str(pid) / "mem", "rb", buffering=0) as mem:
        for start, end, _ in areas:
            pos = start
            while pos < end:
                size = min(1 << 20, end - pos)
                try:
                    mem.seek(pos)
                    data = mem.read(size + 1 if pos + size < end else size)
                except OSError:
                    break
                at = data.find(b"\x0f\x05")
                if at >= 0:
                    return pos + at
                pos += size
    raise RemoteSyscallError(errno.ENOENT, f"process {pid} maps no syscall instruction")


class _Tracee:
    def __init__(self, libc: ctypes.CDLL, tid: int, stop_s: float | None = None):
        self.libc, self.tid, self.stop_s = libc, tid, stop_s
        self.pending = 0  # a signal that stopped it inside our call: delivered at detach

    def _ptrace(self, request: int, addr: int = 0, data=None) -> None:
        if self.libc.ptrace(request, self.tid, ctypes.c_void_p(addr), data) < 0:
            err = ctypes.get_errno()
            raise RemoteSyscallError(err, f"ptrace({request}) of thread {self.tid}: "
                                          f"{os.strerror(err)}")

    def wait(self, bounded: bool = True) -> int:
        """The thread's next stop, within PTRACE: a thread in an uninterruptible
        wait (a vfork parent, a driver call) stops only once it leaves it. Past
        the bound the stop is left pending; this process's exit (the action
        script's, right after pre-dump) detaches the thread, and it runs on.
        Not ``bounded`` once its registers were changed: given up then, it would
        run on from inside our call, so the stop that puts them back is waited for."""
        if bounded:
            status = self._stop_within(Bound.of("PTRACE").seconds if self.stop_s is None
                                       else self.stop_s)
        else:
            _, status = os.waitpid(self.tid, WALL)
        if not os.WIFSTOPPED(status):
            raise RemoteSyscallError(errno.ESRCH, f"thread {self.tid} ended")
        return status

    def _stop_within(self, seconds: float) -> int:
        deadline = time.monotonic() + seconds
        pause = 10e-6  # a stop after PTRACE_INTERRUPT comes within microseconds
        while True:
            tid, status = os.waitpid(self.tid, WALL | os.WNOHANG)
            if tid:
                return status
            if time.monotonic() > deadline:
                raise RemoteSyscallError(errno.ETIMEDOUT, f"thread {self.tid} did not stop within "
                                         f"{seconds:g} s (in an uninterruptible wait?)")
            time.sleep(pause)
            pause = min(pause * 2, 0.01)

    def get_regs(self) -> _Regs:
        regs = _Regs()
        self._ptrace(PTRACE_GETREGS, 0, ctypes.byref(regs))
        return regs

    def set_regs(self, regs: _Regs) -> None:
        self._ptrace(PTRACE_SETREGS, 0, ctypes.byref(regs))

    def resume(self, request: int, sig: int = 0) -> None:
        self._ptrace(request, 0, ctypes.c_void_p(sig))


def _restartable(regs: _Regs) -> _Regs:
    """The saved registers as the thread must get them back: a blocking call the
    stop interrupted is made again (rax = its number, rip on its instruction),
    as the kernel does on return from a stop when no handler runs."""
    out = _Regs.from_buffer_copy(regs)
    if _signed(regs.orig_rax) < 0:
        return out
    ret = -_signed(regs.rax)
    if ret in (ERESTARTSYS, ERESTARTNOINTR, ERESTARTNOHAND):
        out.rax, out.rip = regs.orig_rax, regs.rip - 2
    elif ret == ERESTART_RESTARTBLOCK:
        out.rax = (-errno.EINTR) & (2**64 - 1)  # as compel: the call returns EINTR
    return out


def _threads(pid: int, proc: Path = Path("/proc")) -> list[tuple[int, str]]:
    """(tid, state) of each thread of ``pid``, the main thread first."""
    out = []
    for task in sorted((proc / str(pid) / "task").iterdir(), key=lambda t: int(t.name) != pid):
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue
        out.append((int(task.name), stat[stat.rfind(")") + 2:].split()[0]))
    return out


def _live_thread(pid: int, proc: Path = Path("/proc")) -> int:
    """A thread of ``pid`` that can run a call: not a zombie (a main thread that
    returned while the others go on)."""
    for tid, state in _threads(pid, proc):
        if state not in ("Z", "X"):
            return tid
    raise RemoteSyscallError(errno.ESRCH, f"process {pid} has no live thread")


def _helper_threads(pid: int, most: int, first: int) -> list[int]:
    """Up to ``most`` threads besides ``first`` that stop at once when asked:
    asleep in an interruptible wait (a thread in an uninterruptible one would
    hold its share of the work up to the PTRACE bound)."""
    return [tid for tid, state in _threads(pid) if state == "S" and tid != first][:most]


@contextmanager
def _seized(pid: int, tid: int | None = None,
            stop_s: float | None = None) -> Iterator[tuple[_Tracee, _Regs]]:
    """One thread of ``pid`` (``tid``, else the first live one) stopped under
    ptrace within ``stop_s`` (default: the PTRACE bound), with its registers;
    they are put back and the thread let go on leaving, whatever happened
    inside, with any signal that came during our call."""
    libc = _libc()
    tracee = _Tracee(libc, tid or _live_thread(pid), stop_s)
    tracee._ptrace(PTRACE_SEIZE)
    saved = None
    try:
        tracee._ptrace(PTRACE_INTERRUPT)
        for _ in range(MAX_SIGNAL_STOPS):
            status = tracee.wait()
            if status >> 16 == PTRACE_EVENT_STOP:
                break
            # A signal arrived first: deliver it as if we were not here, wait on.
            tracee.resume(PTRACE_CONT, os.WSTOPSIG(status))
        else:
            raise RemoteSyscallError(errno.EAGAIN, f"thread {tracee.tid} kept taking signals")
        saved = tracee.get_regs()
        yield tracee, saved
    finally:
        try:
            if saved is not None:
                tracee.set_regs(_restartable(saved))
        finally:
            libc.ptrace(PTRACE_DETACH, tracee.tid, None, ctypes.c_void_p(tracee.pending))


def _call(tracee: _Tracee, saved: _Regs, at: int, number: int, args: tuple[int, ...]) -> int:
    regs = _Regs.from_buffer_copy(saved)
    regs.rax, regs.orig_rax, regs.rip = number, 2**64 - 1, at  # orig_rax -1: no restart logic
    for name, value in zip(("rdi", "rsi", "rdx", "r10", "r8", "r9"), args):
        setattr(regs, name, value & (2**64 - 1))
    tracee.set_regs(regs)
    for _ in range(2):  # the call's entry stop, then its exit stop
        tracee.resume(PTRACE_SYSCALL)
        status = tracee.wait(bounded=False)  # its registers are ours until then
        if os.WSTOPSIG(status) not in (signal.SIGTRAP, signal.SIGTRAP | 0x80):
            tracee.pending = os.WSTOPSIG(status)
            raise RemoteSyscallError(errno.EINTR, f"thread {tracee.tid} stopped with signal "
                                                  f"{os.WSTOPSIG(status)} inside the call")
    return _signed(tracee.get_regs().rax)


def split(ranges: list[tuple[int, int]], parts: int, align: int = 2 << 20) -> list[list[tuple[int, int]]]:
    """``ranges`` (address, length) cut into at most ``parts`` lists of about
    equal bytes, a range cut only at ``align``-aligned addresses."""
    total = sum(n for _, n in ranges)
    share = max(align, -(-total // max(1, parts)))
    out: list[list[tuple[int, int]]] = [[]]
    room = share
    for address, length in ranges:
        while length:
            if room <= 0 and len(out) < parts:
                out.append([])
                room = share
            take = length
            if take > room and len(out) < parts:
                cut = (address + room + align - 1) // align * align - address
                take = min(length, max(cut, 0)) or length
            out[-1].append((address, take))
            address, length, room = address + take, length - take, room - take
    return [p for p in out if p]


def madvise_dontneed(pid: int, ranges: Iterable[tuple[int, int]], threads: int = 1) -> None:
    """``madvise(address, length, MADV_DONTNEED)`` in process ``pid`` for each
    range: on up to ``threads`` of its threads at once, each in one stop (the
    kernel frees tens of GiB of 4 KiB pages in seconds on one thread). A share
    that fails on its helper thread is made again on the first thread.
    RemoteSyscallError names the first range the process refused (some of the
    others may be dropped already)."""
    ranges = list(ranges)
    if not ranges:
        return
    if not supported():
        raise RemoteSyscallError(errno.ENOSYS, f"remote calls need x86-64, not {platform.machine()}")
    at = syscall_address(pid)
    first = _live_thread(pid)
    helpers = _helper_threads(pid, threads - 1, first) if threads > 1 else []
    shares = split(ranges, 1 + len(helpers))
    if len(shares) == 1:
        _madvise_on(pid, first, at, shares[0])
        return
    with ThreadPoolExecutor(len(shares), thread_name_prefix="madvise") as pool:
        done = list(pool.map(lambda job: _try_on(pid, *job, at),
                             zip([first, *helpers], shares, [None, *[HELPER_STOP_S] * len(helpers)])))
    for share, error in zip(shares, done):
        if error is not None:
            if share is shares[0]:
                raise error
            _madvise_on(pid, first, at, share)  # a helper that would not stop, or was refused


def _try_on(pid: int, tid: int, share: list[tuple[int, int]], stop_s: float | None,
            at: int) -> RemoteSyscallError | None:
    try:
        _madvise_on(pid, tid, at, share, stop_s)
    except RemoteSyscallError as exc:
        return exc
    return None


def _madvise_on(pid: int, tid: int, at: int, ranges: list[tuple[int, int]],
                stop_s: float | None = None) -> None:
    with _seized(pid, tid, stop_s) as (tracee, saved):
        for address, length in ranges:
            ret = _call(tracee, saved, at, SYS_MADVISE, (address, length, MADV_DONTNEED))
            if ret < 0:
                raise RemoteSyscallError(-ret, f"process {pid} refused madvise({address:#x}, "
                                               f"{length}): {os.strerror(-ret)}")


@contextmanager
def calls(pid: int, stop_s: float | None = None) -> Iterator[Callable[..., int]]:
    """One thread of ``pid`` stopped (within ``stop_s``, default the PTRACE
    bound) for a series of calls: yields ``call(number, *args)``, which returns
    what the call returned (a negative errno where it failed). A thread asleep
    or running is taken before one in an uninterruptible wait (a driver call),
    which stops only once it leaves it. The thread goes on as before on leaving."""
    if not supported():
        raise RemoteSyscallError(errno.ENOSYS, f"remote calls need x86-64, not {platform.machine()}")
    at = syscall_address(pid)
    ready = [tid for tid, state in _threads(pid) if state in ("S", "R")]
    with _seized(pid, ready[0] if ready else None, stop_s) as (tracee, saved):
        yield lambda number, *args: _call(tracee, saved, at, number, args)

