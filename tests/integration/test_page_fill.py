"""Restored memory written on many threads (pages/fill_plan.py, page_fill.py),
through plain Podman: `podman container checkpoint --export` and `restore
--import` of a container holding ~290 MB in one shell variable. gpusnap's
CRIU action script leaves that memory out of CRIU's restore and writes it at
post-restore (its agent does: action/agent.py); the md5 of the variable must be
the same afterwards, and the
area that holds it has huge pages (fill_plan's MADV_HUGEPAGE) where the host
gives them; the file pages CRIU copies on write are read ahead first. In the
version matrix too: every runtime that runs the action script fills, the
others (trixie's crun 1.21) restore through CRIU alone, the same memory."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from gpusnap.pages.fill_plan import thp_available
from gpusnap.criu.runtimes import runs_action_script
from gpusnap.procs import process_tree
from tests.conftest import journal_mark, journal_since
from tests.integration.test_segments import _md5_of_memory, _start_big_memory


def _runtime() -> str:
    return subprocess.run(["podman", "info", "--format", "{{.Host.OCIRuntime.Name}}"],
                          capture_output=True, text=True, check=True).stdout.strip()


def test_a_plain_podman_import_of_big_memory_is_filled_by_threads_and_whole(name, tmp_path):
    before = _start_big_memory(name)
    archive = tmp_path / "big.tar"
    subprocess.run(["podman", "container", "checkpoint", "--export", str(archive), name],
                   check=True, capture_output=True)
    subprocess.run(["podman", "rm", name], check=True, capture_output=True)
    mark = journal_mark()
    res = subprocess.run(["podman", "container", "restore", "--import", str(archive)],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    events = journal_since(mark)
    filled = [e for e in events if e["event"] == "pages-filled"]
    planned = [e for e in events if e["event"] == "pages-fill-planned"]
    if runs_action_script(_runtime()):
        assert filled and filled[0]["bytes"] >= 256 << 20, events
        # by the agent pre-restore started (action/agent.py), not a second Python start
        assert filled[0]["by"] == "agent", filled
        # the shell's changed file pages (its data) asked of the disk ahead of
        # CRIU's copy-on-write faults, from the root Podman mounted (file_pages.py)
        ahead = [e for e in events if e["event"] == "file-pages-read-ahead"]
        assert ahead and ahead[0]["files"] >= 1 and ahead[0]["skipped"] == 0, events
        if thp_available():
            assert planned[0]["huge_bytes"] >= 256 << 20, planned
            assert _huge_areas(name), "no area of the restored container has huge pages"
    else:
        assert not filled, events
    time.sleep(0.2)
    assert _md5_of_memory(name) == before
    # the images folder was put back: Podman's checkpoint folder holds no rewrite
    left = list(Path("/var/lib/containers/storage").glob("overlay-containers/*/userdata/checkpoint/gpusnap-fill"))
    assert not left, left


def _huge_areas(name: str) -> list[tuple[str, int]]:
    """(area, AnonHugePages kB) of each area of the container's processes that
    was advised MADV_HUGEPAGE ("hg") and holds huge pages."""
    pid = int(subprocess.run(["podman", "inspect", "--format", "{{.State.Pid}}", name],
                             capture_output=True, text=True, check=True).stdout)
    found = []
    for p in process_tree(pid):
        area, huge = "", 0
        for line in Path(f"/proc/{p}/smaps").read_text().splitlines():
            if "-" in line.split(" ", 1)[0]:
                area, huge = line.split(" ", 1)[0], 0
            elif line.startswith("AnonHugePages:"):
                huge = int(line.split()[1])
            elif line.startswith("VmFlags:") and " hg" in line and huge:
                found.append((area, huge))
    return found
