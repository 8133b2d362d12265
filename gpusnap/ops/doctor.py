"""Host checks for `gpusnap doctor`: each says what is wrong and what to do."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shutil
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path

from gpusnap import journal
from gpusnap.criu.runtimes import runs_action_script, why_not
from gpusnap.criu.version import (criu_version, cuda_plugin_path, inet_sockets_problem,
                                  is_supported)
from gpusnap.gpu.checks import MIN_CHECKPOINT_DRIVER, driver_major
from gpusnap.criu.freezer import is_frozen
from gpusnap.gpu.cuda import ProcessState
from gpusnap.gpu.inventory import read_inventory
from gpusnap.gpu.quiesce import QuiesceError, refused_for_good, resume, states
from gpusnap.gpu import turn
from gpusnap.ops import frozen, leftovers, moving
from gpusnap.pages import prepared_pages
from gpusnap.ops.gpu_state import load_driver
from gpusnap.procs import PROC, gpu_use, process_tree, stopped
from gpusnap.errors import GpusnapError
from gpusnap.runtime import kept_checkpoint, podman
from gpusnap.runtime.storage import storage_root
from gpusnap.pages import memory
from gpusnap.waits import Bound

HOOK_FILES = (Path("/etc/containers/oci/hooks.d/gpusnap-prestart.json"),
              Path("/usr/share/containers/oci/hooks.d/gpusnap-prestart.json"))
CRIU_CONFIG = Path("/etc/criu/runc.conf")
REMAP_DRIVER = 580


LEVELS = ("ok", "warning", "error")
# What a host without an NVIDIA driver cannot do (containers without GPUs work as without gpusnap).
GPU_FEATURES = ("GPU memory in checkpoints, restore onto GPUs, `gpusnap move`, "
                "`gpusnap freeze`/`thaw`")


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    fix: str = ""
    required: bool = True  # failing it is an error; else a warning

    @property
    def level(self) -> str:
        return "ok" if self.ok else "error" if self.required else "warning"


def _criu_checks() -> list[Check]:
    version = criu_version()
    checks = [Check("criu", is_supported(version), f"CRIU {version}" if version else "not found",
                    "" if is_supported(version) else "run `make deps` to install CRIU 4 privately")]
    if version:
        try:
            res = subprocess.run(["criu", "check"], capture_output=True, text=True,
                                 timeout=Bound.of("PODMAN").seconds)
            ok, out = res.returncode == 0, (res.stdout + res.stderr).strip()
        except subprocess.TimeoutExpired:
            ok, out = False, f"`criu check` did not finish within {Bound.of('PODMAN').seconds:.0f} s"
        detail = "Looks good." if "Looks good" in out else (out.splitlines()[-1:] or [""])[0]
        checks.append(Check("criu check", ok, detail, "" if ok else
                            "this kernel lacks features CRIU needs; see `criu check --all`"))
        sockets = inet_sockets_problem(version)
        checks.append(Check("criu inet sockets", sockets is None,
                            sockets or "TCP and UDP sockets can be dumped",
                            "run `make deps`: it installs CRIU 4.2 privately" if sockets else "",
                            required=False))
    plugin = cuda_plugin_path()
    checks.append(Check("criu cuda_plugin", True,
                        f"installed at {plugin}: gpusnap leaves quiesce to it" if plugin
                        else "not installed: gpusnap quiesces GPUs itself", required=False))
    return checks


def _runtime_check() -> Check:
    """The OCI runtime Podman uses (runc where it says none): gpusnap needs CRIU to
    get its action script there (runc always; crun >= 1.26 with libcriu >= 4.2)."""
    name = (podman.default_runtime() if shutil.which("podman") else "") or "runc"
    path = shutil.which(name, path=f"{os.environ.get('PATH', '')}:/usr/local/sbin:/usr/sbin:/sbin")
    if path is None:
        return Check("oci runtime", False, f"{name}: not found",
                     f"install {name} (or runc), as Podman's configuration names it")
    if runs_action_script(name):
        return Check("oci runtime", True, f"{name} ({path}): CRIU gets gpusnap's action script")
    # a warning: containers without CUDA processes still checkpoint as Podman would
    return Check("oci runtime", False, f"{name} ({path}): {why_not(name)}; CUDA containers "
                 "are refused at checkpoint",
                 "install runc and set runtime = \"runc\" in containers.conf, or crun >= 1.26 "
                 "with libcriu >= 4.2", required=False)


def _integration_checks() -> list[Check]:
    checks = [_runtime_check()]
    podman_bin = shutil.which("podman")
    checks.append(Check("podman", podman_bin is not None, podman_bin or "not found",
                        "" if podman_bin else "install podman", required=False))
    hook = next((h for h in HOOK_FILES if h.exists()), None)
    hook_ok, detail = False, "not installed"
    if hook is not None:
        try:
            target = json.loads(hook.read_text())["hook"]["path"]
            hook_ok = Path(target).exists()
            detail = f"{hook} -> {target}" + ("" if hook_ok else " (missing)")
        except (ValueError, KeyError) as exc:
            detail = f"{hook} is not a valid hook file ({exc})"
    checks.append(Check("oci hook", hook_ok, detail, "" if hook_ok else "run `make install`"))
    conf = CRIU_CONFIG.read_text() if CRIU_CONFIG.exists() else ""
    action = next((l.split(None, 1)[1] for l in conf.splitlines()
                   if l.strip().startswith("action-script")), None)
    action_ok = action is not None and Path(action.strip()).exists()
    checks.append(Check("criu action script", action_ok,
                        f"{CRIU_CONFIG}: {action}" if action else f"not set in {CRIU_CONFIG}",
                        "" if action_ok else "run `make install`"))
    return checks


def _gpu_checks() -> list[Check]:
    inv = read_inventory()
    if inv.error:  # a warning: CPU containers work, the GPU features do not
        return [Check("nvidia driver", False, f"{inv.error}; off on this host: {GPU_FEATURES}",
                      "install the NVIDIA driver (r570+) on a GPU host to use them",
                      required=False)]
    major = driver_major(inv.driver_version)
    return [
        Check("nvidia driver", major >= MIN_CHECKPOINT_DRIVER,
              f"{inv.driver_version} (CUDA {inv.cuda_driver_version}), {len(inv.gpus)} GPU(s)",
              "" if major >= MIN_CHECKPOINT_DRIVER else
              f"checkpoint needs driver r{MIN_CHECKPOINT_DRIVER}+"),
        Check("gpu remap", major >= REMAP_DRIVER,
              "restore onto other GPUs available" if major >= REMAP_DRIVER else
              f"driver r{REMAP_DRIVER}+ needed to restore onto other GPUs", required=False),
    ]


def _ours(pid: int) -> bool:
    """gpusnap's own agent and guardians (`python -m gpusnap.action.…`): they load
    libcuda to call the checkpoint API on other processes and hold no GPU state
    of their own, so there is nothing to ask the driver about them."""
    try:
        argv = (PROC / str(pid) / "cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return any(a.startswith(b"gpusnap.action.") for a in argv)


def stuck_processes() -> list[dict]:
    """CUDA processes left LOCKED or CHECKPOINTED while nothing is dumping them.
    Stopped ones are not asked about (the driver would wait until they run), nor
    frozen ones (a dump in progress, or a paused container: not left by one)."""
    candidates = []
    # `gpusnap freeze`'s, until `gpusnap thaw`; a move's, until its own undo (which
    # puts the old nodes back first: resumed before it, they would not reach their GPU)
    on_purpose = {**frozen.frozen(), **moving.moving()}
    for entry in PROC.iterdir():
        if entry.name.isdigit():
            use = gpu_use(int(entry.name), PROC)
            if use is not None and use.maps_libcuda and not _ours(use.pid) \
                    and not stopped(use.pid) and not is_frozen(use.pid) \
                    and use.pid not in on_purpose:
                candidates.append(use)
    if not candidates:
        return []
    driver = load_driver()
    if driver is None:
        return []
    found = states(driver, [c.pid for c in candidates])
    return [{"pid": c.pid, "comm": c.comm, "state": found[c.pid].name} for c in candidates
            if found.get(c.pid, ProcessState.RUNNING) != ProcessState.RUNNING]


def _gpu_processes_check(fix: bool) -> tuple[Check, list[dict], list[int]]:
    """CUDA processes an unfinished checkpoint left off their GPUs; ``fix``
    gives them back, each container's under its turn (gpu/turn.py). Those whose
    turn is held are in the hands of gpusnap's guardian or restore, which bring
    them back themselves: two resumes of one process at once fail each other,
    and a restore resumes onto the GPUs of its plan. Also returns the stuck
    processes and the pids fixed."""
    stuck = stuck_processes()
    fixed: list[int] = []
    busy: dict[int, tuple[int | None, str, list[int]]] = {}
    refused: dict[int, str] = {}  # the driver's words, where --fix could not resume one
    driver = load_driver() if stuck and fix else None
    by_init: dict[int, list[int]] = {}
    for s in stuck:
        by_init.setdefault(turn.key_for(s["pid"]), []).append(s["pid"])
    for init, pids in sorted(by_init.items()):
        try:
            held = turn.try_take(init, "doctor --fix" if fix else "doctor")
        except OSError:  # a state folder this user cannot write: nothing to fix from here
            continue
        if held is None:
            busy[init] = (*turn.holder(init), pids)
            if fix:  # what --fix chose not to touch, and whose they were, for the record
                journal.record("doctor-left", init_pid=init, pids=pids, holder=busy[init][0],
                               role=busy[init][1])
            continue
        with held:
            if driver is None:
                continue
            try:
                fixed += resume(driver, pids)
            except QuiesceError as exc:  # said below as not fixed; the others go on
                journal.record("doctor-resume-failed", pids=pids, error=str(exc))
                refused.update({pid: str(err) for pid, err in exc.failures.items()})
    detail = "none held by an unfinished checkpoint" if not stuck else \
        ", ".join(f"pid {s['pid']} ({s['comm']}) {s['state']}" for s in stuck)
    held_on_purpose = sorted(set(frozen.frozen().values()))
    if held_on_purpose:  # not stuck: `gpusnap thaw` gives them their GPU back
        detail += "; frozen by `gpusnap freeze`: " + ", ".join(
            f"{name} (`gpusnap thaw {name}`)" for name in held_on_purpose)
    if busy:
        detail += "; left to gpusnap's " + ", ".join(
            f"{role or 'step'} (pid {who or '?'}), at work on pid {', '.join(map(str, pids))}"
            for who, role, pids in busy.values())
    at_work = {pid for *_, pids in busy.values() for pid in pids}
    left = [s for s in stuck if s["pid"] not in at_work and s["pid"] not in fixed]
    hint = "run `gpusnap doctor --fix` to restore and unlock them" \
        if left else ""
    if refused:
        detail += "; the driver refused to bring back " + "; ".join(
            f"pid {pid}: {err}" for pid, err in sorted(refused.items()))
    # driver 580 refuses for good a process whose restore it once refused for memory
    if any(refused_for_good(err) for err in refused.values()):
        hint = ("their GPU state cannot come back: where gpusnap kept their checkpoint "
                "(\"restores off the gpu\" below), `podman stop -t 0 NAME`, then `gpusnap "
                "restore NAME`; else end their container (`podman rm -f`, or its containerd task) "
                "and restore it again from its checkpoint, where it has one")
    return Check("gpu processes", not left, detail, hint), stuck, fixed


def _moves_check(fix: bool) -> tuple[Check, list[dict]]:
    """Moves cut off (`gpusnap move` killed between its quiesce and its end): the
    processes are off their GPUs and the container's nodes and rule may name the
    new ones. ``fix`` undoes each as the move would have (ops/moving.py), under
    its container's turn: a move still at work holds it, and is left alone."""
    found = moving.under_way()
    driver = load_driver() if found and fix else None
    said: list[dict] = []
    for move in found:
        said.append({"container": move.container, "init_pid": move.init_pid,
                     "pids": move.running(), "phase": move.phase,
                     "state": _undo_move(move, driver, fix)})
    left = [m for m in said if m["state"] not in ("undone", "at work")]
    detail = "; ".join(f"{m['container']} (pids {', '.join(map(str, m['pids'])) or 'none'}): "
                       f"{m['state']}" for m in said) or "none cut off"
    hint = "run `gpusnap doctor --fix` to put back their old GPU nodes and device rule and " \
        "resume them on their old GPUs" if left else ""
    return Check("interrupted moves", not left, detail, hint), said


