"""The CRIU action script (``action-script`` in /etc/criu/runc.conf).

CRIU runs it, with CRTOOLS_SCRIPT_ACTION, CRTOOLS_INIT_PID (host pid of the
container's init) and CRTOOLS_IMAGE_DIR set, at each step of a dump or restore;
a non-zero exit aborts the dump. Two steps matter:

- pre-dump, before CRIU freezes the tree: quiesce the container's CUDA
  processes (GPU memory to host memory, GPU released) and write the GPU
  manifest into the image directory. A guardian then waits for CRIU to exit
  and brings back any process that survived the dump (--leave-running, or a
  dump that failed), so no process stays without its GPU.
- post-resume, once restored tasks run again: restore their GPU state and
  unlock them.

(And, for a restore with big memory, pre-restore picks the runs of pages that
page_fill.py writes on many threads at post-restore, while the tasks wait in
CRIU's restorer, instead of CRIU on one: fill_plan.py. A post-resume that
fails keeps a local checkpoint Podman would drop: kept_checkpoint.py.)

(And post-dump, only for a push that asks: the memory pages set aside, out of
Podman's export; pages_aside.py. Where those go to RAM, pre-dump reads the
driver's copy of the GPU memory out on many threads before CRIU would, and
post-dump puts it back into the images: dump_ahead.py.)

Containers without CUDA processes are left exactly as CRIU would treat them.
This module dispatches every step and holds the restore steps; the dump
steps are action_dump.py's, and what a step leaves for a later one is kept
where step_state.py says.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, NoReturn

from gpusnap import MANIFEST_NAME, PLAN_NAME, journal
from gpusnap.action import agent_files, read_ahead_child, step_state
from gpusnap.errors import GpusnapError
from gpusnap.gpu import staging, turn
from gpusnap.private import write_private
from gpusnap.procs import cuda_processes, ns_pid, parent_of, process_tree, start_time
from gpusnap.runtime import kept_checkpoint, step_agent
from gpusnap.waits import leave, raise_words

if TYPE_CHECKING:
    from gpusnap.pages.fill_plan import Settings

# The dump steps (action_dump.py) and the driver's side of post-resume
# (gpu/quiesce.py, gpu/manifest.py) are imported where they run: pre-restore
# starts Python in CRIU's stop and needs neither (~60 ms of imports).

# The steps with work to do; packaging/bin/criu-action lets only these start Python.
ACTIONS = ("pre-dump", "post-dump", "pre-restore", "post-restore", "post-resume")


def fill_settings() -> "Settings | None":
    """page-fill.json's settings; None (journaled) where it cannot be read: no fill."""
    from gpusnap.pages import fill_plan  # pre-restore only: not every step's start-up
    try:
        return fill_plan.settings()
    except ValueError as exc:
        journal.record("pages-fill-skipped", error=str(exc))
        return None


def pre_restore(image_dir: str, criu_pid: int, wanted: "Settings | None",
                later: "read_ahead_child.Later | None" = None) -> None:
    """Keep the manifest and the GPU plan for post-resume: by then CRIU has
    closed its image directory (CRTOOLS_IMAGE_DIR names a /proc fd of it).
    ``wanted``: page-fill.json's settings (fill_settings; None: no fill);
    ``later``: who reaps the read-ahead child (the agent: it is not CRIU's
    child), else it is reaped before the step ends."""
    if not image_dir:
        return
    folder = Path(image_dir)
    # the agent `gpusnap restore` named (runtime/step_agent.py): no later checkpoint carries it
    (folder / step_agent.AGENT_FILE).unlink(missing_ok=True)
    from gpusnap.pages import pages_aside  # pre-restore only: not every step's start-up
    in_ram = pages_aside.in_ram(folder)
    moved = pages_aside.bring_back(folder)  # restored tasks cannot follow the links
    if moved:
        journal.record("pages-in-place", files=moved, in_ram=in_ram)
    kept = {name: (folder / name).read_text() for name in (MANIFEST_NAME, PLAN_NAME)
            if (folder / name).exists()}
    if kept:  # with the folder's path: post-resume's CRTOOLS_IMAGE_DIR is a /proc fd CRIU closed
        kept["images"] = os.path.realpath(folder)
        write_private(step_state.restore(criu_pid), json.dumps(kept))
    else:  # never another restore's (pid reused): it names a folder post-resume acts on
        step_state.restore(criu_pid).unlink(missing_ok=True)
    step_state.fill(criu_pid).unlink(missing_ok=True)  # never another restore's (pid reused)
    if wanted is None:
        return
    reader = read_ahead_child.start(folder) if wanted.read_ahead else None
    try:
        if wanted.enabled:
            _plan_fill(folder, criu_pid, wanted)
    finally:
        if reader is not None and later is not None:
            later.add(reader)
        elif reader is not None:
            read_ahead_child.reap(reader)


