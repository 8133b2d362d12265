"""The CRIU action script's dump steps (action.py dispatches them).

pre-dump, before CRIU freezes the tree: the container's CUDA processes are
quiesced (GPU memory to host memory, GPU released) and the GPU manifest is
written into the image directory; a guardian then waits for CRIU to exit and
brings back any process that survived the dump (--leave-running, or a dump
that failed). For a push that asks, the driver's copy of the GPU memory is
read out on many threads before CRIU would (dump_ahead.py), and post-dump
puts it back into the images.

What a CLI killed before its dump left for it (its options, a push's pages
request: requests.for_dump) is dropped, not obeyed, and CRIU writes through
no pages link but this dump's own push's. What an earlier dump left in the
folder goes only once this dump goes on: a refused one leaves it whole.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from gpusnap import MANIFEST_NAME, PLAN_NAME, journal, requests
from gpusnap.action import step_state
from gpusnap.criu.version import criu_version, cuda_plugin_path
from gpusnap.errors import GpusnapError
from gpusnap.gpu import manifest as gpu_manifest, staging
from gpusnap.gpu.inventory import read_inventory
from gpusnap.gpu.turn import Turn, wait_turn
from gpusnap.gpu.quiesce import (DEFAULT_LOCK_TIMEOUT_MS, QuiesceError, Timing, quiesce,
                                  refuse_unmanaged, refuse_unsupported, require_driver, resume)
from gpusnap.private import write_private
from gpusnap.procs import alive, cuda_processes, ns_pid, process_tree
from gpusnap.runtime import kept_checkpoint


def lock_timeout_ms(request: dict) -> int:
    """A `gpusnap checkpoint --lock-timeout` request's, else the default.

    Podman hands runc (and so CRIU and this script) a scrubbed environment, so
    the CLI leaves its options in a request file keyed by the init pid.
    """
    try:
        return int(request.get("lock_timeout_ms", DEFAULT_LOCK_TIMEOUT_MS))
    except (TypeError, ValueError):
        return DEFAULT_LOCK_TIMEOUT_MS


def pre_dump(init_pid: int, image_dir: str, criu_pid: int) -> None:
    """GpusnapError where the dump must not go on. An OSError (a full disk, a
    read-only or missing folder) is one too, in the words of the other
    refusals, never a traceback: CRIU stops the dump before it freezes
    anything, and any GPU taken comes back (the guardian, else
    _guardian_or_give_back)."""
    push: dict = {}
    try:
        # The CLI's requests, where their writer still waits for this dump: one
        # a CLI killed before its dump left is dropped, never obeyed
        options = requests.take_for_dump(init_pid)
        push = requests.for_dump(init_pid, "pages", image_dir)  # post-dump takes it
        _pre_dump_steps(init_pid, image_dir, criu_pid, push, lock_timeout_ms(options))
    except OSError as exc:
        raise _cannot_prepare(exc) from None
    finally:  # round 1's kept pages the read-ahead did not write over: CRIU needs the memory
        reuse = push.get("reuse")
        if reuse:
            from gpusnap.pages import kept_pages  # a final round only: not every step's start-up
            kept_pages.release([str(p) for p in reuse])


def _cannot_prepare(exc: OSError) -> GpusnapError:
    where = f" ({exc.filename})" if exc.filename else ""
    return GpusnapError(f"could not prepare the dump: {exc.strerror or exc}{where}; "
                        "nothing was dumped",
                        "fix the cause it names, then checkpoint again; `gpusnap doctor` "
                        "checks the host")


def _pre_dump_steps(init_pid: int, image_dir: str, criu_pid: int, push: dict,
                    lock_ms: int) -> None:
    if image_dir:
        from gpusnap.pages import pages_aside  # pre-dump only: not every step's start-up
        pages_aside.drop_stale_parent(Path(image_dir))
    step_state.ahead(criu_pid).unlink(missing_ok=True)  # never another dump's (a CRIU pid reused)
    if _quiesced_before_the_pause(init_pid, image_dir):  # its client holds the turn
        return
    # The shim holds the task for its client, and an earlier try's guardian
    # (CRIU could not seize the task) waits for that client's Resume, which the
    # shim refuses during this dump: waiting would only time out. The
    # processes stay checkpointed until that guardian gives them back.
    turn = wait_turn(init_pid, f"pre-dump of the container whose init is pid {init_pid}",
                     "pre-dump", go_on=lambda pid, role: role == "guardian-held" and
                     pid is not None and alive(pid) and requests.held(init_pid))
    if turn is None:
        _pre_dump(init_pid, image_dir, criu_pid, None, push, lock_ms)
        return
    with turn:
        _pre_dump(init_pid, image_dir, criu_pid, turn, push, lock_ms)


def _pre_dump(init_pid: int, image_dir: str, criu_pid: int, turn: Turn | None,
              push: dict, lock_ms: int) -> None:
    """Quiesce and write the manifest; a guardian started here holds ``turn``
    on, through CRIU, until the GPUs are back. ``push``: the pages request of
    this dump ({} for none)."""
    ahead = bool(push.get("read_ahead")) and bool(image_dir)
    procs = cuda_processes(init_pid)
    if not procs:
        _earlier_dump_goes(image_dir, push)
        if ahead and push.get("ahead_test_min"):
            _read_ahead_test(init_pid, criu_pid, push, turn)
        return
    inventory = read_inventory()
    refuse_unsupported(procs, inventory)
    plugin = cuda_plugin_path()
    by = "criu-cuda-plugin" if plugin else "gpusnap"
    manifest = gpu_manifest.build(procs, inventory, criu_version(), by)
    pids = [p.pid for p in procs]
    free_at = None  # when the GPU was free for the next job: its memory in host memory
    guardian = None
    if plugin is None:
        from gpusnap.pages import dump_ahead  # GPU dumps only: not every step's start-up
        before = {pid: _mapped(dump_ahead.mapped, pid) for pid in pids}
        timing = Timing()
        driver = require_driver()
        refuse_unmanaged(driver, procs)
        changed = quiesce(driver, pids, lock_ms, timing)
        free_at = round(time.time(), 3)  # before the read-ahead below, which takes seconds at GBs
        manifest.timing = timing.phases
        held = _held(dump_ahead, changed, before)
        guardian = _guardian_or_give_back(driver, criu_pid, changed, init_pid, turn)
        _earlier_dump_goes(image_dir, push)
        if image_dir:  # for a restore that maps these instead of writing them: not needed
            try:
                staging.record(image_dir, held)
            except OSError as exc:
                journal.record("staging-not-recorded", init_pid=init_pid, error=str(exc))
        held = {pid: ranges for (pid, _), ranges in held.items()}
        if ahead and guardian is not None:
            _read_ahead(criu_pid, guardian, push, held)
    else:
        _earlier_dump_goes(image_dir, push)
        if turn is not None:  # the plugin quiesces and resumes inside CRIU: held till it exits
            guardian = _start_guardian(criu_pid, [], init_pid, turn, force=True)
            if guardian is not None:
                guardian.close()
    if image_dir:  # CRIU always names one; never the working folder
        gpu_manifest.write(manifest, image_dir)
    # ``at``: when the GPU was free (none where CRIU's plugin quiesces, later, inside CRIU)
    # ``guardian``: whether one gives the GPUs back after CRIU (its verdict: ops/gpu_back.py)
    journal.record("quiesced", init_pid=init_pid, pids=pids, by=by, timing=manifest.timing,
                   **({"at": free_at} if free_at is not None else {}),
                   turn_waited_s=turn.waited_s if turn is not None else None,
                   guardian=guardian is not None)


def _earlier_dump_goes(image_dir: str, push: dict) -> None:
    """This dump goes on: what an earlier one left in a folder Podman kept goes
    (its GPU manifest, a restore's plan, its staging record: this dump writes
    its own), and so does a kept copy sharing its files, which CRIU is about to
    rewrite (runtime/kept_checkpoint.py). Never sooner: a dump pre-dump refuses
    leaves that earlier checkpoint whole, and it may be the only way back.
    Links CRIU would write its pages through go too, but for ``push``'s own
    (pages_aside.drop_others)."""
    if not image_dir:  # CRIU always names one; never the working folder
        return
    from gpusnap.pages import pages_aside  # pre-dump only: not every step's start-up
    kept_checkpoint.before_dump(os.path.realpath(image_dir))
    staging.forget(image_dir)
    for name in (MANIFEST_NAME, PLAN_NAME):
        (Path(image_dir) / name).unlink(missing_ok=True)
    aside = Path(push["aside"]) if push.get("aside") else None
    dropped = pages_aside.drop_others(Path(image_dir), aside)
    if dropped:
        journal.record("pages-links-dropped", folder=image_dir, links=dropped,
                       why="not this dump's: CRIU would write its pages through them")
    links = push.get("prelink")
    if aside is not None and isinstance(links, int) and links > 0 and aside.is_dir():
        # The CLI linked them before it waited on Podman's lock; a dump run
        # meanwhile (someone's plain checkpoint) dropped them as not its own
        # and left its pages in their place, which CRIU would write over
        # there: they go (this dump replaces them), and the links come back
        earlier = [f for f in Path(image_dir).glob(pages_aside.PATTERN)
                   if f.is_file() and not f.is_symlink()]
        for f in earlier:
            f.unlink()
        made = pages_aside.prelink(Path(image_dir), aside, links)
        if made:
            journal.record("pages-links-made-again", folder=image_dir, links=made,
                           replaced=sorted(f.name for f in earlier))


def _mapped(read, pid: int) -> list[tuple[int, int]] | None:
    """``read(pid)`` of its memory map, None where it cannot be read (the staging
    record and the read-ahead are for speed: a process gone is CRIU's to find)."""
    try:
        return read(pid)
    except OSError:
        return None


def _held(dump_ahead, pids: list[int], before: dict) -> dict[tuple[int, int], list]:
    """Where the driver's checkpoint put each process's GPU memory: by (pid, its
    pid in the container, as CRIU's images name it); a process whose map could
    not be read is left out (a process gone is CRIU's to find)."""
    out = {}
    for pid in pids:
        if before.get(pid) is not None:
            with contextlib.suppress(OSError):
                out[(pid, ns_pid(pid))] = dump_ahead.staging(pid, before[pid])
    return out


def _quiesced_before_the_pause(init_pid: int, image_dir: str) -> bool:
    """The containerd client quiesced the GPU before its pause (requests.QUIESCED):
    the manifest it built then goes into the images; nothing is quiesced here.
    A process that took the GPU since holds the driver's files, which CRIU
    cannot dump: refused in words rather than by CRIU."""
    first = requests.bound(init_pid, requests.QUIESCED, consume=True)  # the client checks
    if not first.get("manifest"):
        return False
    late = [p for p in cuda_processes(init_pid) if p.holds_driver]
    if late:
        who = ("process " if len(late) == 1 else "processes ") + ", ".join(
            f"{p.pid} ({p.comm})" for p in late[:3])
        raise GpusnapError(f"{who} took the GPU after gpusnap had quiesced the "
                           "container's GPU processes; nothing was dumped",
                           "checkpoint again")
    _earlier_dump_goes(image_dir, {})
    if image_dir:
        gpu_manifest.write(gpu_manifest.Manifest.from_dict(first["manifest"]), image_dir)
    journal.record("gpu-manifest-written", init_pid=init_pid, pids=first.get("pids", []),
                   quiesced="before the client's pause")
    return True


def _read_ahead(criu_pid: int, guardian: socket.socket, push: dict,
                runs: dict[int, list[tuple[int, int]]]) -> None:
    """Read each process's ``runs`` into the push's folder and take them out of
    it, so CRIU dumps the rest only (dump_ahead.py). The guardian gets the files
    before anything is taken. Any failure before that leaves CRIU to dump
    everything, as without this step; a process whose memory could not be put
    back fails the dump (AheadError)."""
    # A read-ahead only: not every step's start-up
    from gpusnap.pages import dump_ahead
    from gpusnap.pages.remote_syscall import RemoteSyscallError, supported

    if not supported():
        return
    started, aside = time.monotonic(), Path(push["aside"])
    donors = [str(p) for p in push.get("reuse") or []]  # round 1's, kept (pages/kept_pages.py)
    tasks = []
    try:
        for pid, found in runs.items():
            task = dump_ahead.take(pid, ns_pid(pid), found, aside, notes=True, donors=donors)
            if task is not None:
                tasks.append(task)
        if tasks:
            dump_ahead.hand_over(guardian, tasks)
    except (OSError, ValueError) as exc:
        for task in tasks:
            Path(task.path).unlink(missing_ok=True)
        journal.record("pages-read-ahead-skipped", error=str(exc))
        return
    read_s, taken = round(time.monotonic() - started, 3), []  # with the layouts
    dropping = time.monotonic()
    for task in tasks:
        # from the drop until the guardian writes it back, the process's memory
        # (the driver's staging among it) is in the guardian's files alone: a
        # driver restore meanwhile (doctor --fix, a failed dump's clean-up, the
        # guardian gone) would bring back zeros, so it is refused (staging.hold)
        staging.hold(task.pid, [])
        try:
            dump_ahead.drop(task)  # the push hashed it meanwhile (the read's notes)
            taken.append(task)
        except RemoteSyscallError as exc:  # its memory is back: CRIU dumps it
            staging.release(task.pid)
            Path(task.path).unlink(missing_ok=True)
            journal.record("pages-read-ahead-skipped", pid=task.pid, error=str(exc))
        except dump_ahead.AheadError as exc:
            raise GpusnapError(str(exc), "restore the container from its last checkpoint") from None
    if taken:
        write_private(step_state.ahead(criu_pid), json.dumps([t.to_dict() for t in taken]))
        journal.record("pages-read-ahead", tasks=len(taken), bytes=sum(t.bytes for t in taken),
                       reused=sum(t.reused for t in taken),
                       unchanged=sum(t.unchanged for t in taken), read_s=read_s,
                       moved_by=sorted({s for t in taken for s in t.shifts if s}),
                       layout_s=round(sum(t.layout_s for t in taken), 3),
                       threads=dump_ahead.default_threads(), drop_s=round(time.monotonic() - dropping, 3),
                       seconds=round(time.monotonic() - started, 3))


def _read_ahead_test(init_pid: int, criu_pid: int, push: dict, turn: Turn | None) -> None:
    """Tests only: a CPU container's big anonymous memory, which its test keeps
    still, read ahead as a GPU process's would be (``ahead_test_min`` bytes)."""
    from gpusnap.pages import dump_ahead  # tests only: not every step's start-up
    pids = process_tree(init_pid)
    guardian = _start_guardian(criu_pid, [], init_pid, turn, force=True)
    _read_ahead(criu_pid, guardian, push,
                {pid: dump_ahead.big_anonymous(pid, int(push["ahead_test_min"])) for pid in pids})


def post_dump(init_pid: int, image_dir: str, criu_pid: int) -> None:
    """A push asked for the memory pages out of Podman's export (pages_aside.py):
    moved beside it, a symlink left in their place. The tree is still frozen.
    Memory pre-dump read ahead goes back into the images first."""
    # this dump's own: one left for a CLI that waits for its own dump stays
    request = requests.take_for_dump(init_pid, "pages", image_dir)
    _compose_ahead(init_pid, image_dir, criu_pid, request)
    if not request:
        return
    from gpusnap.pages import pages_aside  # a push's post-dump only: not every step's start-up
    images, aside = Path(request["images"]), Path(request["aside"])
    if not os.path.samefile(image_dir, images):
        raise OSError(f"CRIU dumps into {image_dir}, the request names {images}")
    files, size = pages_aside.set_aside(images, aside)
    journal.record("pages-aside", init_pid=init_pid, aside=str(aside), files=files, bytes=size)


def _compose_ahead(init_pid: int, image_dir: str, criu_pid: int, request: dict) -> None:
    """The runs pre-dump read ahead back into CRIU's images (dump_ahead.compose).
    AheadError, whatever went wrong: without them the images lack memory, so
    the dump must fail (CRIU then resumes the tree; the guardian puts the
    memory back)."""
    state = step_state.ahead(criu_pid)
    if not state.exists():
        return
    from gpusnap.pages import dump_ahead  # a read-ahead only: not every step's start-up
    started = time.monotonic()
    try:
        tasks = [dump_ahead.Task.from_dict(d) for d in json.loads(state.read_text())]
        if not request:
            raise dump_ahead.AheadError("the push's request is gone")
        images, aside = Path(request["images"]), Path(request["aside"])
        if not os.path.samefile(image_dir, images):
            raise dump_ahead.AheadError(f"CRIU dumps into {image_dir}, the request names {images}")
        if request.get("fault") == "compose":  # tests: what a failure here leaves
            raise dump_ahead.AheadError("composing the images failed (injected by a test)")
        ways = [dump_ahead.compose(images, aside, task) for task in tasks]
    except dump_ahead.AheadError:
        raise
    except Exception as exc:
        raise dump_ahead.AheadError(f"the memory read ahead could not be put back into "
                                    f"CRIU's images ({exc})") from None
    finally:
        state.unlink(missing_ok=True)
    journal.record("pages-composed", init_pid=init_pid, tasks=len(tasks), how=ways,
                   seconds=round(time.monotonic() - started, 3))


def _guardian_or_give_back(driver, criu_pid: int, pids: list[int], init_pid: int,
                          turn: Turn | None) -> socket.socket | None:
    """_start_guardian of the processes just quiesced; where it cannot start
    (OSError: no memory, no process slot), they are given back their GPUs here
    before the OSError goes on: CRIU stops the dump, and no one else would."""
    try:
        return _start_guardian(criu_pid, pids, init_pid, turn)
    except OSError:
        try:
            resume(driver, pids)
        except (QuiesceError, RuntimeError) as exc:  # the OSError stays the line
            journal.record("resume-failed", init_pid=init_pid, pids=pids, error=str(exc))
        raise


def _start_guardian(criu_pid: int, pids: list[int], init_pid: int, turn: Turn | None,
                    force: bool = False) -> socket.socket | None:
    """The guardian of ``pids``, holding ``turn`` until it has given their GPUs
    back; the socket it reads what pre-dump read ahead from."""
    if not pids and not force:
        return None
    held = ["--turn-fd", str(turn.fd)] if turn is not None else []
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    with theirs:
        subprocess.Popen([sys.executable, "-m", "gpusnap.action.guardian", str(criu_pid),
                          *map(str, pids), "--init", str(init_pid), *held],
                         stdin=theirs.fileno(), stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, start_new_session=True, close_fds=True,
                         pass_fds=(turn.fd,) if turn is not None else ())
    if turn is not None:
        turn.hand_over()
    return ours