def _undo_move(move: moving.Move, driver, fix: bool) -> str:
    """What became of one cut move, in words: undone, at work, cut off, or why not undone."""
    try:
        held = turn.try_take(move.init_pid, "doctor --fix" if fix else "doctor")
    except OSError:  # a state folder this user cannot write: nothing to fix from here
        return f"cut off {move.where()}"
    if held is None:
        return "at work"  # the move itself, or another verb under its turn
    with held:
        if driver is None:
            return f"cut off {move.where()}" + ("; the NVIDIA driver is not available" if fix else "")
        try:
            moving.undo_recorded(move, driver)
        except Exception as exc:  # noqa: BLE001 -- said in the check; the record stays
            journal.record("doctor-move-undo-failed", container=move.container, error=str(exc))
            return f"not undone: {exc}"
    journal.record("doctor-move-undone", container=move.container, pids=move.running())
    return "undone"


def _kept_aside_check(graph_root: Path | None, stuck: list[dict], fix: bool) -> Check:
    """Local checkpoints a restore kept where its GPU state did not come back
    (runtime/kept_checkpoint.py): the way back for a container whose processes
    the driver refuses for good. One whose container runs again (its processes
    back on the GPU since, or started afresh) restores nothing newer: ``fix``
    drops it."""
    stuck_pids = {s["pid"] for s in stuck}
    needed, stale, dropped = [], [], []
    for k in kept_checkpoint.found(graph_root) if graph_root else []:
        ctr = None
        with contextlib.suppress(GpusnapError):
            ctr = podman.find(k["container"])
        name = ctr.name if ctr else k["container"][:12]
        if ctr and ctr.running and not (kept_checkpoint.left_by(k, ctr.pid)
                                        and stuck_pids & set(process_tree(ctr.pid))):
            if fix and kept_checkpoint.drop(Path(k["path"]).parent, "doctor --fix: it runs again"):
                dropped.append(name)
            else:
                stale.append(f"{name}: runs on its GPU again ({k['path']})")
        else:
            needed.append(f"{name}: {k['why']} (its checkpoint kept in {k['path']})")
    detail = "; ".join(needed + stale + [f"dropped {n}'s, which runs again" for n in dropped])
    hint = "; ".join(filter(None, [
        "`podman stop -t 0 NAME`, then `gpusnap restore NAME` restores it from there"
        if needed else "", "`gpusnap doctor --fix` drops those that run again" if stale else ""]))
    return Check("restores off the gpu", not needed and not stale,
                 detail or "no checkpoint kept aside", hint, required=False)


