"""gpusnap pull"""

from __future__ import annotations

from typing import Callable

import click

from gpusnap.cli.output import console, emit, handle_errors, human_bytes, json_option
from gpusnap.cli.registry_options import registry_options, transfer_progress
from gpusnap.cli.trust_options import trust_line, trust_options, warn_skipped
from gpusnap.errors import GpusnapError
from gpusnap.ops import advice
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
    podman_too = "" if "--name" in r["restore_command"] else \
        f"  (or podman container restore --import {r['output']})"
    console.print(f"  restore with: {r['restore_command']}{podman_too}")


def _human_prefetch(r: dict) -> None:
    console.print(f"[bold green]Prefetched[/] {r['reference']} into {r['cache']} in "
                  f"{r['seconds']:.2f} s: fetched {r['chunks_fetched']} of {r['chunks']} chunks "
                  f"({human_bytes(r['bytes_fetched'])}), "
                  f"{human_bytes(r['bytes_already_cached'])} were there already; every digest "
                  "checked")
    line = trust_line(r.get("trust"))
    if line:
        console.print(line)
    if r["over_cache_limit"]:
        console.print(f"  [bold yellow]Warning:[/] the cache now holds more than its limit "
                      f"({human_bytes(r['cache_limit'])}): the next transfer may drop these "
                      "chunks; raise GPUSNAP_CACHE_MAX_BYTES")
    prepared = r.get("prepared")
    if prepared:
        console.print(f"  its memory pages are written out in {prepared['folder']}"
                      f"{' (RAM)' if prepared['in_ram'] else ''}: a restore links or patches "
                      "them instead of writing them")
    if r["pre_checkpoint"]:
        console.print("  restore the final round (`gpusnap migrate` on the source pushes it): "
                      "only the chunks that changed since this one are fetched then")
    else:
        console.print(f"  `gpusnap restore {r['reference']}` now reads these chunks from here")


@click.command("pull")
@click.argument("ref")
@click.option("-o", "--output", metavar="FILE", help="Archive to write (.tar.zst, or .tar for "
              "no compression); default REPO-TAG.tar.zst here.")
@click.option("--no-cache", is_flag=True, help="Do not read or fill the local chunk cache "
              "(/var/cache/gpusnap/chunks).")
@click.option("--prefetch", is_flag=True, help="Only fill the local chunk cache (no archive): a "
              "later restore of REF, or of a newer round of it, fetches just what is missing.")
@trust_options("pull")
@registry_options
@json_option
@handle_errors
def pull_cmd(ref: str, output: str | None, no_cache: bool, prefetch: bool, trust: TrustOptions,
             registry: Callable[[], RegistryOptions], as_json: bool) -> None:
    """Pull checkpoint REF into an archive that `gpusnap restore` and
    `podman container restore --import` take.

    Its signature is checked against the trust policy (/etc/gpusnap/policy.json,
    docs/trust.md) before anything is downloaded; an encrypted checkpoint needs
    --decrypt-key.
    """
    if prefetch:
        if output or no_cache:
            raise GpusnapError("--prefetch fills the chunk cache: it takes no --output and no "
                               "--no-cache", "drop them, or drop --prefetch to write an archive")
        from gpusnap.ops import warm_cache  # registry code: imported only when used

        with transfer_progress(as_json, f"Prefetching {ref}", verb="fetched") as bar:
            result = warm_cache.prefetch(ref, registry(), trust=trust, on_trusted=warn_skipped,
                                         progress=bar.advance, total=bar.total)
        emit(as_json, result, _human_prefetch)
        return
    from gpusnap.ops import pull as ops  # registry code: imported only when used

    with transfer_progress(as_json, f"Pulling {ref}", verb="fetched") as bar:
        result = ops.pull(ref, output, registry(), trust=trust, on_trusted=warn_skipped,
                          use_cache=not no_cache,
                          progress=bar.advance, total=bar.total)
    result["restore_command"] = advice.restore_file_command(result["output"], result.get("container"))
    emit(as_json, result, _human)


COMMANDS = [pull_cmd]
