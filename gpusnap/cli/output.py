"""Output shared by all verbs: --json, progress, sizes, one-line errors."""

from __future__ import annotations

import contextlib
import functools
import json
import sys
from typing import Callable, Iterator

import click

from gpusnap.errors import GpusnapError
from gpusnap.redact import redact


class LazyConsole:
    """A rich Console made on first use: importing rich costs a command ~40 ms,
    and one with --json prints nothing through it (a replica's restore answers
    sooner). ``real`` is the Console itself, for rich's own classes."""

    def __init__(self, **options) -> None:
        self._options = options
        self._console = None

    @property
    def real(self):
        if self._console is None:
            from rich.console import Console

            self._console = Console(**self._options)
        return self._console

    def __getattr__(self, name: str):
        return getattr(self.real, name)


err_console = LazyConsole(stderr=True, highlight=False, soft_wrap=True)
console = LazyConsole(highlight=False, soft_wrap=True)


def json_option(fn: Callable) -> Callable:
    return click.option("--json", "as_json", is_flag=True,
                        help="Print the result as JSON on stdout.")(fn)


def emit(as_json: bool, data: dict, human: Callable[[dict], None]) -> None:
    if as_json:
        click.echo(json.dumps(data, indent=2, sort_keys=True, default=str))
    else:
        human(data)


@contextlib.contextmanager
def step(text: str, as_json: bool) -> Iterator[None]:
    """A spinner on stderr while a long step runs (silent with --json or no TTY)."""
    if as_json or not err_console.is_terminal:
        yield
        return
    with err_console.status(text):
        yield


def human_bytes(n: int | float | None) -> str:
    if n is None:
        return "-"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def handle_errors(fn: Callable) -> Callable:
    """Turn GpusnapError into one line (plus what to do), never a traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        as_json = kwargs.get("as_json", False)
        try:
            return fn(*args, **kwargs)
        except GpusnapError as exc:
            # A message may quote what a user typed (user:password@host/...) or a library said.
            message, hint = redact(exc.message), redact(exc.hint) if exc.hint else exc.hint
            if as_json:
                click.echo(json.dumps({"error": message, "hint": hint}))
            else:
                err_console.print(f"[bold red]Error:[/] {message}", soft_wrap=True)
                if hint:
                    err_console.print(f"  [dim]->[/] {hint}", soft_wrap=True)
            sys.exit(exc.exit_code)
        except KeyboardInterrupt:
            err_console.print("[bold red]Interrupted.[/] `gpusnap doctor` checks for "
                              "anything left half done.")
            sys.exit(130)

    return wrapper