def _pages_check() -> Check:
    """Which tmpfs takes CRIU's pages in RAM (pages/memory.py): gpusnap's
    huge-page one, or /dev/shm where the kernel's tmpfs has no huge pages."""
    if memory.huge_mounted():
        return Check("pages in RAM", True, f"{memory.HUGE_ROOT}: tmpfs with huge pages",
                     required=False)
    if Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled").exists():
        return Check("pages in RAM", True, f"{memory.HUGE_ROOT}: a tmpfs with huge pages, "
                     "mounted by the first push or restore that needs it", required=False)
    return Check("pages in RAM", False, f"this kernel's tmpfs has no huge pages: "
                 f"{memory.RAM_ROOT} with 4 KiB pages (CRIU's page I/O is slower)",
                 "a kernel built with CONFIG_TRANSPARENT_HUGEPAGE", required=False)


def _prepared_check() -> Check:
    """Pages files a prefetch wrote out, or a restore kept for the next replica
    (pages/prepared_pages.py): memory or disk held on purpose, shown so that it
    is not a surprise."""
    found = prepared_pages.folders()
    if not found:
        return Check("prepared pages", True, "none (`gpusnap pull --prefetch` writes them; a "
                     "restore keeps the pages it wrote, for the next replica)", required=False)
    return Check("prepared pages", True, "; ".join(
        f"{f} ({memory.folder_bytes(f) / 1e9:.1f} GB)" for f in found) +
        ": a restore of their checkpoint links them; in RAM they give way to a push or "
        "restore that needs the memory; `rm -r` drops one", required=False)


