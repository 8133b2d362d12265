"""State of background uploads (`gpusnap migrate|push CTR REF --detach`).

One JSON file per upload, ``<state dir>/uploads/<id>.json``, written
atomically by the background process as it goes (checkpointing, uploading,
done or failed) and read by `gpusnap status`. A process killed outright
writes nothing more: a file that says it is still working, whose process is
gone, is reported as failed, with the export the push kept.
"""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from pathlib import Path

from gpusnap import journal
from gpusnap.errors import GpusnapError
from gpusnap.ops.push_source import kept_error
from gpusnap.private import write_private

RUNNING = ("checkpointing", "uploading")
PRUNE_AFTER_S = 7 * 86400
_WRITE_EVERY_S = 0.5
# A state file with no process after this long: the command that made it died
# before starting one (its foreground marks a process that failed to start itself).
_START_S = 60  # progress: the callbacks come per chunk, from several threads


def uploads_dir() -> Path:
    return journal.state_subdir("uploads")


def state_path(upload_id: str) -> Path:
    return uploads_dir() / f"{upload_id}.json"


def log_path(state: Path) -> Path:
    """The background process's stdout and stderr, beside its state file."""
    return state.with_suffix(".log")


def new_id() -> str:
    return uuid.uuid4().hex[:12]


def create(command: str, container: str, reference: str, leave_running: bool) -> Path:
    """The state file of an upload about to start (no process yet): written
    before the process starts, so that `started` counts from the command."""
    upload_id = new_id()
    path = state_path(upload_id)
    write(path, {"id": upload_id, "pid": None, "command": command, "container": container,
                 "reference": reference, "leave_running": leave_running,
                 "started": round(time.time(), 3), "phase": "checkpointing", "bytes_done": 0,
                 "bytes_total": None, "checkpointed_after_s": None, "gpu_free_after_s": None,
                 "pushed_after_s": None, "export": None, "result": None, "error": None,
                 "hint": None, "log": str(log_path(path))})
    return path


def write(path: Path, state: dict) -> None:
    """Atomically (tmp + rename): a reader sees the old state or the new one, never half."""
    write_private(path, json.dumps(state, sort_keys=True, default=str))


def read(path: Path) -> dict | None:
    """The state as last written (None: no such file, or not one of ours)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and "id" in data else None


def alive(pid: int | None, state: Path) -> bool:
    """The background process of ``state`` still runs: that pid, with that
    state file on its command line (a reused pid, or a zombie, is not it)."""
    if not pid:
        return False
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return str(state).encode() in cmdline


def effective(state: dict, path: Path) -> dict:
    """``state`` as `gpusnap status` reports it: one still working whose
    process is gone failed, and what is kept says how to go on."""
    if state.get("phase") not in RUNNING or alive(state.get("pid"), path):
        return state
    if state.get("pid") is None and time.time() - float(state.get("started") or 0) < _START_S:
        return state  # the foreground is starting its process
    return {**state, "phase": "failed", **killed(state)}


def killed(state: dict) -> dict:
    """error and hint of an upload whose process was killed: the words of a
    push that failed after its checkpoint (ops.push_source.kept_error)."""
    ctr, export, ref = state.get("container"), state.get("export"), state.get("reference")
    if export is None:  # killed before the dump was complete
        return {"error": f"the upload was killed before {ctr}'s checkpoint was complete",
                "hint": f"`podman ps -a` shows what became of {ctr}; `gpusnap doctor` lists "
                        "what was left half done"}
    if state.get("leave_running"):
        return {"error": f"the upload was killed; {ctr} was left running",
                "hint": f"push it again (chunks already sent are skipped); `gpusnap doctor "
                        f"--fix` removes the export it left, {export}"}

    if not Path(export).exists():  # pushed (then dropped), or removed since
        return {"error": f"the upload was killed after {ctr}'s checkpoint; its export "
                         f"{export} is gone: pushed, or removed since",
                "hint": f"`gpusnap inspect {ref}` shows whether the registry has it; `podman "
                        f"ps -a` what became of {ctr}"}
    exc = kept_error(GpusnapError("the upload was killed"), ctr, f"in {export}", export,
                     state.get("restore_back") or f"`podman rm {ctr}; gpusnap restore {export}`")
    # the push's own retry (reference, trust and registry flags), recorded at the dump
    return {"error": exc.message,
            "hint": exc.with_push(state.get("push_again") or f"gpusnap push {export} {ref}").hint}


def all_states(prune_after_s: float = PRUNE_AFTER_S) -> list[dict]:
    """Every upload (its effective state, with ``state_file``), oldest first.
    Finished ones older than ``prune_after_s`` are removed, except a failed
    one whose export is still there (all that is left of its container)."""
    out = []
    now = time.time()
    for path in sorted(uploads_dir().glob("*.json")):
        state = read(path)
        if state is None:
            continue
        state = {**effective(state, path), "state_file": str(path)}
        old = now - float(state.get("started") or now) > prune_after_s
        export = state.get("export")
        if old and state["phase"] not in RUNNING and \
                not (state["phase"] == "failed" and export and Path(export).exists()):
            path.unlink(missing_ok=True)
            log_path(path).unlink(missing_ok=True)
            continue
        out.append(state)
    return sorted(out, key=lambda s: s.get("started") or 0)


def find(upload_id: str) -> dict | None:
    path = state_path(upload_id)
    state = read(path) if "/" not in upload_id else None
    return {**effective(state, path), "state_file": str(path)} if state else None


def live_work_dirs() -> set[Path]:
    """The push folders of uploads still running: not litter, whatever
    their files' ages (doctor --fix)."""
    found = set()
    for path in uploads_dir().glob("*.json"):
        state = read(path)
        if state and state.get("phase") in RUNNING and state.get("export") \
                and alive(state.get("pid"), path):
            found.add(Path(state["export"]).parent)
    return found


