"""gpusnap restore"""

from __future__ import annotations

from pathlib import Path

import click

from gpusnap.cli.output import console, emit, handle_errors, json_option, step
from gpusnap.cli.registry_options import registry_options, transfer_progress
from gpusnap.oci import reference
from gpusnap.ops import restore as ops
from gpusnap.runtime import podman


def _human(r: dict) -> None:
    c = r["container"]
    console.print(f"[bold green]Restored[/] {c['name']} ({c['id'][:12]}) in {r['seconds']:.2f} s, "
                  f"{c['status']}")
    for p in r["gpu_processes"]:
        console.print(f"  GPU process {p['pid']} ({p['comm']}): {p['state']}")


@click.command("restore")
@click.argument("source")
@click.option("-n", "--name", help="Name of the restored container (archives only).")
@click.option("--keep", is_flag=True, help="Keep the checkpoint files after restoring.")
@click.option("--tcp-established", is_flag=True, help="Restore established TCP connections.")
@registry_options
@json_option
@handle_errors
def restore_cmd(source: str, name: str | None, keep: bool, tcp_established: bool,
                registry, as_json: bool) -> None:
    """Restore a container from SOURCE: an exported archive, a checkpointed container,
    or a registry reference (pulled first, see `gpusnap pull`)."""
    if reference.try_parse(source) and not Path(source).exists() and not podman.exists(source):
        from gpusnap.ops import pull  # registry code: imported only when used

        with transfer_progress(as_json, f"Pulling {source}", verb="fetched") as bar:
            result = pull.restore(source, name, keep, tcp_established, registry(),
                                  progress=bar.advance, total=bar.total)
        emit(as_json, result, _human)
        return
    with step(f"Restoring {source}...", as_json):
        result = ops.run(source, name, keep, tcp_established)
    emit(as_json, result, _human)


COMMANDS = [restore_cmd]
