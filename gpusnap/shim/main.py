"""containerd-shim-gpusnap-v1: containerd's runtime v2 shim entry point.

containerd runs `SHIM -namespace NS -address ADDR -publish-binary BIN -id ID start`
in the bundle directory and reads `{"version":V,"address":...,"protocol":P}`
from stdout (V: 2 for containerd 1.7, which refuses more, over gRPC; 3 for
containerd 2.x, over ttrpc (ttrpc.py says why); the service is
containerd.task.v3.Task for both); `... -bundle DIR delete` cleans up after a dead shim and answers a
DeleteResponse in protobuf on stdout.

`start` stays light (no grpc import): it asks the warm zygote (zygote.py) for a
server, or forks one itself, and prints the address once the server listens.
"""

from __future__ import annotations

import json
import os
import sys
import time

from gpusnap import __version__

# Imports stay lazy: containerd waits on `start` and `delete` for every task.

SOCKET_DIR = os.environ.get("GPUSNAP_SHIM_DIR", "/run/gpusnap/shim")  # sockets, server info, the zygote
_FLAGS_WITH_VALUE = {"namespace", "address", "publish-binary", "id", "bundle", "socket"}


class UsageError(Exception):
    pass


def parse_args(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    """Go flag syntax (-flag value, -flag=value, --flag) as containerd passes it."""
    flags: dict[str, str] = {}
    rest: list[str] = []
    i = 0
    while i < len(argv):
        a = argv[i]
        if a.startswith("-") and not rest:
            name = a.lstrip("-")
            if "=" in name:
                name, value = name.split("=", 1)
            elif name in _FLAGS_WITH_VALUE:
                i += 1
                if i >= len(argv):
                    raise UsageError(f"flag -{name} needs a value")
                value = argv[i]
            else:
                value = "true"
            flags[name] = value
        else:
            rest.append(a)
        i += 1
    return flags, rest


def socket_path(address: str, namespace: str, cid: str) -> str:
    # Unique per containerd, namespace and task, and short (sun_path is 108 bytes).
    import hashlib  # start-up: containerd waits on start/delete

    digest = hashlib.sha256(f"{address}\0{namespace}\0{cid}".encode()).hexdigest()[:32]
    return os.path.join(SOCKET_DIR, digest + ".sock")


def _listening(path: str) -> bool:
    import socket  # start-up: containerd waits on start/delete

    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(path)
        return True
    except OSError:
        return False
    finally:
        s.close()


def _cold_start(req: dict) -> bool:
    """Fork the server from this process; True once it listens."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the server: its own session, off containerd's output pipe
        os.close(r)
        code = 1
        try:
            os.setsid()
            null = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(null, fd)
            from gpusnap.shim.server import serve  # grpc: only the server needs it

            code = serve(req["namespace"], req["address"], req["socket"], w, req["debug"], "cold",
                         req.get("protocol", "grpc"))
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        return f.read(1) == b"1"


def task_api_version(containerd: str) -> int:
    """The bootstrap version the containerd at path CONTAINERD accepts: 3 from 2.0 on, else 2.

    containerd sets MAX_SHIM_VERSION=2 in 1.7 and 2.x alike, so its own
    `--version` tells (a Go binary that answers quickly; asked once per shim start).
    """
    told = os.environ.get("GPUSNAP_SHIM_TASK_VERSION")
    if told in ("2", "3"):
        return int(told)
    from gpusnap.criu.version import tool_version  # re and subprocess: light enough for start

    m = tool_version(containerd or "containerd", r"\s[v]?(\d+)\.\d+", timeout=10)
    return 3 if m and int(m.group(1)) >= 2 else 2


def start(flags: dict[str, str]) -> int:
    ns, address, cid = flags.get("namespace", ""), flags.get("address", ""), flags.get("id", "")
    if not (ns and address and cid):
        raise UsageError("start needs -namespace, -address and -id")
    path = socket_path(address, ns, cid)
    version = task_api_version(flags.get("publish-binary", ""))
    # containerd 2.x reads an idle gRPC channel as a dead shim (ttrpc.py): ttrpc there.
    protocol = "ttrpc" if version >= 3 else "grpc"
    response = json.dumps({"version": version, "protocol": protocol,
                           "address": f"unix://{path}" if protocol == "ttrpc" else path})
    from gpusnap.private import private_dir, write_private  # start-up: containerd waits on start/delete

    if not _listening(path):
        # 0700: containerd (root) is the only client of the sockets in it.
        private_dir(SOCKET_DIR)
        from gpusnap.shim import zygote  # start-up: not for delete or -v

        warm = zygote.enabled()
        req = {"namespace": ns, "address": address, "socket": path, "cwd": os.getcwd(), "protocol": protocol,
               "debug": flags.get("debug") == "true", "env": dict(os.environ)}
        if not (warm and zygote.request(SOCKET_DIR, {**req, "stamp": zygote.code_stamp()})):
            if not _cold_start(req):
                print(f"containerd-shim-gpusnap-v1: the shim server failed to start (see containerd's log for id {cid})",
                      file=sys.stderr)
                return 1
            if warm:
                zygote.launch(SOCKET_DIR)
    # containerd reads this file back to reconnect after it restarts.
    write_private("address", response)
    sys.stdout.write(response)
    sys.stdout.flush()
    return 0


def delete(flags: dict[str, str]) -> int:
    """Clean up after a shim that died: force-delete the runc container, unmount."""
    import subprocess  # start-up: containerd waits on start/delete

    from gpusnap.shim import bundle as bundle_state  # start-up: no grpc in `delete`

    ns, cid = flags.get("namespace", ""), flags.get("id", "")
    bundle = flags.get("bundle") or os.getcwd()
    if not (ns and cid):
        raise UsageError("delete needs -namespace and -id")
    state = bundle_state.read_state(bundle)
    if state is not None:  # the shim died with its container created
        try:
            argv = bundle_state.runc_argv(state.get("runc", ""), state["runc_root"],
                                          state.get("systemd_cgroup", False))
            res = subprocess.run([*argv, "delete", "--force", cid],
                                 capture_output=True, text=True, timeout=120)
            if res.returncode != 0 and "does not exist" not in res.stderr:
                print(f"containerd-shim-gpusnap-v1 delete: runc: {res.stderr.strip()}", file=sys.stderr)
        except subprocess.TimeoutExpired:
            print("containerd-shim-gpusnap-v1 delete: runc delete did not finish within 120 s",
                  file=sys.stderr)
        # died mid-restore: a CRIU killed with it leaves its yard (host cgroups) in its folder
        bundle_state.drop_criu_work(state.get("criu_work", ""), cid, not state.get("restored"))
        bundle_state.drop_unpacked_checkpoint(state.get("checkpoint", ""))
        rootfs = os.path.join(bundle, "rootfs")
        if os.path.ismount(rootfs):
            from gpusnap.shim import mounts  # start-up: containerd waits on start/delete

            mounts.unmount_all(rootfs)
    if flags.get("address"):  # what a killed server left behind
        sock = socket_path(flags["address"], ns, cid)
        for f in (sock, os.path.splitext(sock)[0] + ".json"):
            try:
                os.unlink(f)
            except OSError:
                pass
    sys.stdout.buffer.write(bundle_state.delete_response(128 + 9, time.time_ns()))
    sys.stdout.flush()
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        flags, rest = parse_args(argv)
        if flags.get("v") == "true" or flags.get("version") == "true":
            print(f"containerd-shim-gpusnap-v1 (gpusnap {__version__}), runtime v2, grpc")
            return 0
        action = rest[0] if rest else ""
        if action == "start":
            return start(flags)
        if action == "delete":
            return delete(flags)
        raise UsageError(
            f"unknown action {action!r}: containerd runs this shim as `-namespace NS -address ADDR -id ID start|delete`"
            if action else "no action: containerd runs this shim as `-namespace NS -address ADDR -id ID start|delete`")
    except UsageError as e:
        print(f"containerd-shim-gpusnap-v1: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"containerd-shim-gpusnap-v1: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
