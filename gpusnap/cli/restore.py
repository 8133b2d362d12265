"""gpusnap restore"""

from __future__ import annotations

from pathlib import Path

import click

from gpusnap.cli.output import console, emit, handle_errors, json_option, step
from gpusnap.cli.registry_options import registry_options, transfer_progress
from gpusnap.oci import reference
from gpusnap.ops import restore as ops
from gpusnap.ops.gpu_plan import GPU_MAP_ENV
from gpusnap.runtime import podman


def _human_plan(r: dict) -> None:
    verb = "would move" if r["remap"] else "stay on"
    console.print(f"[bold]Dry run[/] of restoring {r['source']}: checks passed; the GPUs {verb}:"
                  if r["moves"] else f"[bold]Dry run[/] of restoring {r['source']}: checks "
                  "passed; it uses no GPU")
    for line in r["moves"]:
        console.print(f"  {line}")


def _human(r: dict) -> None:
    if r.get("dry_run"):
        _human_plan(r)
        return
    c = r["container"]
    console.print(f"[bold green]Restored[/] {c['name']} ({c['id'][:12]}) in {r['seconds']:.2f} s, "
                  f"{c['status']}")
    for g in r.get("gpus", []):
        if g["from"]["uuid"] != g["to"]["uuid"]:
            console.print(f"  GPU {g['from']['index']} of the checkpoint is GPU {g['to']['index']} "
                          f"here ({g['to']['uuid']}): {'; '.join(g['why'])}")
    for p in r["gpu_processes"]:
        console.print(f"  GPU process {p['pid']} ({p['comm']}): {p['state']}")


@click.command("restore")
@click.argument("source")
@click.option("-n", "--name", help="Name of the restored container (archives only).")
@click.option("--keep", is_flag=True, help="Keep the checkpoint files after restoring.")
@click.option("--tcp-established", is_flag=True, help="Restore established TCP connections.")
@click.option("--gpu-map", metavar="SRC=DST[,...]", envvar=GPU_MAP_ENV,
              help="Put the checkpoint's GPU SRC on this host's GPU DST (indices or UUIDs; "
                   f"also ${GPU_MAP_ENV}). Default: its own GPUs where they fit, else the "
                   "least loaded suitable ones.")
@click.option("--dry-run", is_flag=True, help="Check and print the GPU plan; change nothing.")
@registry_options
@json_option
@handle_errors
def restore_cmd(source: str, name: str | None, keep: bool, tcp_established: bool,
                gpu_map: str | None, dry_run: bool, registry, as_json: bool) -> None:
    """Restore a container from SOURCE: an exported archive, a checkpointed container,
    or a registry reference (pulled first, see `gpusnap pull`).

    The GPUs are checked before anything is touched. From an archive or a
    reference, the container may land on other GPUs of this host (same chip,
    enough free memory; driver r580+): its device nodes, cgroup rules and the
    driver's GPU UUIDs are moved with it.
    """
    if reference.try_parse(source) and not Path(source).exists() and not podman.exists(source):
        from gpusnap.ops import pull  # registry code: imported only when used

        with transfer_progress(as_json, f"Pulling {source}", verb="fetched") as bar:
            result = pull.restore(source, name, keep, tcp_established, registry(),
                                  gpu_map=gpu_map, dry_run=dry_run,
                                  progress=bar.advance, total=bar.total)
        emit(as_json, result, _human)
        return
    with step(f"{'Planning' if dry_run else 'Restoring'} {source}...", as_json):
        result = ops.run(source, name, keep, tcp_established, gpu_map=gpu_map, dry_run=dry_run)
    emit(as_json, result, _human)


COMMANDS = [restore_cmd]
