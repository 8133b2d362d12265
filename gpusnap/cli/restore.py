"""gpusnap restore"""

from __future__ import annotations

from pathlib import Path

import click

from gpusnap.cli import containerd
from gpusnap.cli.output import console, emit, handle_errors, json_option, step
from gpusnap.cli.registry_options import registry_options, transfer_progress
from gpusnap.cli.trust_options import trust_line, trust_options, warn_skipped
from gpusnap.oci import reference
from gpusnap.ops import restore as ops
from gpusnap.ops.gpu_plan import GPU_MAP_ENV
from gpusnap.runtime import podman
from gpusnap.trust.options import TrustOptions


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
    where = f" into containerd namespace {c['namespace']}, pid {c['pid']}," \
        if r.get("engine") == "containerd" else f" ({c['id'][:12]})"
    console.print(f"[bold green]Restored[/] {c['name']}{where} in {r['seconds']:.2f} s, "
                  f"{c['status']}")
    for g in r.get("gpus", []):
        if g["from"]["uuid"] != g["to"]["uuid"]:
            console.print(f"  GPU {g['from']['index']} of the checkpoint is GPU {g['to']['index']} "
                          f"here ({g['to']['uuid']}): {'; '.join(g['why'])}")
    for p in r["gpu_processes"]:
        console.print(f"  GPU process {p['pid']} ({p['comm']}): {p['state']}")
    line = trust_line(r.get("trust"))
    if line:
        console.print(line)


@click.command("restore")
@click.argument("source")
@click.option("-n", "--name", help="Name of the restored container (default: the checkpoint's), "
              "from an archive or a registry reference; a local checkpoint keeps its container.")
@click.option("--keep", is_flag=True, help="Keep the checkpoint files after restoring.")
@click.option("--tcp-established", is_flag=True, help="Restore established TCP connections.")
@click.option("--gpu-map", metavar="SRC=DST[,...]", envvar=GPU_MAP_ENV,
              help="Put the checkpoint's GPU SRC on this host's GPU DST (indices or UUIDs; "
                   f"also ${GPU_MAP_ENV}). Default: its own GPUs where they fit, else the "
                   "least loaded suitable ones.")
@click.option("--dry-run", is_flag=True, help="Check and print the GPU plan; change nothing.")
@click.option("--pull", "pull_policy", type=click.Choice(["missing", "always"]), default="missing",
              show_default=True,
              help="For a reference pinned by digest (@sha256:...) that this host restored or "
                   "prefetched before: missing opens it from the host's cache without asking "
                   "the registry; always asks the registry first. A tag is always asked.")
@containerd.target_options
@trust_options("pull")
@registry_options
@json_option
@handle_errors
def restore_cmd(source: str, name: str | None, keep: bool, tcp_established: bool,
                gpu_map: str | None, dry_run: bool, pull_policy: str, to: str | None,
                log_uri: str | None,
                containerd_address: str | None, trust: TrustOptions, registry,
                as_json: bool) -> None:
    """Restore a container from SOURCE: an exported archive, a checkpointed container,
    or a registry reference (pulled first, see `gpusnap pull`).

    The GPUs are checked before anything is touched. From an archive or a
    reference, the container may land on other GPUs of this host (same chip,
    enough free memory; driver r580+): its device nodes, cgroup rules and the
    driver's GPU UUIDs are moved with it.

    A reference is restored only if the trust policy (/etc/gpusnap/policy.json,
    docs/trust.md) accepts its signature, checked before anything is downloaded;
    an encrypted one needs --decrypt-key.

    With --to containerd://NS/ID, a checkpoint pushed from containerd (`gpusnap
    push containerd://NS/CTR REF`) is restored into containerd instead.
    """
    if to:
        emit(as_json, containerd.restore_into(source, to, name, keep, tcp_established, gpu_map,
                                              dry_run, trust, registry, as_json,
                                              containerd_address, log_uri, pull_policy), _human)
        return
    if not Path(source).exists() and reference.names_registry(source):  # parsed strictly there
        # Podman's answers (each a Podman start) while the registry code is imported
        facts = podman.ask_host_facts()
        name_taken = podman.in_background(podman.exists, name) if name else None
        from gpusnap.ops import restore_ref  # registry code: imported only when used

        with transfer_progress(as_json, f"Pulling {source}", verb="fetched") as bar:
            result = restore_ref.restore(source, name, keep, tcp_established, registry(),
                                         gpu_map=gpu_map, dry_run=dry_run, trust=trust,
                                         on_trusted=warn_skipped, pull=pull_policy, facts=facts,
                                         name_taken=name_taken,
                                         progress=bar.advance, total=bar.total)
        emit(as_json, result, _human)
        return
    with step(f"{'Planning' if dry_run else 'Restoring'} {source}...", as_json):
        result = ops.run(source, name, keep, tcp_established, gpu_map=gpu_map, dry_run=dry_run)
    emit(as_json, result, _human)


COMMANDS = [restore_cmd]
