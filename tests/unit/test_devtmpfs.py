"""gpusnap.criu.devtmpfs: the container's saved /dev gets the same device edits as the spec."""

from __future__ import annotations

import io
import tarfile

import pytest

from gpusnap.criu.devtmpfs import DevTarError, rewrite_dev_tar
from gpusnap.gpu.nodes import DeviceRemap, NodeChange
from tests.unit.spec_samples import BDF0, BDF2, EXPORT, move_0_to_2, swap_0_1

REAL = (EXPORT / "checkpoint" / "tmpfs-dev-56.tar.gz.img").read_bytes()


def members(data: bytes) -> dict[str, tarfile.TarInfo]:
    return {m.name: m for m in tarfile.open(fileobj=io.BytesIO(data), mode="r:gz")}


def make_tar(*entries: tarfile.TarInfo) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:gz") as tar:
        for e in entries:
            tar.addfile(e)
    return out.getvalue()


def node(name: str, major: int, minor: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.devmajor, info.devminor, info.mode = tarfile.CHRTYPE, major, minor, 0o666
    return info


def link(name: str, target: str) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = tarfile.SYMTYPE, target
    return info


# the real export's stand-in GPU node: /dev/nvidia0 is 1:5 (and so is /dev/zero)
STAND_IN = DeviceRemap(nodes=(NodeChange("/dev/nvidia0", "/dev/nvidia1", (1, 5), (195, 1)),),
                       container_paths="keep")


def test_the_real_dev_keeps_everything_but_the_moved_numbers():
    before, after = members(REAL), members(rewrite_dev_tar(REAL, STAND_IN))
    assert list(after) == list(before)
    assert (after["./nvidia0"].devmajor, after["./nvidia0"].devminor) == (195, 1)
    assert (after["./dri/renderD128"].devmajor, after["./dri/renderD128"].devminor) == (1, 7)
    assert after["./ptmx"].linkname == "pts/ptmx" and after["./nvidia0"].mode == before["./nvidia0"].mode
    assert after["./stdin"].linkname == "/proc/self/fd/0"


def test_the_real_dev_with_host_paths_renames_the_node():
    host = DeviceRemap(nodes=STAND_IN.nodes)  # host paths are the default
    after = members(rewrite_dev_tar(REAL, host))
    assert "./nvidia0" not in after and (after["./nvidia1"].devmajor, after["./nvidia1"].devminor) == (195, 1)
    assert list(after).index("./nvidia1") == list(members(REAL)).index("./nvidia0")


def test_keep_paths_change_numbers_only():
    data = make_tar(node("./nvidia0", 195, 0), node("./dri/card1", 226, 1),
                    link(f"./dri/by-path/pci-{BDF0}-card", "../card1"))
    after = members(rewrite_dev_tar(data, move_0_to_2("keep")))
    assert (after["./nvidia0"].devminor, after["./dri/card1"].devminor) == (2, 3)
    assert after[f"./dri/by-path/pci-{BDF0}-card"].linkname == "../card1"


def test_host_paths_rename_nodes_and_relink_by_path():
    data = make_tar(node("./nvidia0", 195, 0), node("./dri/card1", 226, 1),
                    link(f"./dri/by-path/pci-{BDF0}-card", "../card1"))
    after = members(rewrite_dev_tar(data, move_0_to_2("host")))
    assert set(after) == {"./nvidia2", "./dri/card3", f"./dri/by-path/pci-{BDF2}-card"}
    assert after[f"./dri/by-path/pci-{BDF2}-card"].linkname == "../card3"
    assert after["./nvidia2"].devminor == 2


def test_a_swap_is_one_pass():
    data = make_tar(node("./nvidia0", 195, 0), node("./nvidia1", 195, 1))
    after = members(rewrite_dev_tar(data, swap_0_1("host")))
    assert {n: (m.devmajor, m.devminor) for n, m in after.items()} == \
        {"./nvidia1": (195, 1), "./nvidia0": (195, 0)}


def test_a_rename_onto_an_existing_other_node_is_refused():
    data = make_tar(node("./nvidia0", 195, 0), node("./nvidia2", 1, 5))
    with pytest.raises(DevTarError, match="would create /dev/nvidia2 twice"):
        rewrite_dev_tar(data, move_0_to_2("host"))


def test_the_same_input_gives_the_same_bytes():
    assert rewrite_dev_tar(REAL, STAND_IN) == rewrite_dev_tar(REAL, STAND_IN)


def test_not_a_tarball():
    with pytest.raises(DevTarError, match="not a gzip tarball"):
        rewrite_dev_tar(b"plain text", STAND_IN)


def test_the_targets_node_already_there_is_kept_once():
    """Under containerd (CAP_MKNOD) libcuda creates /dev/nvidia1 itself when the
    driver lists GPU 1: moving 0 -> 1 meets an identical node, not a conflict."""
    data = make_tar(node("./nvidia0", 195, 0), node("./nvidia1", 195, 1), node("./null", 1, 3))
    remap = DeviceRemap(nodes=(NodeChange("/dev/nvidia0", "/dev/nvidia1", (195, 0), (195, 1)),))
    after = members(rewrite_dev_tar(data, remap))
    assert sorted(after) == ["./null", "./nvidia1"]
    assert (after["./nvidia1"].devmajor, after["./nvidia1"].devminor) == (195, 1)
