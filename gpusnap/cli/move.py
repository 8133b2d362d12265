"""gpusnap move"""

from __future__ import annotations

import click

from gpusnap.cli.output import console, emit, handle_errors, json_option, step
from gpusnap.gpu.quiesce import DEFAULT_LOCK_TIMEOUT_MS
from gpusnap.ops import move as ops


def _human(r: dict) -> None:
    verb = "Would move" if r.get("dry_run") else "Moved"
    took = "" if r.get("dry_run") else f" in {r['seconds']:.2f} s (pids kept: {r['pids']})"
    console.print(f"[bold green]{verb}[/] {r['container']}{took}")
    for line in r["moves"]:
        console.print(f"  {line}")


@click.command("move")
@click.argument("container")
@click.option("--gpu", "index", type=int, help="This host's GPU (index) for a one-GPU container.")
@click.option("--gpu-map", metavar="SRC=DST[,...]", help="Where each GPU goes (indices or UUIDs).")
@click.option("--timeout", "timeout_ms", default=DEFAULT_LOCK_TIMEOUT_MS, show_default=True,
              help="Milliseconds to wait for running GPU work before giving up.")
@click.option("--dry-run", is_flag=True, help="Check and print the plan; change nothing.")
@json_option
@handle_errors
def move_cmd(container: str, index: int | None, gpu_map: str | None, timeout_ms: int,
             dry_run: bool, as_json: bool) -> None:
    """Move a running CONTAINER's GPU work onto other GPUs of this host, live.

    Its CUDA processes keep their pids: GPU memory goes to host memory, the
    container gets the new GPU's device node and cgroup rule (the old ones
    are taken away), and the driver restores the memory onto the new GPU.
    """
    with step(f"{'Planning' if dry_run else 'Moving'} {container}...", as_json):
        result = ops.move(container, index, gpu_map, timeout_ms, dry_run)
    emit(as_json, result, _human)


COMMANDS = [move_cmd]