def quiesced_at(init_pid: int, since: float) -> float | None:
    """When the GPU was free: the CRIU action script journals it (`quiesced`,
    ``at``) for a container with CUDA processes; None for one without."""
    for event in reversed(journal.read(200)):
        at = event.get("at")
        if event.get("event") == "quiesced" and str(event.get("init_pid")) == str(init_pid) \
                and isinstance(at, (int, float)) and at >= since - 1:
            return float(at)
    return None


class Tracker:
    """What the background process writes into its state file as the push goes."""

    def __init__(self, path: Path) -> None:
        state = read(path)
        if state is None:
            raise FileNotFoundError(path)
        self.path, self.state = path, state
        self._lock = threading.Lock()
        self._written = 0.0
        self._update(pid=os.getpid())

    def _update(self, force: bool = True, **fields) -> None:
        with self._lock:
            self.state.update(fields)
            now = time.monotonic()
            if not force and now - self._written < _WRITE_EVERY_S:
                return
            self._written = now
            try:
                write(self.path, self.state)
            except OSError:
                pass  # a full /run must not fail the push itself

    def _journal(self) -> None:
        """The journal's line for each phase: what the host did, after the state file is gone."""
        journal.record("background-upload", id=self.state["id"], phase=self.state["phase"],
                       container=self.state.get("container"),
                       reference=self.state.get("reference"), export=self.state.get("export"),
                       error=self.state.get("error"))

    def _since_start(self, at: float | None = None) -> float:
        return round((at or time.time()) - float(self.state["started"]), 3)

    def checkpointed(self, facts: dict) -> None:
        """The dump is complete on local storage (push's on_checkpointed)."""
        gpu_free = quiesced_at(facts.get("init_pid"), float(self.state["started"]))
        self._update(phase="uploading", export=facts.get("export"),
                     push_again=facts.get("again"), restore_back=facts.get("back"),
                     checkpointed_after_s=self._since_start(),
                     gpu_free_after_s=self._since_start(gpu_free) if gpu_free else None,
                     bytes_total=facts.get("bytes") or self.state.get("bytes_total"))
        self._journal()

    def total(self, n: int) -> None:
        if not self.state.get("bytes_total"):
            self._update(bytes_total=n)

    def advance(self, raw: int, network: int = 0) -> None:
        self._update(force=False, bytes_done=int(self.state.get("bytes_done") or 0) + raw)

    def done(self, result: dict) -> None:
        # In the unit progress counted and `--detach` announced (the staged
        # archive, tar headers in): a size that changed at the end would read
        # as a different checkpoint. The files' own size stays in the result.
        total = self.state.get("bytes_total") or result.get("bytes") or self.state.get("bytes_done")
        self._update(phase="done", pushed_after_s=self._since_start(), result=result,
                     bytes_done=total, bytes_total=total)
        self._journal()

    def failed(self, error: str, hint: str | None) -> None:
        self._update(phase="failed", error=error, hint=hint)
        self._journal()
