"""gpusnap status: background uploads (`migrate|push CTR REF --detach`)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import click

from gpusnap.cli.output import console, emit, gpu_back_note, handle_errors, human_bytes, json_option
from gpusnap.errors import GpusnapError
from gpusnap.ops import uploads

_WAIT_EVERY_S = 0.5


def _percent(s: dict) -> str:
    if s["phase"] == "done":
        return "100%"
    total, done = s.get("bytes_total"), s.get("bytes_done") or 0
    return f"{min(99, int(100 * done / total))}%" if total else "-"


def _age(started: float | None) -> str:
    seconds = int(time.time() - (started or time.time()))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def _table(r: dict) -> None:
    if not r["uploads"]:
        console.print("No background uploads (`gpusnap migrate|push CTR REF --detach` starts one).")
        return
    from rich.table import Table  # start-up: rich only for the table (not --json)

    table = Table(box=None, pad_edge=False)
    for column in ("ID", "CONTAINER", "REFERENCE", "PHASE", "PROGRESS", "AGE"):
        # names and references wrap, rather than the ID a user copies
        table.add_column(column, overflow="fold", no_wrap=column not in ("CONTAINER", "REFERENCE"))
    for s in r["uploads"]:
        table.add_row(s["id"], s.get("container") or "-", s.get("reference") or "-", s["phase"],
                      _percent(s), _age(s.get("started")))
    console.print(table)


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} s"


def _details(s: dict) -> None:
    console.print(f"[bold]{s['id']}[/]: {s['command']} {s['container']} {s['reference']}: "
                  f"[bold]{s['phase']}[/]")
    console.print(f"  progress: {_percent(s)} ({human_bytes(s.get('bytes_done'))} of "
                  f"{human_bytes(s.get('bytes_total'))})")
    console.print(f"  checkpointed after {_seconds(s.get('checkpointed_after_s'))}; GPU free after "
                  f"{_seconds(s.get('gpu_free_after_s'))}; pushed after "
                  f"{_seconds(s.get('pushed_after_s'))}")
    # a failed push of a container left running removes its export: not named then
    if s.get("export") and s["phase"] != "done" and Path(s["export"]).exists():
        console.print(f"  local checkpoint: {s['export']}")
    result = s.get("result") or {}
    if result.get("digest"):
        console.print(f"  digest: {result['digest']}")
    if result.get("restore_command"):
        where = "on the target host" if s["command"] == "migrate" else "restore with"
        console.print(f"  {where}: {result['restore_command']}")
    gpu_back_note(result)  # pushed, its container left running: its GPUs not back (yet)
    if s["phase"] == "failed":
        console.print(f"  [bold red]Error:[/] {s.get('error')}")
        if s.get("hint"):
            console.print(f"    [dim]->[/] {s['hint']}")
    console.print(f"  log: {s.get('log')}")


def _one(upload_id: str) -> dict:
    state = uploads.find(upload_id)
    if state is None:
        raise GpusnapError(f"no background upload {upload_id}",
                           "`gpusnap status` lists them")
    return state


@click.command("status")
@click.argument("upload_id", metavar="[ID]", required=False)
@click.option("--wait", is_flag=True, help="Wait until the upload is done or failed "
              "(exit status 1 when it failed, or its container did not get its GPUs back).")
@json_option
@handle_errors
def status_cmd(upload_id: str | None, wait: bool, as_json: bool) -> None:
    """Background uploads (`gpusnap migrate|push CTR REF --detach`): all of them,
    or one ID in detail. An upload whose process was killed is failed, and says
    where its container's checkpoint is kept."""
    if upload_id is None:
        if wait:
            raise GpusnapError("--wait needs an upload ID", "`gpusnap status` lists them")
        emit(as_json, {"uploads": uploads.all_states()}, _table)
        return
    state = _one(upload_id)
    while wait and state["phase"] in uploads.RUNNING:
        time.sleep(_WAIT_EVERY_S)
        state = _one(upload_id)
    if wait and state["phase"] == "failed" and not as_json:
        raise GpusnapError(state.get("error") or "the upload failed", state.get("hint"))
    emit(as_json, state, _details)
    if wait and (state["phase"] == "failed" or (state.get("result") or {}).get("gpu_back") is False):
        sys.exit(1)


COMMANDS = [status_cmd]
