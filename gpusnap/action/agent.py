"""One gpusnap process for the later CRIU steps of one restore.

CRIU starts the action script afresh at every step, and each start of Python
with gpusnap's imports costs a replica time at post-restore and again at
post-resume (plus libcuda and cuInit there), inside the stop
(docs/benchmarks.md). The pre-restore step starts this agent instead, while
CRIU still has namespaces, mounts and files to restore; the agent imports
what those steps need, loads the driver and reads NVML for the OCI hook
meanwhile, and packaging/bin/criu-action hands it post-restore and post-resume:

    <state>/actions/<criu pid>-agent/
      started         the agent's pid, written as it starts
      requests        a FIFO: "ACTION INIT_PID REPLY IMAGE_DIR" a line
      pid             the agent's pid, written once it reads requests
      inventory.json  NVML's GPUs, read ahead for runc's prestart hook (a GPU checkpoint)
      inventory.failed  instead, where NVML could not be read (the hook reads it itself)
      reply.<n>       the script's FIFO: what the step printed, then its exit code

Each step runs the same code as in the script (action.run_step, markers
included). pre-restore starts it where it plans a fill or restores a GPU
checkpoint, unless page-fill.json says {"agent": false}; for a GPU checkpoint
with ``--driver``: libcuda loaded and cuInit called on a thread, NVML read for
gpusnap-hook, which takes it instead of its own read, and with ``--turn`` the
restore's turn (gpu/turn.py), held until post-resume is done. Where the agent
is not there, the script runs Python for the step itself; where it stops while
a step is in its hands, the script fails the step (CRIU then stops the restore:
the checkpoint is unchanged), since that step may be half done. The agent
leaves when CRIU does, after post-resume, or after an hour.

Usage: python -m gpusnap.action.agent CRIU_PID [--driver] [--turn KEY:FD]
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import select
import shutil
import sys
import threading
import time

from gpusnap import journal
from gpusnap.action import action, prestart
from gpusnap.action.agent_files import INVENTORY, NO_INVENTORY, folder
from gpusnap.gpu.cuda import DriverAhead
from gpusnap.waits import leave
from gpusnap.gpu import inventory as gpu_inventory, turn
# Loaded as the agent starts, before the steps that use them are asked
from gpusnap.gpu import bundle_plan  # noqa: F401 -- runc's prestart hook (prestart.run_for_agent)
from gpusnap.pages import fill_plan, page_fill, remote_map  # noqa: F401
from gpusnap.private import write_private

LIFETIME_S = 3600.0
HOOK_WAIT_S = 0.5  # for this agent's NVML read, as the hook's own Python waits for it


def _read_inventory(criu_pid: int) -> None:
    """NVML's view of the GPUs for runc's prestart hook, which runs next
    (gpusnap-hook reads it from here, action/prestart.py agent_inventory):
    the hook's own first NVML read would add to the stop (docs/benchmarks.md)."""
    inventory = gpu_inventory.read_inventory()
    here = folder(criu_pid)
    here.mkdir(mode=0o700, exist_ok=True)
    if inventory.error is None:
        write_private(here / INVENTORY, json.dumps(inventory.to_dict()))
    else:  # the hook stops waiting for it and reads NVML itself
        write_private(here / NO_INVENTORY, inventory.error)


def _hook(state_file: str, criu_pid: int) -> int:
    """runc's prestart hook of this restore (packaging/bin/gpusnap-hook hands it
    here with the container's state in ``state_file``), with this agent's NVML read."""
    try:
        with open(state_file, encoding="utf-8") as f:
            state = json.load(f)
        return prestart.run_for_agent(
            state, lambda: prestart.inventory_in(folder(criu_pid), HOOK_WAIT_S))
    except Exception as exc:  # noqa: BLE001 -- the hook's own Python judges it again
        journal.record("hook-error", error=f"{type(exc).__name__}: {exc}", by="agent")
        return prestart.NOT_HERE


