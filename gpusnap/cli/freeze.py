"""gpusnap freeze / thaw"""

from __future__ import annotations

import click

from gpusnap.cli.output import console, emit, handle_errors, human_bytes, json_option, step
from gpusnap.gpu.quiesce import DEFAULT_LOCK_TIMEOUT_MS
from gpusnap.ops import freeze as ops


def _human(verb: str):
    def show(r: dict) -> None:
        console.print(f"[bold green]{verb}[/] {r['container']}: pids {r['pids']} {r['timing']}")
        for uuid, used in r["gpu_memory_used_after"].items():
            console.print(f"  {uuid}: {human_bytes(used)} in use now")
    return show


@click.command("freeze")
@click.argument("container")
@click.option("--timeout", "timeout_ms", default=DEFAULT_LOCK_TIMEOUT_MS, show_default=True,
              help="Milliseconds to wait for running GPU work before giving up.")
@json_option
@handle_errors
def freeze_cmd(container: str, timeout_ms: int, as_json: bool) -> None:
    """Release CONTAINER's GPU memory in place (to host memory); its processes keep their pids."""
    with step(f"Freezing GPU state of {container}...", as_json):
        result = ops.freeze(container, timeout_ms)
    emit(as_json, result, _human("Frozen"))


@click.command("thaw")
@click.argument("container")
@json_option
@handle_errors
def thaw_cmd(container: str, as_json: bool) -> None:
    """Bring a frozen CONTAINER's GPU memory back and let it run on its GPU again."""
    with step(f"Thawing GPU state of {container}...", as_json):
        result = ops.thaw(container)
    emit(as_json, result, _human("Thawed"))


COMMANDS = [freeze_cmd, thaw_cmd]
