"""gpusnap pull"""

from __future__ import annotations

from typing import Callable

import click

from gpusnap.cli.output import console, emit, handle_errors, human_bytes, json_option
from gpusnap.cli.registry_options import registry_options, transfer_progress
from gpusnap.oci.registry import RegistryOptions


def _human(r: dict) -> None:
    console.print(f"[bold green]Pulled[/] {r['reference']} -> {r['output']} in {r['seconds']:.2f} s: "
                  f"{human_bytes(r['bytes'])}, fetched {human_bytes(r['bytes_fetched'])}, "
                  f"{human_bytes(r['bytes_from_cache'])} from the local cache; every digest checked")
    console.print(f"  restore with: gpusnap restore {r['output']}  (or podman container restore "
                  f"--import {r['output']})")


@click.command("pull")
@click.argument("ref")
@click.option("-o", "--output", metavar="FILE", help="Archive to write (.tar.zst, or .tar for "
              "no compression); default REPO-TAG.tar.zst here.")
@click.option("--no-cache", is_flag=True, help="Do not read or fill the local chunk cache "
              "(/var/cache/gpusnap/chunks).")
@registry_options
@json_option
@handle_errors
def pull_cmd(ref: str, output: str | None, no_cache: bool,
             registry: Callable[[], RegistryOptions], as_json: bool) -> None:
    """Pull checkpoint REF into an archive that `gpusnap restore` and
    `podman container restore --import` take."""
    from gpusnap.ops import pull as ops

    with transfer_progress(as_json, f"Pulling {ref}", verb="fetched") as bar:
        result = ops.pull(ref, output, registry(), use_cache=not no_cache,
                          progress=bar.advance, total=bar.total)
    emit(as_json, result, _human)


COMMANDS = [pull_cmd]
