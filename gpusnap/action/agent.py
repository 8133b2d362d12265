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

`gpusnap restore` starts it earlier still, before Podman (runtime/step_agent.py:
``--early NONCE``, in a folder of its own until CRIU's pre-restore asks it,
then as if pre-restore had started it, the pre-restore step run here): no
Python starts in CRIU's stop at all. Until CRIU asks, it leaves with the CLI;
its hour counts from then.

Usage: python -m gpusnap.action.agent CRIU_PID [--driver] [--turn KEY:FD]
       python -m gpusnap.action.agent --early NONCE --parent CLI_PID [--driver]
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
from pathlib import Path

from gpusnap import journal
from gpusnap.action import action, prestart, read_ahead_child
from gpusnap.action.agent_files import INVENTORY, NO_INVENTORY, folder
from gpusnap.gpu.cuda import DriverAhead
from gpusnap.waits import leave
from gpusnap.gpu import inventory as gpu_inventory, turn
from gpusnap.runtime.step_agent import early_folder, early_name
# Loaded as the agent starts, before the steps that use them are asked
from gpusnap.gpu import bundle_plan  # noqa: F401 -- runc's prestart hook (prestart.run_for_agent)
from gpusnap.pages import fill_plan, page_fill, remote_map  # noqa: F401
# pre-restore, where the CLI started this agent (runtime/step_agent.py)
from gpusnap.pages import file_pages, pages_aside  # noqa: F401
from gpusnap.private import write_private

LIFETIME_S = 3600.0
HOOK_WAIT_S = 0.5  # for this agent's NVML read, as the hook's own Python waits for it
# An NVML read older than this at CRIU's take is made again: the GPUs' memory may
# have been taken while the restore downloaded. A replica's take comes within
# a second of the CLI's start: it keeps the read it has.
NVML_FRESH_S = 5.0


