"""`gpusnap migrate|push CTR REF --detach`: the upload goes on in the background.

The command starts itself again without --detach, in its own session, with a
hidden ``--upload-state FILE`` (ops/uploads.py), and follows that file until
the checkpoint is complete on local storage: the container is stopped (or
resumed, with -R) and its GPU released. It then says how to follow the
upload (`gpusnap status ID`) and returns; the child uploads on, its output in
a log beside the state file.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import click

from gpusnap.cli.output import console, emit, human_bytes
from gpusnap.errors import GpusnapError
from gpusnap.oci.registry import RegistryOptions
from gpusnap.trust.options import TrustOptions
from gpusnap.ops import uploads
from gpusnap.ops.advice import container_state, gpusnap_command
from gpusnap.ops.container_busy import refuse_if_busy

_FOLLOW_EVERY_S = 0.1


def detach_options(fn: Callable) -> Callable:
    """-d/--detach, and the hidden option the background process gets."""
    fn = click.option("--upload-state", type=click.Path(dir_okay=False), hidden=True,
                      help="Internal: the state file of a background upload.")(fn)
    return click.option("-d", "--detach", is_flag=True,
                        help="Return once the checkpoint is on local storage (the GPU is "
                             "free) and upload in the background; `gpusnap status ID` "
                             "follows it.")(fn)


def refuse_source(source: str) -> None:
    """Only a Podman container is checkpointed here, then uploaded from its
    export: a file, a folder or containerd's has no such moment to return at.
    One another gpusnap command checkpoints is refused here too, before an
    upload record is made (the child's refusal would leave a failed one)."""
    if source.startswith("containerd://") or Path(source).exists():
        raise GpusnapError(f"--detach uploads a Podman container's checkpoint in the background; "
                           f"{source} is not a container",
                           "push it without --detach")
    refuse_if_busy(source)


def child_args(argv: list[str]) -> list[str]:
    """``argv`` without -d/--detach (also inside -dR-style clusters; -u takes a value)."""
    out: list[str] = []
    rest = False
    for token in argv:
        if rest or token == "--":
            rest = True
            out.append(token)
        elif token in ("-d", "--detach"):
            continue
        elif re.fullmatch(r"-[A-Za-z]{2,}", token):
            flags, _, value = token[1:].partition("u")
            kept = flags.replace("d", "") + ("u" + value if "u" in token[1:] else "")
            if kept:
                out.append("-" + kept)
        else:
            out.append(token)
    return out


def start(command: str, container: str, ref: str, leave_running: bool,
          registry: Callable[[], RegistryOptions], as_json: bool,
          pre_checkpoint: bool = False, trust: TrustOptions | None = None,
          image_format: str = "gpusnap") -> None:
    """Start the background upload, wait for its checkpoint, say how to follow it
    (``pre_checkpoint``: migrate -P's first round, which the target prefetches).
    What the push would refuse first (the reference, the keys, the registry's
    credentials) is refused here, before an upload record is made."""
    opts = registry()  # --password-stdin: read here, handed on through a pipe
    from gpusnap.ops.push_checks import preflight  # registry code: imported only when used

    preflight(container, ref, opts, trust, image_format)
    path = uploads.create(command, container, ref, leave_running)
    log = uploads.log_path(path)
    args = [sys.executable, "-m", "gpusnap", *child_args(sys.argv[1:]),
            "--upload-state", str(path)]
    with open(log, "ab") as out:
        child = subprocess.Popen(args, stdin=subprocess.PIPE if opts.password else
                                 subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                 start_new_session=True, close_fds=True)
    if opts.password:
        child.stdin.write(opts.password.encode() + b"\n")
        child.stdin.close()
    state = _follow(child, path, container)
    r = {"id": state["id"], "state_file": str(path), "log": str(log), "command": command,
         "container": container, "reference": ref, "phase": state["phase"],
         "export": state.get("export"), "checkpointed_after_s": state["checkpointed_after_s"],
         "gpu_free_after_s": state.get("gpu_free_after_s"),
         "bytes_total": state.get("bytes_total"),
         "container_state": container_state({"container": container}, leave_running,
                                            uploading=True),
         "status_command": f"gpusnap status {state['id']}"}
    if pre_checkpoint:
        r["prefetch_command"] = gpusnap_command(["pull", "--prefetch", ref], opts)
    elif command == "migrate":
        r["restore_command"] = gpusnap_command(["restore", ref], opts)
    emit(as_json, r, _human)


def _follow(child: subprocess.Popen, path: Path, container: str) -> dict:
    """The state once the checkpoint is complete; the child's error if it failed first."""
    try:
        while True:
            state = uploads.read(path) or {}
            if state.get("phase") in ("uploading", "done"):
                return state
            if state.get("phase") == "failed":
                raise GpusnapError(state.get("error") or "the background upload failed",
                                   state.get("hint"))
            code = child.poll()
            if code is not None and (uploads.read(path) or {}).get("phase") == state.get("phase"):
                error = f"the background upload ended (exit {code}) before {container}'s " \
                        f"checkpoint was complete: {_last_line(uploads.log_path(path))}"
                hint = f"its output is in {uploads.log_path(path)}"
                uploads.write(path, {**state, "phase": "failed", "error": error, "hint": hint})
                raise GpusnapError(error, hint)
            time.sleep(_FOLLOW_EVERY_S)
    except KeyboardInterrupt:
        upload_id = path.stem
        raise GpusnapError(f"interrupted; the checkpoint and upload {upload_id} go on in the "
                           "background", f"`gpusnap status {upload_id}` follows it",
                           exit_code=130) from None


def _last_line(log: Path) -> str:
    try:
        lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return "no output"
    return lines[-1].strip() if lines else "no output"


def _human(r: dict) -> None:
    console.print(f"[bold green]Checkpointed[/] {r['container']} in "
                  f"{r['checkpointed_after_s']:.1f} s; uploading "
                  f"{human_bytes(r['bytes_total'])} to {r['reference']} in the background")
    if r.get("gpu_free_after_s") is not None:
        console.print(f"  GPU free after {r['gpu_free_after_s']:.1f} s")
    console.print(f"  container {r['container_state']['name']}: {r['container_state']['says']}")
    console.print(f"  upload ID: {r['id']}; follow it with: {r['status_command']} [--wait]")
    if r.get("prefetch_command"):
        console.print(f"[bold]On the target host, once it says done, warm its chunk cache:[/]\n"
                      f"  {r['prefetch_command']}")
    elif r.get("restore_command"):
        console.print(f"[bold]On the target host, once it says done, run:[/]\n"
                      f"  {r['restore_command']}")


def background(path: str, run: Callable[[uploads.Tracker], dict]) -> dict:
    """The background process's push: ``run`` with a tracker of ``path``; its
    result or its error recorded there (the foreground and `status` read it)."""
    tracker = uploads.Tracker(Path(path))
    try:
        result = run(tracker)
    except GpusnapError as exc:
        tracker.failed(exc.message, exc.hint)
        raise
    except BaseException as exc:  # not one of ours: still never left "uploading"
        tracker.failed(f"the background upload failed: {exc!r}",
                       f"its output is in {uploads.log_path(Path(path))}")
        raise
    tracker.done(result)
    return result
