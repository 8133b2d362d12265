"""gpusnap doctor"""

from __future__ import annotations

import sys

import click

from gpusnap.cli.output import console, emit, handle_errors, json_option
from gpusnap.ops import doctor as ops


_MARKS = {"ok": "[green]ok[/]", "warning": "[yellow]warning[/]", "error": "[red]error[/]"}


def _human(r: dict) -> None:
    for c in r["checks"]:
        pad = " " * (7 - len(c["level"]))  # markup has no width: pad by the word
        console.print(f"{pad}{_MARKS[c['level']]}  {c['name']:<20} {c['detail']}", soft_wrap=True)
        if c["fix"] and c["level"] != "ok":
            console.print(f"{'':>9}{'':<20} [dim]->[/] {c['fix']}", soft_wrap=True)
    warned = f"{r['warnings']} warning{'s' if r['warnings'] != 1 else ''}"
    console.print(f"[bold green]No errors[/], {warned}." if r["ok"]
                  else f"[bold red]{r['errors']} error{'s' if r['errors'] != 1 else ''}[/], "
                       f"{warned}: fix the errors first.")


@click.command("doctor")
@click.option("--fix", is_flag=True, help="Restore and unlock GPU processes an interrupted "
              "checkpoint left behind; undo an interrupted `gpusnap move`.")
@json_option
@handle_errors
def doctor_cmd(fix: bool, as_json: bool) -> None:
    """Check CRIU, the runtime, the hooks and the NVIDIA driver; say what to fix.

    Each check is ok, a warning (a feature is off, the rest works) or an error
    (checkpoints cannot work); the exit status is 1 only for errors."""
    result = ops.run(fix)
    emit(as_json, result, _human)
    sys.exit(0 if result["ok"] else 1)


COMMANDS = [doctor_cmd]
