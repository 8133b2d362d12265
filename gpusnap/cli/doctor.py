"""gpusnap doctor"""

from __future__ import annotations

import sys

import click

from gpusnap.cli.output import console, emit, handle_errors, json_option
from gpusnap.ops import doctor as ops


def _human(r: dict) -> None:
    for c in r["checks"]:
        mark = "[green]ok[/]" if c["ok"] else ("[red]FAIL[/]" if c["required"] else "[yellow]warn[/]")
        console.print(f"{mark:>18}  {c['name']:<20} {c['detail']}", soft_wrap=True)
        if c["fix"]:
            console.print(f"{'':>6}{'':<20} [dim]->[/] {c['fix']}", soft_wrap=True)
    console.print("[bold green]All required checks passed.[/]" if r["ok"]
                  else "[bold red]Some required checks failed.[/]")


@click.command("doctor")
@click.option("--fix", is_flag=True, help="Restore and unlock GPU processes an interrupted "
              "checkpoint left behind.")
@json_option
@handle_errors
def doctor_cmd(fix: bool, as_json: bool) -> None:
    """Check CRIU, the runtime, the hooks and the NVIDIA driver; say what to fix."""
    result = ops.run(fix)
    emit(as_json, result, _human)
    sys.exit(0 if result["ok"] else 1)


COMMANDS = [doctor_cmd]