def run(fix: bool) -> dict:
    # The processes first: `podman info` (asked below where its answer is not
    # kept, podman.host_facts) waits for every container's lock, which a restore
    # holds until its end; read after it, a restore's processes would be seen
    # only once it is over, and a stuck one resumed only then.
    # a cut move's undo first: the processes it resumes are none of the stuck ones
    moves_check, moves = _moves_check(fix)
    gpu_check, stuck, fixed = _gpu_processes_check(fix)
    checks = _criu_checks() + _integration_checks() + _gpu_checks() + [_pages_check(),
                                                                        _prepared_check()]
    checks.append(Check("kernel", True, f"{platform.release()} {platform.machine()}",
                        required=False))
    checks += [moves_check, gpu_check, _kept_aside_check(storage_root(), stuck, fix)]
    ok = all(c.ok for c in checks if c.required)
    left = leftovers.find()
    removed = leftovers.remove(left) if fix else []
    checks.append(Check("leftover files", not left or bool(removed),
                        "none from interrupted exports" if not left else
                        ("removed " if removed else "") + ", ".join(map(str, left)),
                        "" if not left or removed else "`gpusnap doctor --fix` removes them",
                        required=False))
    kept = leftovers.kept()  # the only copy of a stopped container: shown, never removed
    checks.append(Check("kept checkpoints", not kept,
                        "none from interrupted pushes" if not kept else ", ".join(
                            f"{k['export']} (container {str(k['container'])[:12]})" for k in kept),
                        "; ".join(f"{k['back']} brings {str(k['container'])[:12]} back here" +
                                  (f", {k['again']} finishes the push" if k["again"] else "")
                                  for k in kept) +
                        ("; then delete it" if kept else ""),
                        required=False))
    return {"ok": ok, "checks": [{**asdict(c), "level": c.level} for c in checks],
            "errors": sum(c.level == "error" for c in checks),
            "warnings": sum(c.level == "warning" for c in checks),
            "stuck": stuck, "fixed": fixed, "moves": moves,
            "leftovers": [str(p) for p in left], "removed": removed, "kept": kept}
