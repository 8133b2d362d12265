"""gpusnap migrate"""

from __future__ import annotations

from typing import Callable

import click

from gpusnap.cli.output import console, emit, handle_errors, json_option
from gpusnap.cli.push import checkpoint_options, human_push, run_push
from gpusnap.cli.registry_options import registry_options
from gpusnap.cli.trust_options import trust_options
from gpusnap.errors import GpusnapError
from gpusnap.oci.registry import RegistryOptions
from gpusnap.runtime import podman
from gpusnap.trust.options import TrustOptions


def _human(r: dict) -> None:
    human_push(r)
    console.print(f"[bold]On the target host run:[/]\n  {r['restore_command']}")


@click.command("migrate")
@click.argument("container")
@click.argument("ref")
@checkpoint_options
@trust_options("push")
@registry_options
@json_option
@handle_errors
def migrate_cmd(container: str, ref: str, leave_running: bool, level: int, trust: TrustOptions,
                registry: Callable[[], RegistryOptions], as_json: bool) -> None:
    """Checkpoint CONTAINER and push it to REF; print what restores it elsewhere."""
    if not podman.exists(container):
        raise GpusnapError(f"no such container: {container}", "list containers with `podman ps`")
    result = run_push(container, ref, registry, as_json, leave_running, level, trust=trust)
    opts = registry()
    flags = " ".join(f for f, on in (("--insecure", opts.insecure),
                                     ("--plain-http", opts.plain_http),
                                     ("--decrypt-key KEY", trust.encrypts)) if on)
    result["restore_command"] = f"gpusnap restore {result['pinned']}" + (f" {flags}" if flags else "")
    emit(as_json, result, _human)


COMMANDS = [migrate_cmd]