class _Nvml:
    """NVML's view of the GPUs for runc's prestart hook, which runs next
    (gpusnap-hook reads it from the agent's folder, action/prestart.py
    agent_inventory): the hook's own first NVML read would add to the stop
    (docs/benchmarks.md). Written once both the read and the folder are there:
    an agent the CLI started learns its folder when CRIU asks for pre-restore.
    The hook re-checks the restore's GPU plan against it, so a read made
    before a long download is made again at the take (``fresh``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._read: gpu_inventory.Inventory | None = None
        self._here: Path | None = None
        self._started = 0.0  # when the read that counts began

    def read(self, started: float | None = None) -> None:
        """A read (asked for at ``started``, else now); the one to write, unless a
        later one is asked for meanwhile."""
        with self._lock:
            if started is None:
                self._started = started = time.monotonic()
        inventory = gpu_inventory.read_inventory()
        with self._lock:
            if started != self._started:
                return  # a later read was asked for meanwhile: it is the one to write
            self._read = inventory
            self._write()

    def fresh(self, within_s: float) -> None:
        """Read again where the read that counts began over ``within_s`` ago
        (in the background; the folder gets the new one when it ends)."""
        with self._lock:
            now = time.monotonic()
            if now - self._started <= within_s:
                return
            self._read, self._started = None, now
        threading.Thread(target=self.read, args=(now,), name="gpusnap-agent-nvml",
                         daemon=True).start()

    def into(self, here: Path) -> None:
        with self._lock:
            self._here = here
            self._write()

    def forget(self) -> None:
        """The folder is about to go: a read ending later writes nowhere (it
        would make the folder again, with only the read in it)."""
        with self._lock:
            self._here = None

    def _write(self) -> None:
        if self._read is None or self._here is None:
            return
        self._here.mkdir(mode=0o700, exist_ok=True)
        if self._read.error is None:
            write_private(self._here / INVENTORY, json.dumps(self._read.to_dict()))
        else:  # the hook stops waiting for it and reads NVML itself
            write_private(self._here / NO_INVENTORY, self._read.error)


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


class _Agent:
    """What one agent holds between its steps."""

    def __init__(self, criu_pid: int | None, driver: DriverAhead | None,
                 nvml: _Nvml | None, held: tuple[int, int] | None = None) -> None:
        self.criu_pid = criu_pid  # None: started by the CLI, until CRIU asks for pre-restore
        self.driver, self.nvml, self.held = driver, nvml, held
        self.wanted = False  # pre-restore found work for it (a GPU checkpoint, a fill)
        self.children = read_ahead_child.Later()  # pre-restore's read-ahead, reaped here

    def adopt(self, criu_pid: int, driver: bool) -> None:
        """What pre-restore does where it would start an agent (action._start_agent),
        done by this agent for itself: for a GPU checkpoint, it takes the restore's
        turn, held until post-resume is done."""
        self.wanted = True
        if not driver or self.held is not None:
            return
        taken = action.restore_turn(criu_pid)
        if taken is not None:
            self.held = (taken.init_pid, taken.fd)

    def release(self) -> None:
        if self.held is not None:  # post-resume done, or CRIU gone: the GPU state is settled
            turn.release_fd(*self.held)
            self.held = None


def _fifo(here: Path) -> int:
    """``here``'s requests FIFO, made anew and opened (never EOF, never blocks a
    writer); ``pid`` written once it reads requests."""
    here.mkdir(mode=0o700, exist_ok=True)
    requests = here / "requests"
    with contextlib.suppress(FileNotFoundError):
        requests.unlink()
    os.mkfifo(requests, 0o600)
    fd = os.open(requests, os.O_RDWR)
    write_private(here / "pid", str(os.getpid()))
    return fd


def _take(request: str, early: Path, agent: _Agent) -> tuple[Path, int]:
    """CRIU's pre-restore, asked of an agent the CLI started (packaging/bin/criu-action,
    which found its folder named in the images): from here on it is that CRIU's
    agent, in that CRIU's folder (the FIFO moves with it), watching that CRIU;
    the step runs here, answered as any other. (The new folder, CRIU's pidfd.)
    Raises where it cannot, leaving no folder of that CRIU: the script then runs
    pre-restore itself, and starts its own agent."""
    _, criu, reply, image_dir = (request.split(" ", 3) + ["", "", "", ""])[:4]
    criu_pid = int(criu)
    here, made, moved = folder(criu_pid), False, False
    watched = os.pidfd_open(criu_pid)
    try:
        here.mkdir(mode=0o700)  # never another agent's: this CRIU has none yet
        made = True
        write_private(here / "started", str(os.getpid()))
        os.rename(early / "requests", here / "requests")
        moved = True
        write_private(here / "pid", str(os.getpid()))
        agent.criu_pid = criu_pid
        journal.record("agent-taken", criu_pid=criu_pid, by="agent")
        if agent.nvml is not None:
            agent.nvml.fresh(NVML_FRESH_S)
            agent.nvml.into(here)
        os.environ.update({"CRTOOLS_SCRIPT_ACTION": "pre-restore", "CRTOOLS_IMAGE_DIR": image_dir})
        printed = io.StringIO()
        with contextlib.redirect_stderr(printed):
            try:
                code = action.run_step("pre-restore", criu_pid, by="agent",
                                       start_agent=agent.adopt, later=agent.children)
            except Exception as exc:  # noqa: BLE001 -- the script's own crash would fail it too
                print(f"gpusnap: pre-restore: {type(exc).__name__}: {exc}", file=sys.stderr)
                code = 1
        if not agent.wanted:  # no later step is the agent's: never a folder runc's hook would ask
            _remove(here, agent)
        _send(reply, _answer_text(printed, code))
    except BaseException:
        os.close(watched)
        if moved:  # the early folder's FIFO back, for serve to close and remove
            with contextlib.suppress(OSError):
                os.rename(here / "requests", early / "requests")
        if made:
            _remove(here, agent)
        raise
    return here, watched


def _remove(here: Path, agent: _Agent) -> None:
    if agent.nvml is not None:
        agent.nvml.forget()
    shutil.rmtree(here, ignore_errors=True)


def serve(here: Path, watched: int, agent: _Agent) -> None:
    """Each request of ``here``'s FIFO answered in turn, until the last step,
    ``watched`` (a pidfd: CRIU, or the CLI that started an agent CRIU has not
    asked yet) is gone, or LIFETIME_S from the start (an early agent: from its take)."""
    fd = _fifo(here)
    deadline, pending = time.monotonic() + LIFETIME_S, b""
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([fd, watched], [], [],
                                        0.05 if agent.children.pending() else 5.0)
            agent.children.reap_ended()
            if watched in ready:
                return  # CRIU is gone (no step is coming), or the CLI (none ever will)
            if fd not in ready:
                continue
            pending += os.read(fd, 65536)
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = line.decode(errors="replace").strip()
                if agent.criu_pid is not None:
                    if not _answer(request, agent.criu_pid, agent.driver):
                        return
                    continue
                if not request.startswith("pre-restore "):
                    if request.startswith("leave "):
                        return  # the CLI's restore ended before CRIU's
                    continue
                early = here
                here, taken = _take(request, early, agent)
                os.close(watched)
                watched = taken
                shutil.rmtree(early, ignore_errors=True)
                if not agent.wanted:
                    return  # pre-restore would have started no agent: later steps are Python's
                deadline = time.monotonic() + LIFETIME_S
    finally:
        os.close(watched)
        os.close(fd)
        _remove(here, agent)
        agent.children.kill_all()  # by now long done (a read-ahead takes ~0.1 s), or hung


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


def _option(args: list[str], name: str) -> str | None:
    at = args.index(name) + 1 if name in args else len(args)
    return args[at] if at < len(args) else None


def main() -> int:
    args = sys.argv[1:]
    nonce = _option(args, "--early")
    try:
        criu_pid = None if nonce else int(args[0])
    except (IndexError, ValueError):
        return 2
    nvml = _Nvml() if "--driver" in args else None
    agent = _Agent(criu_pid, None, nvml, _held_turn(args))
    try:
        # CRIU's agent watches CRIU; the CLI's, the CLI until CRIU asks for it
        parent = None if criu_pid else int(_option(args, "--parent") or 0)
        watched = os.pidfd_open(criu_pid or parent)
    except (OSError, ValueError):
        agent.release()
        return 0  # gone already: no step is coming
    if parent is not None and os.getppid() != parent:
        os.close(watched)  # the CLI went before this could watch it (its pid reused since)
        return 0
    if nvml is not None:
        threading.Thread(target=nvml.read, name="gpusnap-agent-nvml", daemon=True).start()
        agent.driver = DriverAhead()
    here = folder(criu_pid) if criu_pid else early_folder(early_name(os.getpid(), nonce))
    if nvml is not None and criu_pid:
        nvml.into(here)
    try:
        serve(here, watched, agent)
    except (OSError, ValueError) as exc:
        journal.record("agent-failed", criu_pid=agent.criu_pid, error=str(exc))
    finally:
        agent.release()
    return 0


if __name__ == "__main__":
    leave(main())
