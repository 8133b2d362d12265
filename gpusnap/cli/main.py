"""`gpusnap`: GPU-aware checkpoint/restore for containers."""

from __future__ import annotations

import importlib
import json
import sys

import click

from gpusnap import __version__
from gpusnap.waits import leave

# Each command and the module of gpusnap.cli that defines it: a run imports its
# own command's module only (a replica's `gpusnap restore` starts without
# loading checkpoint, doctor, move...: their imports would add to its start).
VERBS = {"checkpoint": "checkpoint", "restore": "restore", "inspect": "inspect", "push": "push",
         "pull": "pull", "migrate": "migrate", "move": "move", "gpus": "gpus",
         "freeze": "freeze", "thaw": "freeze", "key": "key", "doctor": "doctor",
         "status": "status"}


class _Verbs(click.Group):
    """The commands of VERBS, each imported when it is asked for."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(VERBS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        module = VERBS.get(cmd_name)
        if module is None:
            return None
        commands = importlib.import_module(f"gpusnap.cli.{module}").COMMANDS
        return next(c for c in commands if c.name == cmd_name)


@click.group(cls=_Verbs,
             context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="gpusnap")
def cli() -> None:
    """Checkpoint and restore GPU containers with Podman and containerd.

    \b
    Plain `podman container checkpoint/restore` work on GPU containers once
    gpusnap is installed (`make install`); these commands add checks, progress,
    JSON output and GPU-only operations:

    \b
      gpusnap checkpoint CTR --export ctr.tar.zst   checkpoint (GPU memory included)
      gpusnap restore ctr.tar.zst                   restore it, here or on another host
      gpusnap inspect ctr.tar.zst                   what a checkpoint holds
      gpusnap push CTR|FILE|DIR HOST/REPO:TAG       into an OCI registry (a container keeps running)
      gpusnap pull HOST/REPO:TAG -o ctr.tar.zst     back into an archive
      gpusnap restore HOST/REPO:TAG                 pull and restore in one go
      gpusnap push containerd://NS/CTR HOST/REPO:TAG  from containerd (restore it --to containerd://NS/ID)
      gpusnap migrate CTR HOST/REPO:TAG             checkpoint, stop, push; prints what to run on the target
      gpusnap migrate -d CTR HOST/REPO:TAG          return once checkpointed (GPU free), upload in the background
      gpusnap status [ID] [--wait]                  background uploads: progress, done or failed
      gpusnap restore ctr.tar.zst --gpu-map 0=1     onto another GPU (--dry-run: the plan only)
      gpusnap move CTR --gpu 1                      live onto another GPU of this host
      gpusnap freeze CTR / gpusnap thaw CTR         release GPU memory in place, take it back
      gpusnap gpus                                  this host's GPUs
      gpusnap key export -o a.pub / key trust a.pub this host's signing key; trust another's
      gpusnap key generate -o PREFIX                a signing key pair (PREFIX.key, PREFIX.pub)
      gpusnap doctor                                what this host is missing (ok / warning / error)
    """


def main() -> None:
    try:
        code = cli.main(prog_name="gpusnap", standalone_mode=False)
    except click.ClickException as exc:  # a bad option or argument: click's words
        _refused(exc)
        code = exc.exit_code
    except click.Abort:
        click.echo("Aborted!", err=True)
        code = 1
    except SystemExit as done:
        if done.code is None or isinstance(done.code, int):
            leave(done.code or 0)
        raise
    leave(code if isinstance(code, int) else 0)


def _refused(exc: click.ClickException) -> None:
    """As click says it, or with --json as every error of gpusnap's: a JSON object."""
    if "--json" not in sys.argv[1:]:
        exc.show()
        return
    ctx = getattr(exc, "ctx", None)
    where = ctx.command_path if ctx is not None else "gpusnap"
    click.echo(json.dumps({"error": exc.format_message(),
                           "hint": f"`{where} --help` lists what it takes"}))