def _answer(request: str, criu_pid: int, driver: DriverAhead | None) -> bool:
    """Run one step; False once the agent has nothing more to do."""
    step, init_pid, reply, image_dir = (request.split(" ", 3) + ["", "", "", ""])[:4]
    if step == "prestart" and reply:
        printed = io.StringIO()
        with contextlib.redirect_stderr(printed):
            code = _hook(image_dir, criu_pid)
        _send(reply, _answer_text(printed, code))
        return True
    if step not in ("post-restore", "post-resume") or not reply:
        return True
    os.environ.update({"CRTOOLS_SCRIPT_ACTION": step, "CRTOOLS_INIT_PID": init_pid,
                       "CRTOOLS_IMAGE_DIR": image_dir})
    printed = io.StringIO()
    with contextlib.redirect_stderr(printed):
        try:
            code = action.run_step(step, criu_pid, by="agent",
                                   driver=driver.get() if driver and step == "post-resume" else None)
        except Exception as exc:  # noqa: BLE001 -- the script's own crash would fail the step too
            print(f"gpusnap: {step}: {type(exc).__name__}: {exc}", file=sys.stderr)
            code = 1
    _send(reply, _answer_text(printed, code))
    return step != "post-resume"


def _answer_text(printed: io.StringIO, code: int) -> bytes:
    """What the step printed, "|" a line, then "=CODE": the script prints the
    lines (CRIU logs them, Podman quotes them) and exits with the code."""
    return ("".join(f"|{line}\n" for line in printed.getvalue().splitlines())
            + f"={code}\n").encode()


def _send(reply: str, answer: bytes) -> None:
    """The whole answer into the script's FIFO. Opened without waiting (the script
    holds it open for reading; where it is gone there is nobody to tell), then
    written blocking: an answer longer than the pipe holds is read as it comes."""
    try:
        fd = os.open(reply, os.O_WRONLY | os.O_NONBLOCK)
    except OSError:
        return
    try:
        os.set_blocking(fd, True)
        while answer:
            answer = answer[os.write(fd, answer):]
    except OSError:
        pass  # the script stopped reading: it fails the step itself
    finally:
        os.close(fd)


def serve(criu_pid: int, driver: DriverAhead | None) -> None:
    try:
        criu = os.pidfd_open(criu_pid)
    except OSError:
        return  # CRIU is gone already
    here = folder(criu_pid)
    here.mkdir(mode=0o700, exist_ok=True)
    requests = here / "requests"
    with contextlib.suppress(FileNotFoundError):
        requests.unlink()
    os.mkfifo(requests, 0o600)
    fd = os.open(requests, os.O_RDWR)  # never EOF, never blocks a writer
    write_private(here / "pid", str(os.getpid()))
    deadline, pending = time.monotonic() + LIFETIME_S, b""
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([fd, criu], [], [], 5.0)
            if criu in ready:
                return  # CRIU is gone: no step is coming
            if fd not in ready:
                continue
            pending += os.read(fd, 65536)
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                if not _answer(line.decode(errors="replace").strip(), criu_pid, driver):
                    return
    finally:
        os.close(criu)
        os.close(fd)
        shutil.rmtree(here, ignore_errors=True)


def _held_turn(args: list[str]) -> tuple[int, int] | None:
    """``--turn KEY:FD``: the restore's turn handed over by pre-restore, claimed
    here (the agent names itself its holder); None where there is none."""
    if "--turn" not in args or args.index("--turn") + 1 >= len(args):
        return None
    try:
        key, fd = map(int, args[args.index("--turn") + 1].split(":"))
    except ValueError:
        return None
    if not turn.claim(key, fd, "restore"):
        with contextlib.suppress(OSError):
            os.close(fd)
        return None
    return key, fd


def main() -> int:
    try:
        criu_pid = int(sys.argv[1])
    except (IndexError, ValueError):
        return 2
    held = _held_turn(sys.argv[2:])
    driver = None
    if "--driver" in sys.argv[2:]:
        threading.Thread(target=_read_inventory, args=(criu_pid,), name="gpusnap-agent-nvml",
                         daemon=True).start()
        driver = DriverAhead()
    try:
        serve(criu_pid, driver)
    except OSError as exc:
        journal.record("agent-failed", criu_pid=criu_pid, error=str(exc))
    finally:
        if held is not None:  # post-resume done, or CRIU gone: the GPU state is settled
            turn.release_fd(*held)
    return 0


if __name__ == "__main__":
    leave(main())
