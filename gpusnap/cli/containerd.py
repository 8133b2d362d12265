"""containerd flags of push and restore: --containerd-address, --to containerd://NS/ID, --log-uri."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import click

from gpusnap.cli.output import step
from gpusnap.cli.registry_options import transfer_progress
from gpusnap.cli.trust_options import warn_skipped
from gpusnap.errors import GpusnapError
from gpusnap.oci import reference

# The same names as gpusnap.ops.containerd_registry (not imported here: it is loaded only when used).
ADDRESS_ENV = "CONTAINERD_ADDRESS"
DEFAULT_ADDRESS = "/run/containerd/containerd.sock"


def address_option(fn: Callable) -> Callable:
    return click.option("--containerd-address", metavar="PATH", envvar=ADDRESS_ENV,
                        help=f"containerd's socket, for containerd:// sources and targets "
                             f"(also ${ADDRESS_ENV}; default {DEFAULT_ADDRESS}).")(fn)


def target_options(fn: Callable) -> Callable:
    """restore's --to, --log-uri and --containerd-address."""
    fn = address_option(fn)
    fn = click.option("--log-uri", metavar="URI",
                      help="With --to containerd://: where the task's stdout and stderr go "
                           "(file:///PATH or binary:///PROGRAM, as `ctr run --log-uri`); "
                           "default: discarded.")(fn)
    return click.option("--to", "to", metavar="containerd://NS[/ID]",
                        help="Restore into containerd: namespace NS (empty: $CONTAINERD_NAMESPACE "
                             "or 'default') as container ID (default: --name, else the "
                             "checkpoint's). The container's image must be in NS.")(fn)


def restore_into(source: str, to: str, name: str | None, keep: bool, tcp_established: bool,
                 gpu_map: str | None, dry_run: bool, trust, registry, as_json: bool,
                 address: str | None, log_uri: str | None, pull_policy: str = "missing") -> dict:
    """`gpusnap restore SOURCE --to containerd://...`: a registry reference or a checkpoint directory."""
    from gpusnap.ops import containerd_registry as ops  # start-up: only --to containerd:// loads it

    for flag, on in (("--keep", keep), ("--tcp-established", tcp_established)):
        if on:
            raise GpusnapError(f"{flag} applies to Podman restores, not --to containerd://",
                               f"restore without {flag}")
    if Path(source).is_dir():
        with step(f"{'Planning' if dry_run else 'Restoring'} {source}...", as_json):
            return ops.restore_directory(Path(source), to, name, address=address, gpu_map=gpu_map,
                                         dry_run=dry_run, log_uri=log_uri)
    if not reference.try_parse(source):
        raise GpusnapError(f"{source}: neither a registry reference nor a checkpoint directory",
                           "pass HOST/REPO:TAG (from `gpusnap push containerd://...`) or the "
                           "directory a failed push kept")
    with transfer_progress(as_json, f"Pulling {source}", verb="fetched") as bar:
        return ops.restore_remote(source, to, name, registry(), address=address, gpu_map=gpu_map,
                                  dry_run=dry_run, log_uri=log_uri, trust=trust,
                                  on_trusted=warn_skipped, pull_policy=pull_policy,
                                  progress=bar.advance, total=bar.total)