def _plan_fill(folder: Path, criu_pid: int, wanted) -> None:
    """Leave the big runs of pages to post-restore's threads (fill_plan.py).
    CRIU then restores every page itself where this fails, unless a rewrite
    cannot be put back (undo_leftover_fill's GpusnapError: the restore stops)."""
    from gpusnap.pages import fill_plan, fill_plan_cache  # pre-restore only: not every step's start-up
    state = step_state.fill(criu_pid)
    started = time.monotonic()
    try:
        planned = fill_plan.prepare(folder, lambda p: write_private(state, p.to_json()),
                                    huge_pages=wanted.huge_pages and fill_plan.thp_available(),
                                    map_staging=wanted.map_staging,
                                    cache=journal.state_subdir(fill_plan_cache.FOLDER))
    except (OSError, ValueError) as exc:
        state.unlink(missing_ok=True)
        undo_leftover_fill(str(folder))  # where prepare could not put it back itself
        journal.record("pages-fill-skipped", error=str(exc))
        return
    if planned is not None:
        journal.record("pages-fill-planned", bytes=planned.bytes, tasks=len(planned.tasks),
                       huge_bytes=planned.huge_bytes, mapped_bytes=planned.mapped_bytes,
                       seconds=round(time.monotonic() - started, 3), phases=planned.phases,
                       kept_plan=planned.kept)


def undo_leftover_fill(image_dir: str) -> None:
    """A folder left rewritten (by a restore that failed, or a rewrite cut short)
    is put back before CRIU reads it; where it cannot be, GpusnapError stops
    the restore (CRIU would restore holes where the pages belong)."""
    if not image_dir:
        return
    from gpusnap.pages import fill_plan  # pre-restore only: not every step's start-up
    try:
        if fill_plan.undo(Path(image_dir)):
            journal.record("pages-fill-undone", folder=image_dir)
    except (OSError, ValueError) as exc:
        raise GpusnapError(f"CRIU's images in {image_dir} were left rewritten by a restore that "
                           f"failed and cannot be put back ({exc})",
                           "restore the checkpoint from its archive or registry") from None


def post_restore(init_pid: int, criu_pid: int, by: str = "script") -> None:
    """Write the runs pre-restore left out into the restored tasks, which wait in
    CRIU's restorer with their memory in place (before CRIU's late device hooks,
    rseq fix-ups and the tasks' resume). Any failure (GpusnapError here, or this
    script dying) makes CRIU kill the tasks and fail the restore: nothing runs
    on memory that is not what was dumped, but for the driver's staging where
    it is to be mapped (staging.hold: no driver restore until post-resume put
    it back). The images folder is put back either way."""
    from gpusnap.pages import fill_plan, page_fill  # post-restore only: not every step's start-up
    state = step_state.fill(criu_pid)
    if not state.exists():
        return
    folder = None
    started = time.monotonic()
    try:
        planned = fill_plan.Plan.from_json(state.read_text())
        folder = Path(planned.folder)
        threads = fill_plan.settings().threads or page_fill.default_threads()
        pids = {ns_pid(pid): pid for pid in process_tree(init_pid)}
        filling = time.monotonic()
        for vpid, runs in planned.tasks.items():
            if vpid not in pids:
                raise OSError(f"no restored task has pid {vpid} in the container")
            page_fill.fill(pids[vpid], runs, threads)
        for vpid, runs in planned.mapped.items():  # post-resume maps them (gpu/staging.py)
            staging.hold(pids[vpid], [(r.address, r.length, r.path, r.offset) for r in runs])
        fill_s = time.monotonic() - filling
    except Exception as exc:
        raise GpusnapError(f"could not write the restored memory ({exc}); CRIU stops the "
                           "restore", "the checkpoint is unchanged: restore it again") from None
    finally:
        if folder is not None:
            with contextlib.suppress(OSError, ValueError):
                fill_plan.undo(folder)
        state.unlink(missing_ok=True)
    journal.record("pages-filled", init_pid=init_pid, bytes=planned.bytes, threads=threads,
                   mapped_bytes=planned.mapped_bytes,
                   tasks=len(planned.tasks), runs=sum(len(r) for r in planned.tasks.values()),
                   fill_s=round(fill_s, 3), seconds=round(time.monotonic() - started, 3), by=by)


