"""gpusnap pull"""

from __future__ import annotations

from typing import Callable

import click

from gpusnap.cli.output import console, emit, handle_errors, human_bytes, json_option
from gpusnap.cli.registry_options import registry_options, transfer_progress
from gpusnap.cli.trust_options import trust_line, trust_options, warn_skipped
from gpusnap.oci.registry import RegistryOptions
from gpusnap.trust.options import TrustOptions


def _human(r: dict) -> None:
    console.print(f"[bold green]Pulled[/] {r['reference']} -> {r['output']} in {r['seconds']:.2f} s: "
                  f"{human_bytes(r['bytes'])}, fetched {human_bytes(r['bytes_fetched'])}, "
                  f"{human_bytes(r['bytes_from_cache'])} from the local cache"
                  + (f", {human_bytes(r['bytes_repeated'])} repeated within the checkpoint"
                     if r.get("bytes_repeated") else "") + "; every digest checked")
    line = trust_line(r.get("trust"))
    if line:
        console.print(line)
    console.print(f"  restore with: gpusnap restore {r['output']}  (or podman container restore "
                  f"--import {r['output']})")


@click.command("pull")
@click.argument("ref")
@click.option("-o", "--output", metavar="FILE", help="Archive to write (.tar.zst, or .tar for "
              "no compression); default REPO-TAG.tar.zst here.")
@click.option("--no-cache", is_flag=True, help="Do not read or fill the local chunk cache "
              "(/var/cache/gpusnap/chunks).")
@trust_options("pull")
@registry_options
@json_option
@handle_errors
def pull_cmd(ref: str, output: str | None, no_cache: bool, trust: TrustOptions,
             registry: Callable[[], RegistryOptions], as_json: bool) -> None:
    """Pull checkpoint REF into an archive that `gpusnap restore` and
    `podman container restore --import` take.

    Its signature is checked against the trust policy (/etc/gpusnap/policy.json,
    docs/trust.md) before anything is downloaded; an encrypted checkpoint needs
    --decrypt-key.
    """
    from gpusnap.ops import pull as ops

    with transfer_progress(as_json, f"Pulling {ref}", verb="fetched") as bar:
        result = ops.pull(ref, output, registry(), trust=trust, on_trusted=warn_skipped,
                          use_cache=not no_cache,
                          progress=bar.advance, total=bar.total)
    emit(as_json, result, _human)


COMMANDS = [pull_cmd]
