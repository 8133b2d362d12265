"""What the shim keeps in containerd's bundle directory, readable without grpc.

`SHIM delete` runs after a shim died and must be quick (containerd waits on
it in every `ctr run --rm`), so it imports only this module.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from pathlib import Path

from gpusnap.proto.wire import varint

SHIM_STATE = "gpusnap-shim.json"  # how runc ran a created container, and what a restore left; removed by Delete


def runc_root(root_option: str, namespace: str) -> str:
    return os.path.join(root_option or "/run/containerd/runc", namespace)


def write_state(bundle: str, runc_root_dir: str, runc_binary: str, systemd_cgroup: bool = False,
                checkpoint: str = "", criu_work_dir: str = "") -> None:
    """What `SHIM delete` needs after this shim died: runc as it was run, and
    what a restore leaves while it runs (the unpacked checkpoint, CRIU's work
    folder with its cgroup yard)."""
    from gpusnap.private import write_private  # not at the top: `delete` only reads

    write_private(os.path.join(bundle, SHIM_STATE),
                  json.dumps({"runc_root": runc_root_dir, "runc": runc_binary,
                              "systemd_cgroup": systemd_cgroup, "checkpoint": checkpoint,
                              "criu_work": criu_work_dir if checkpoint else ""}))


def runc_argv(binary: str, root: str, systemd_cgroup: bool) -> list[str]:
    """runc and the global flags the shim runs it with, the live shim and
    `SHIM delete` alike (containerd's SystemdCgroup option is runc's
    --systemd-cgroup, on every command)."""
    return [binary or "runc", "--root", root, *(["--systemd-cgroup"] if systemd_cgroup else [])]


def criu_work(bundle: str, criu_work_option: str = "", name: str = "") -> str:
    """Where runc tells CRIU to work on a restore: the bundle's folder, or the
    container's own (NAME: NAMESPACE+ID, a sign neither may hold) under the
    caller's CriuWorkPath (a handler's option is every pod's: a dead shim's
    clean-up must not unmount another restore's yard)."""
    return os.path.join(criu_work_option, name) if criu_work_option else os.path.join(bundle, "criu-work")


def drop_criu_work(work: str, cid: str, failed: bool = True) -> None:
    """Remove a restore's CRIU folder once no CRIU yard is mounted in it: the
    host cgroups a yard holds must never be walked. ``failed``: the restore's
    log (runc's error names it) is kept in gpusnap's logs first."""
    if not work:
        return
    from gpusnap.criu import yard  # not at the top: `delete` imports this module first

    if failed:
        from gpusnap.journal import keep_log  # not at the top, as yard

        keep_log(Path(work) / "restore.log", "restore", cid)
    yard.release(work)
    try:
        mountinfo = Path("/proc/self/mountinfo").read_text()
    except OSError:
        return
    if not yard.yard_mounts(work, mountinfo):
        shutil.rmtree(work, ignore_errors=True)


def read_state(bundle: str) -> dict | None:
    """None when no runc container was created here, or it was deleted cleanly."""
    try:
        with open(os.path.join(bundle, SHIM_STATE)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def mark_restored(bundle: str) -> None:
    """The restore succeeded: a `SHIM delete` after this shim dies then files
    no restore.log as a failed restore's (its CRIU folder still goes). Not
    written (a full /run): the restore stands all the same."""
    state = read_state(bundle)
    if state is not None and not state.get("restored"):
        from gpusnap.private import write_private  # as write_state

        with contextlib.suppress(OSError):
            write_private(os.path.join(bundle, SHIM_STATE), json.dumps({**state, "restored": True}))


def clear_state(bundle: str) -> None:
    try:
        os.unlink(os.path.join(bundle, SHIM_STATE))
    except FileNotFoundError:
        pass


def drop_unpacked_checkpoint(checkpoint: str) -> None:
    """Remove CHECKPOINT where containerd unpacked it for this one restore: containerd
    1.7 unpacks it into a temporary ctrd-checkpoint* directory (Tasks.Create) and
    never removes it; a GPU checkpoint there holds GBs."""
    if checkpoint and re.fullmatch(r"ctrd-checkpoint\d+", os.path.basename(checkpoint.rstrip("/"))):
        shutil.rmtree(checkpoint, ignore_errors=True)


def delete_response(exit_status: int, exited_at_ns: int) -> bytes:
    """containerd.task.v3.DeleteResponse{exit_status=2, exited_at=3} in protobuf wire format.

    Encoded by hand so `delete` needs no protobuf import (tests compare it with
    the generated message).
    """
    secs, nanos = divmod(exited_at_ns, 1_000_000_000)
    ts = b"\x08" + varint(secs) + (b"\x10" + varint(nanos) if nanos else b"")
    return b"\x10" + varint(exit_status) + b"\x1a" + varint(len(ts)) + ts
