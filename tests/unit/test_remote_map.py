"""pages/remote_map.py against real child processes: a file mapped private over
a range of their memory, by calls they make themselves, the descriptor passed
to them (a path in another mount namespace would not do)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from gpusnap.pages import remote_map, remote_syscall
from tests.unit.test_dump_ahead import CHILD, PAGE, Child, child  # noqa: F401 -- a fixture

pytestmark = pytest.mark.skipif(not remote_syscall.supported(), reason="x86-64 only")


def _file(tmp_path, pages: int, mark: int):
    """A file whose page i starts with (mark + i) as 8 little-endian bytes."""
    path = tmp_path / "pages.img"
    path.write_bytes(b"".join((mark + i).to_bytes(8, "little").ljust(PAGE, b"\0")
                              for i in range(pages)))
    return path


def _maps(pid: int, path) -> int:
    with open(f"/proc/{pid}/maps") as f:
        return sum(1 for line in f if line.rstrip().endswith(str(path)))


def test_the_file_takes_the_place_of_the_runs_and_the_process_goes_on(child, tmp_path):
    path = _file(tmp_path, 32, 1000)
    fds_before = sorted(os.listdir(f"/proc/{child.proc.pid}/fd"))
    # pages 8-15 from file pages 0-7, pages 30-33 from file pages 20-23
    remote_map.map_file(child.proc.pid, str(path), [(child.addr + 8 * PAGE, 8 * PAGE, 0),
                                                    (child.addr + 30 * PAGE, 4 * PAGE, 20 * PAGE)])
    firsts = [1000 + i - 8 if 8 <= i < 16 else 1020 + i - 30 if 30 <= i < 34 else i
              for i in range(64)]
    # the child sums the first byte of each page: the file's marks where mapped
    assert child.ask(b"sum").split()[0] == str(sum(v % 256 for v in firsts))
    assert _maps(child.proc.pid, path) == 2
    assert child.ask(b"sleep") == "0.3"  # the read(2) it was stopped in was made again
    # no socket or file left open in it: its descriptors are what they were
    assert sorted(os.listdir(f"/proc/{child.proc.pid}/fd")) == fds_before


def test_a_write_to_the_mapped_range_leaves_the_file_as_it_was(child, tmp_path):
    path = _file(tmp_path, 4, 7)
    before = path.read_bytes()
    remote_map.map_file(child.proc.pid, str(path), [(child.addr, 4 * PAGE, 0)])
    remote_map._vm(child.proc.pid, child.addr, b"overwritten")
    assert path.read_bytes() == before
    assert remote_map._vm(child.proc.pid, child.addr, None, 11) == b"overwritten"


def test_a_refused_mapping_says_so_and_the_process_goes_on(child, tmp_path):
    path = _file(tmp_path, 4, 7)
    with pytest.raises(remote_map.RemoteMapError) as err:
        remote_map.map_file(child.proc.pid, str(path), [(child.addr + 1, PAGE, 0)])  # unaligned
    assert "mmap" in str(err.value) or "process" in str(err.value)
    assert child.ask(b"sleep") == "0.3"


@pytest.mark.skipif(shutil.which("unshare") is None, reason="util-linux unshare")
def test_a_process_that_cannot_see_the_path_gets_the_file(tmp_path):
    """As in a container: the child's mount namespace hides the file's folder."""
    hidden = tmp_path / "hidden"
    hidden.mkdir()
    path = _file(hidden, 8, 500)
    c = Child.__new__(Child)
    c.r, c.w = os.pipe()
    c.proc = subprocess.Popen(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c",
         f'mount -t tmpfs none "{hidden}" && exec "{sys.executable}" -c "$0" 64 {c.r} 0',
         CHILD], stdout=subprocess.PIPE, text=True, pass_fds=(c.r,))
    c.addr, c.pages = int(c.proc.stdout.readline()), 64
    try:
        assert not os.path.exists(f"/proc/{c.proc.pid}/root{path}")
        remote_map.map_file(c.proc.pid, str(path), [(c.addr, 8 * PAGE, 0)])
        firsts = [500 + i if i < 8 else i for i in range(64)]
        assert c.ask(b"sum").split()[0] == str(sum(v % 256 for v in firsts))
    finally:
        c.close()
