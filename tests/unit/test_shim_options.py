"""shim/options.py: runc's options from ctr's message or from a CRI handler's TOML table."""

from __future__ import annotations

import os

import pytest
from google.protobuf import any_pb2

from gpusnap.proto import load
from gpusnap.shim.options import GENERIC_OPTIONS, RUNC_OPTIONS, runc_options
from gpusnap.shim.process import ShimError


@pytest.fixture(scope="module")
def pb():
    return load()


def generic(pb, body: str = "", path: str = "") -> any_pb2.Any:
    msg = pb.runtimeoptions.Options(type_url="", config_path=path, config_body=body.encode())
    return any_pb2.Any(type_url=GENERIC_OPTIONS, value=msg.SerializeToString())


def test_a_cri_handler_written_as_runcs_reaches_runc(pb):
    # what containerd 2.x's CRI sends for `[...runtimes.gpusnap.options]` under a non-runc runtime type
    opts = runc_options(pb, generic(pb, 'SystemdCgroup = true\nBinaryName = "/usr/bin/crun"\n'
                                        'Root = "/run/r"\nNoPivotRoot = true\nIoUid = 1000\n'
                                        'criu_work_path = "/var/tmp/w"\n'))
    assert (opts.systemd_cgroup, opts.binary_name, opts.root, opts.no_pivot_root, opts.io_uid,
            opts.criu_work_path) == (True, "/usr/bin/crun", "/run/r", True, 1000, "/var/tmp/w")


def test_ctrs_own_message_and_none_at_all(pb):
    sent = pb.runc_options.Options(systemd_cgroup=True, root="/run/x")
    opts = runc_options(pb, any_pb2.Any(type_url=RUNC_OPTIONS, value=sent.SerializeToString()))
    assert opts.systemd_cgroup and opts.root == "/run/x"
    assert runc_options(pb, None) == pb.runc_options.Options()
    assert runc_options(pb, any_pb2.Any()) == pb.runc_options.Options()
    assert runc_options(pb, generic(pb, "")) == pb.runc_options.Options()


def test_a_config_path_is_read(pb, tmp_path):
    f = tmp_path / "gpusnap.toml"
    f.write_text("SystemdCgroup = true\n")
    assert runc_options(pb, generic(pb, path=str(f))).systemd_cgroup
    with pytest.raises(ShimError, match=f"cannot read ConfigPath {tmp_path}/absent"):
        runc_options(pb, generic(pb, path=str(tmp_path / "absent")))
    os.mkfifo(tmp_path / "fifo")  # nobody writes it: a read would wait for good
    with pytest.raises(ShimError, match=f"ConfigPath {tmp_path}/fifo is not a regular file"):
        runc_options(pb, generic(pb, path=str(tmp_path / "fifo")))


@pytest.mark.parametrize("body, words", [
    ('SystemdCgroup = "yes"', "SystemdCgroup must be true or false, not 'yes'"),
    ("Root = 3", "Root must be a string, not 3"),
    ("IoUid = true", "IoUid must be a number, not True"),
    ("IoUid = -1", "IoUid must be a number, not -1"),
    ("SystemdCgroup = ", "not TOML"),
])
def test_a_bad_value_is_one_precise_line(pb, body, words):
    with pytest.raises(ShimError, match=words) as e:
        runc_options(pb, generic(pb, body))
    assert e.value.code == "INVALID_ARGUMENT" and "\n" not in str(e.value)


def test_a_key_runc_has_no_option_for_is_left(pb, caplog):
    opts = runc_options(pb, generic(pb, 'SystemdCgroups = true\nRoot = "/run/r"\n'))
    assert not opts.systemd_cgroup and opts.root == "/run/r"
    assert "SystemdCgroups is not a runc option" in caplog.text