def check_without_hook(image_dir: str, criu_pid: int) -> None:
    """Where the runtime runs no OCI hook at restore (crun), the checks gpusnap's
    hook makes under runc, made here before CRIU restores a task: GPUs that
    cannot take the checkpoint are refused, and so is a move onto other GPUs,
    which only the hook's live remap or `gpusnap restore` (a plan beside the
    manifest, re-checked here as the hook re-checks it) can make. GpusnapError
    says why."""
    folder = Path(image_dir) if image_dir else None
    if folder is None or not (folder / MANIFEST_NAME).exists():
        return
    if _runtime_of(criu_pid) != "crun":
        return
    from gpusnap.gpu.bundle_plan import plan_restore_here  # crun only: not every step's start-up

    config = Path(os.path.realpath(folder)).parent / "config.json"  # Podman: userdata/checkpoint
    spec = json.loads(config.read_text()) if config.exists() else {}
    problems, plan = plan_restore_here(folder / MANIFEST_NAME, spec)
    if problems:
        raise GpusnapError("cannot restore here: " + "; ".join(problems))
    if plan is not None and plan.needs_remap:
        raise GpusnapError("crun runs no OCI hook at restore, so a plain `podman container "
                           f"restore` cannot move the GPUs ({'; '.join(plan.describe())}); "
                           "`gpusnap restore` moves them before Podman starts")


def _runtime_of(criu_pid: int) -> str:
    """The command name of the program that started CRIU (runc, crun). Its comm,
    not its exe: crun runs from a sealed memfd copy of itself ("/memfd:crun")."""
    try:
        stat = Path(f"/proc/{criu_pid}/stat").read_text()
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        return Path(f"/proc/{ppid}/comm").read_text().strip()
    except (OSError, ValueError, IndexError):
        return ""


def post_resume(init_pid: int, criu_pid: int, driver=None, by: str = "script") -> None:
    """The restored CUDA processes' GPU state back, then unlocked; ``driver``:
    one the agent loaded ahead (else loaded here)."""
    from gpusnap.gpu import manifest as gpu_manifest, quiesce  # see the imports above

    held, mapped = staging.held_under(init_pid), {}  # before the driver is asked to restore
    if held:
        from gpusnap.pages import remote_map  # only where post-restore left staging to map
        mapped = remote_map.put_back(held, init_pid, by)
    state = step_state.restore(criu_pid)
    kept = json.loads(state.read_text()) if state.exists() else {}
    manifest = gpu_manifest.parse(kept[MANIFEST_NAME], MANIFEST_NAME) \
        if MANIFEST_NAME in kept else None
    if manifest is not None and manifest.quiesced_by == "criu-cuda-plugin":
        return  # CRIU's plugin brings them back itself
    # the processes NVML saw GPU memory of at the dump: the driver checkpointed them
    expected = sum(1 for p in manifest.processes if any(p.gpu_memory.values())) if manifest else 0
    if not expected and not cuda_processes(init_pid):
        return
    ahead, driver = driver is not None, driver or quiesce.require_driver()
    seen = quiesce.restored_answers(driver, lambda: [p.pid for p in cuda_processes(init_pid)],
                                    expected)
    timing = quiesce.Timing()
    live = _live_remap(init_pid)
    choices = live[1].pair_choices() if live else _pair_choices(kept.get(PLAN_NAME))
    try:
        if live:
            live[0].apply()
        label, changed, refused = quiesce.resume_onto(driver, seen.pids, choices, timing)
    except BaseException:
        if live:
            live[0].undo()
        raise
    finally:
        if live:
            live[0].close()
    if mapped:  # what the driver's restore did not unmap becomes the process's own
        remote_map.let_go(mapped, init_pid, by)
    if changed:
        journal.record("resumed", init_pid=init_pid, pids=changed, timing=timing.phases,
                       gpu_pairs=label, failed_first=refused,
                       moved_live=live[1].describe() if live else None,
                       by=by, driver_ahead=ahead,
                       **({"waited_s": seen.waited, "unanswered": seen.unanswered}
                          if seen.waited else {}))
    if seen.short and seen.missing:  # what answered runs again; the rest is said
        raise NotAnswered(f"{seen.short}; those stay CHECKPOINTED", seen.missing)
    if seen.short:  # nothing left to resume: a process exited once CRIU resumed it
        journal.record("resume-short", init_pid=init_pid, error=seen.short)


class NotAnswered(GpusnapError):
    """Restored processes the driver did not answer for: left CHECKPOINTED. The
    pids go into the step's journal record, for the restore's own check."""

    def __init__(self, message: str, pids: list[int]) -> None:
        super().__init__(message, "`gpusnap doctor --fix` brings them back once the driver "
                                  f"answers; {raise_words('RESUME_SETTLE')} waits longer")
        self.pids = pids


