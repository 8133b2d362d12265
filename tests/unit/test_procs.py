"""gpusnap.procs: the process tree and what each member holds of the NVIDIA driver,
read from the real /proc of children spawned here, and from a fake /proc where the
kernel cannot be made to show it (no /dev/nvidia* on a test host)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpusnap import procs
from tests.unit.fakes import fake_proc


def wait_for(read, ok, timeout: float = 5.0):
    """read() until ok(value) holds; the last value if it never does (the test then fails)."""
    deadline = time.monotonic() + timeout
    value = read()
    while not ok(value) and time.monotonic() < deadline:
        time.sleep(0.01)
        value = read()
    return value


@pytest.fixture
def spawn():
    """Start children in sessions of their own; kill each whole group afterwards."""
    started: list[subprocess.Popen] = []

    def start(*argv: str, **kw) -> subprocess.Popen:
        proc = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, start_new_session=True, **kw)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


# --- process_tree (real /proc) ------------------------------------------------------------

def test_process_tree_has_the_root_first_then_all_descendants(spawn):
    # sh -> (sleep, sh -> sleep): children and a grandchild
    shell = spawn("sh", "-c", "sleep 30 & sh -c 'sleep 30 & wait' & wait")

    def comms(tree: list[int]) -> list[str]:
        return sorted(Path(f"/proc/{pid}/comm").read_text().strip() for pid in tree[1:])
    # a child is in the tree from its fork, named "sh" until it has exec'd sleep
    tree = wait_for(lambda: procs.process_tree(shell.pid),
                    lambda t: len(t) == 4 and comms(t) == ["sh", "sleep", "sleep"], timeout=15)
    assert len(tree) == 4
    assert tree[0] == shell.pid
    assert comms(tree) == ["sh", "sleep", "sleep"]
    for pid in tree[1:]:
        ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        assert ppid in tree[: tree.index(pid)]  # every parent comes before its children


def test_process_tree_of_a_lone_process_is_itself(spawn):
    lone = spawn("sleep", "30")
    assert procs.process_tree(lone.pid) == [lone.pid]


def test_process_tree_leaves_out_processes_outside_the_tree(spawn):
    a = spawn("sleep", "30")
    b = spawn("sleep", "30")
    assert b.pid not in procs.process_tree(a.pid)
    assert os.getpid() not in procs.process_tree(a.pid)


# --- process_tree (fake /proc: odd command names, races) ----------------------------------

def test_process_tree_reads_command_names_with_spaces_and_parentheses(tmp_path: Path):
    fake_proc(tmp_path, 10, 1, comm="init")
    fake_proc(tmp_path, 11, 10, comm="evil) 1 (x")
    fake_proc(tmp_path, 12, 11, comm="a b) (c")
    fake_proc(tmp_path, 20, 1, comm="other")
    assert procs.process_tree(10, tmp_path) == [10, 11, 12]


def test_process_tree_lists_children_breadth_first_in_pid_order(tmp_path: Path):
    fake_proc(tmp_path, 1, 0)
    for pid, ppid in ((30, 1), (5, 1), (17, 5), (8, 30)):
        fake_proc(tmp_path, pid, ppid)
    assert procs.process_tree(1, tmp_path) == [1, 5, 30, 17, 8]


def test_process_tree_skips_entries_that_vanish_or_are_not_pids(tmp_path: Path):
    fake_proc(tmp_path, 1, 0)
    fake_proc(tmp_path, 2, 1)
    (tmp_path / "3").mkdir()  # exited while we looked: no stat
    (tmp_path / "self").mkdir()
    (tmp_path / "meminfo").write_text("MemTotal: 1 kB\n")
    assert procs.process_tree(1, tmp_path) == [1, 2]


# --- gpu_use ------------------------------------------------------------------------------

def test_gpu_use_finds_libcuda_in_the_maps_of_a_real_process(spawn, tmp_path: Path):
    lib = tmp_path / "libcuda.so.1"
    lib.write_bytes(b"\0" * 4096)
    code = ("import mmap, sys, time\n"
            "f = open(sys.argv[1], 'rb'); m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)\n"
            "print('ready', flush=True); time.sleep(30)\n")
    child = spawn(sys.executable, "-c", code, str(lib), stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "ready"
    use = procs.gpu_use(child.pid)
    assert use.maps_libcuda and use.is_cuda
    assert use.opens_nvidia is False and use.gpu_minors == []
    assert use.comm == Path(sys.executable).name[:15]


def test_gpu_use_of_a_plain_real_process_is_not_cuda(spawn):
    plain = spawn("sleep", "30")
    # until the child has exec'd sleep (before, it is a copy of this Python process)
    use = wait_for(lambda: procs.gpu_use(plain.pid), lambda u: u is not None and u.comm == "sleep")
    assert (use.pid, use.maps_libcuda, use.opens_nvidia, use.gpu_minors) == (plain.pid, False,
                                                                            False, [])
    assert not use.is_cuda


def test_gpu_use_of_an_exited_process_is_none(spawn):
    done = spawn("true")
    done.wait()
    assert procs.gpu_use(done.pid) is None


def test_gpu_use_reads_gpu_minors_from_fd_links(tmp_path: Path):
    fake_proc(tmp_path, 50, 1, comm="python3", fds={
        0: "/dev/null", 3: "/dev/nvidiactl", 4: "/dev/nvidia-uvm", 5: "/dev/nvidia1",
        6: "/dev/nvidia1", 7: "/dev/nvidia12", 8: "socket:[1234]", 9: "/dev/nvidia-caps/nvidia-cap1"})
    use = procs.gpu_use(50, tmp_path)
    assert use.gpu_minors == [1, 12]
    assert use.opens_nvidia and use.is_cuda
    assert use.maps_libcuda is False


def test_gpu_use_counts_control_device_alone_as_cuda_without_gpus(tmp_path: Path):
    fake_proc(tmp_path, 51, 1, fds={3: "/dev/nvidiactl"})
    use = procs.gpu_use(51, tmp_path)
    assert (use.opens_nvidia, use.gpu_minors, use.is_cuda) == (True, [], True)


def test_gpu_use_of_a_checkpointed_process_relies_on_maps(tmp_path: Path):
    # After cuCheckpointProcessCheckpoint the /dev/nvidia* fds are closed; libcuda stays mapped.
    maps = ("55d0c0000000-55d0c0001000 r--p 00000000 08:01 1 /usr/bin/python3.11\n"
            "7f0000000000-7f0000100000 r-xp 00000000 08:01 2 "
            "/usr/lib/x86_64-linux-gnu/libcuda.so.580.159.04\n")
    fake_proc(tmp_path, 52, 1, maps=maps)
    use = procs.gpu_use(52, tmp_path)
    assert (use.opens_nvidia, use.maps_libcuda, use.is_cuda) == (False, True, True)


def test_gpu_use_without_fd_access_still_reads_maps(tmp_path: Path):
    base = fake_proc(tmp_path, 53, 1, maps="7f00-7f01 r-xp 0 0:0 0 /opt/lib/libcuda.so.1\n")
    (base / "fd").rmdir()  # as if unreadable
    use = procs.gpu_use(53, tmp_path)
    assert use.maps_libcuda and not use.opens_nvidia


def test_gpu_use_ignores_other_nvidia_libraries(tmp_path: Path):
    fake_proc(tmp_path, 54, 1, maps="7f00-7f01 r-xp 0 0:0 0 /usr/lib/libnvidia-ml.so.1\n"
                                    "7f02-7f03 r-xp 0 0:0 0 /usr/lib/libcudart.so.12\n")
    assert procs.gpu_use(54, tmp_path).is_cuda is False


# --- cuda_processes and rss_bytes ---------------------------------------------------------

def test_cuda_processes_keeps_only_cuda_members_of_the_tree(tmp_path: Path):
    fake_proc(tmp_path, 100, 1, comm="conmon-init")
    fake_proc(tmp_path, 101, 100, comm="trainer", fds={5: "/dev/nvidia0"})
    fake_proc(tmp_path, 102, 101, comm="loader", maps="0-1 r-xp 0 0:0 0 /lib/libcuda.so.1\n")
    fake_proc(tmp_path, 103, 100, comm="bash")
    fake_proc(tmp_path, 200, 1, comm="outsider", fds={5: "/dev/nvidia0"})
    found = procs.cuda_processes(100, tmp_path)
    assert [(p.pid, p.comm, p.gpu_minors) for p in found] == [(101, "trainer", [0]),
                                                               (102, "loader", [])]


def test_rss_bytes_sums_resident_pages(tmp_path: Path):
    page = os.sysconf("SC_PAGE_SIZE")
    fake_proc(tmp_path, 1, 0, statm="900 250 10 1 0 100 0")
    fake_proc(tmp_path, 2, 1, statm="900 50 10 1 0 100 0")
    fake_proc(tmp_path, 3, 1, statm="garbage")
    fake_proc(tmp_path, 4, 1, statm=None)
    assert procs.rss_bytes([1, 2, 3, 4, 5], tmp_path) == 300 * page


def test_rss_bytes_of_a_real_process_is_its_resident_memory(spawn):
    child = spawn(sys.executable, "-c",
                  "b = b'x' * (64 << 20); print('ready', flush=True); import time; time.sleep(30)",
                  stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "ready"
    rss = procs.rss_bytes([child.pid])
    status = Path(f"/proc/{child.pid}/status").read_text()
    vm_rss = int(next(line for line in status.splitlines() if line.startswith("VmRSS:")).split()[1])
    assert rss >= 64 << 20
    assert abs(rss - vm_rss * 1024) < 1 << 20


def test_alive(spawn):
    child = spawn("sleep", "30")
    assert procs.alive(child.pid)
    child.kill()
    child.wait()
    assert not procs.alive(child.pid)


def test_gpu_use_sees_a_mapping_of_a_driver_node(tmp_path: Path):
    # what a child forked from a CUDA process inherits: CRIU cannot dump it
    maps = ("7f00-7f01 r-xp 0 0:0 0 /usr/lib/libcuda.so.1\n"
            "7f7741231000-7f7741241000 -w-s 00000000 00:24 11                 /dev/nvidia0\n")
    fake_proc(tmp_path, 55, 1, maps=maps)
    use = procs.gpu_use(55, tmp_path)
    assert (use.maps_nvidia, use.opens_nvidia, use.holds_driver) == (True, False, True)


def test_a_process_that_only_maps_libcuda_holds_nothing_of_the_driver(tmp_path: Path):
    fake_proc(tmp_path, 56, 1, maps="7f00-7f01 r-xp 0 0:0 0 /usr/lib/libcuda.so.1\n"
                                    "7f02-7f03 r--p 0 0:0 0 /opt/nvidia-tools/x.so\n")
    use = procs.gpu_use(56, tmp_path)
    assert use.is_cuda and not use.holds_driver


def test_age_is_the_seconds_since_a_process_started():
    import os

    from gpusnap.procs import age_s
    age = age_s(os.getpid())
    assert age is not None and 0 <= age < 7 * 86400
    assert age_s(2**22 + 1) is None  # above pid_max: no such process