def _live_remap(init_pid: int):
    """A plain `podman container restore` onto GPUs other than the checkpoint's: the
    OCI hook planned it (the runtime spec still names the old GPUs); the restored
    container gets the new nodes and cgroup rule here, before its GPU state returns."""
    stash = journal.state_subdir("restores") / f"{init_pid}.json"
    if not stash.exists():
        return None
    from gpusnap.gpu.plan import Plan  # a live remap only: not every step's start-up
    from gpusnap.runtime.livedev import plan_live  # a live remap only: not every step's start-up

    data = json.loads(stash.read_text())
    stash.unlink()
    if data.get("start_time") != start_time(init_pid):
        return None  # left by a restore that failed: the pid names another process now
    plan = Plan.from_dict(data["plan"])
    return plan_live(init_pid, data["spec"], plan.remap), plan


def _pair_choices(plan_text: str | None) -> list[tuple[str, list[tuple[str, str]] | None]]:
    """What to offer the driver: the plan's choices when `gpusnap restore` moved the GPUs."""
    if plan_text is None:
        return [("none", None)]
    from gpusnap.gpu.plan import Plan  # a moved restore only: not every step's start-up

    return Plan.from_json(plan_text).pair_choices()


def _run(action: str, criu_pid: int | None = None, by: str = "script", driver=None,
         start_agent: "Callable[[int, bool], None] | None" = None,
         later: "read_ahead_child.Later | None" = None) -> int:
    criu_pid = criu_pid or os.getppid()  # the script's parent is CRIU
    if action == "post-dump":
        # An optimisation: never the reason a dump fails (the pages then stay
        # where CRIU wrote them, and the push reads them from the export)...
        from gpusnap.action.action_dump import post_dump  # see the imports above
        from gpusnap.pages.dump_ahead import AheadError  # post-dump only: not every step's start-up

        init_pid = os.environ.get("CRTOOLS_INIT_PID", "0")
        try:
            post_dump(int(init_pid), os.environ.get("CRTOOLS_IMAGE_DIR", ""), criu_pid)
        except AheadError as exc:  # ...unless the images lack memory read ahead: CRIU resumes the tree
            journal.record("failed", action=action, init_pid=init_pid, error=str(exc))
            print(f"Error (gpusnap): {exc}", file=sys.stderr)
            return 1
        except (OSError, ValueError, KeyError) as exc:
            journal.record("failed", action=action, error=str(exc))
        return 0
    if action == "pre-restore":
        image_dir = os.environ.get("CRTOOLS_IMAGE_DIR", "")
        try:
            undo_leftover_fill(image_dir)
            check_without_hook(image_dir, criu_pid)
            try:  # only keeps files for later and speeds the restore: never why it fails...
                # The agent takes post-restore's fill and post-resume from here; for a
                # GPU checkpoint it loads the driver and reads NVML ahead too, and
                # holds the restore's turn (agent.py). There it starts first: its
                # Python, libcuda and NVML load while the pages are put in place and
                # the fill is planned, not after (runc's hook waits for its NVML read).
                # (An agent the CLI started runs this step itself: start_agent is its own.)
                gpu = bool(image_dir) and (Path(image_dir) / MANIFEST_NAME).exists()
                wanted = fill_settings()
                agent = wanted is None or wanted.agent
                start = start_agent or _start_agent
                if agent and gpu:
                    start(criu_pid, True)
                pre_restore(image_dir, criu_pid, wanted, later)
                if agent and not gpu and wanted is not None and image_dir \
                        and step_state.fill(criu_pid).exists():
                    start(criu_pid, False)
            except (OSError, ValueError) as exc:
                journal.record("failed", action=action, error=str(exc))
        except GpusnapError as exc:  # ...unless it must: CRIU stops before any task is restored
            journal.record("refused-restore", action=action, error=str(exc))
            # CRIU logs what its scripts print; Podman quotes its log's "Error" lines
            print(f"Error (gpusnap): {exc}", file=sys.stderr)
            return 1
        return 0
    from gpusnap.gpu.quiesce import QuiesceError  # see the imports above

    try:
        init_pid = int(os.environ["CRTOOLS_INIT_PID"])
        image_dir = os.environ["CRTOOLS_IMAGE_DIR"]
        if action == "pre-dump":
            from gpusnap.action.action_dump import pre_dump  # see the imports above
            pre_dump(init_pid, image_dir, criu_pid)
        elif action == "post-restore":
            post_restore(init_pid, criu_pid, by)
        else:
            post_resume(init_pid, criu_pid, driver, by)
            kept_checkpoint.after_resume(_images(criu_pid, image_dir))
    except (GpusnapError, QuiesceError) as exc:
        # a refusal (GpusnapError) keeps its hint apart: the CLI says it as its own
        journal.record("failed", action=action, init_pid=os.environ.get("CRTOOLS_INIT_PID"),
                       error=getattr(exc, "message", str(exc)), hint=getattr(exc, "hint", None),
                       refused=isinstance(exc, GpusnapError),
                       **({"pids": exc.pids} if isinstance(exc, NotAnswered) else {}))
        if action == "post-resume":
            kept_checkpoint.after_failed_resume(_images(criu_pid, image_dir),
                                                getattr(exc, "message", str(exc)), init_pid)
        # CRIU logs what its scripts print; criu.log.first_error takes this line
        print(f"gpusnap: {action}: {exc}", file=sys.stderr)
        return 1
    except (KeyError, ValueError) as exc:
        print(f"gpusnap: {action}: CRIU did not pass {exc}", file=sys.stderr)
        return 1
    return 0


def _images(criu_pid: int, image_dir: str) -> str:
    """The images folder as pre-restore resolved it (a GPU checkpoint's)."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        return json.loads(step_state.restore(criu_pid).read_text()).get("images") or image_dir
    return image_dir


def _start_agent(criu_pid: int, driver: bool) -> None:
    """The agent that takes post-restore and post-resume (agent.py); a restore
    goes on without it where it cannot start. For a GPU checkpoint it is handed
    the restore's turn (gpu/turn.py, keyed by the runtime that started CRIU, the
    restored tree's parent: runc restores it as CRIU's sibling), held until its
    post-resume is done: the restored processes wait CHECKPOINTED meanwhile, and
    `gpusnap doctor --fix` must leave them to the resume onto the plan's GPUs."""
    held = restore_turn(criu_pid) if driver else None
    try:
        agent_files.start(criu_pid, driver, held)
    except OSError as exc:
        journal.record("agent-not-started", error=str(exc))
    finally:
        if held is not None:
            held.close()  # the agent's copy holds it; where none started, this lets go


def restore_turn(criu_pid: int) -> "turn.Turn | None":
    """The restore's turn for a GPU checkpoint's agent (_start_agent hands it over,
    an agent the CLI started takes it itself), keyed by the runtime that started
    CRIU; None where another holds it or it cannot be taken (journaled)."""
    key = parent_of(criu_pid)
    try:
        return turn.try_take(key, "restore") if key else None
    except OSError as exc:
        journal.record("restore-turn-not-taken", error=str(exc))
        return None


def run_step(action: str, criu_pid: int, by: str = "script", driver=None,
             start_agent: "Callable[[int, bool], None] | None" = None,
             later: "read_ahead_child.Later | None" = None) -> int:
    """Run each action once per CRIU process; its exit code.

    runc hands CRIU /etc/criu/runc.conf and CRIU reads it again itself, so
    an action script may be called twice in a row; the second call repeats
    the first one's answer (a failed lock must not be retried with defaults).
    ``by``, ``driver``: the agent's (agent.py), which runs steps for CRIU;
    ``start_agent``: what pre-restore does instead of starting one (that agent's),
    ``later``: that agent's reaper of pre-restore's read-ahead child.
    """
    folder = step_state.folder()
    marker = folder / f"{criu_pid}-{action}"
    if marker.exists():
        return int(marker.read_text() or 0)
    for stale in folder.iterdir():  # markers of CRIU runs that have ended (and their .tmp files)
        if not os.path.exists(f"/proc/{stale.name.lstrip('.').split('-', 1)[0]}"):
            if stale.is_dir():  # an agent's, where it could not remove it itself
                shutil.rmtree(stale, ignore_errors=True)
            else:
                stale.unlink(missing_ok=True)
    code = _run(action, criu_pid, by, driver, start_agent, later)
    write_private(marker, str(code))
    return code


def _std_fds_open() -> None:
    """CRIU may run this with fds 0-2 closed: a file opened next would land
    there, and a child's stdin or stdout be set over it (gpu/turn.py's turn)."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            os.open(os.devnull, os.O_RDWR)  # the lowest free fd: this one


def main() -> int:
    action = os.environ.get("CRTOOLS_SCRIPT_ACTION", "")
    if action not in ACTIONS:
        return 0
    _std_fds_open()
    return run_step(action, os.getppid())


def entry() -> NoReturn:
    """The console script's: out through `leave`, so a driver call still in flight
    (a lock past its bound) never holds CRIU in libcuda's exit handlers."""
    leave(main())


if __name__ == "__main__":
    entry()
