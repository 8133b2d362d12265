"""Registry flags shared by push, pull, migrate, inspect and restore (Podman's
--tls-verify, ORAS's --plain-http and --ca-file), and a byte progress bar for transfers."""

from __future__ import annotations

import contextlib
import functools
import sys
from typing import Callable, Iterator

import click

from gpusnap.cli.output import err_console
from gpusnap.errors import GpusnapError
from gpusnap.oci.registry import RegistryOptions

_NAMES = ("username", "password_stdin", "authfile", "tls_verify", "insecure", "plain_http",
          "ca_file")
DEPRECATED = "DEPRECATED"  # how --help marks an old spelling that still works


def registry_options(fn: Callable) -> Callable:
    """Add the flags; the command receives one ``registry: RegistryOptions``."""
    options = [
        click.option("-u", "--username", help="Registry user (else auth.json, as `podman login` "
                     "writes it, or ~/.docker/config.json)."),
        click.option("--password-stdin", is_flag=True, help="Read the password from stdin."),
        click.option("--authfile", type=click.Path(dir_okay=False),
                     help="Credentials file (Podman's auth.json format)."),
        click.option("--tls-verify", type=click.BOOL, default=None, metavar="BOOL",
                     help="Verify the registry's TLS certificate (default true; "
                          "--tls-verify=false as in Podman)."),
        click.option("--plain-http", is_flag=True, help="Talk HTTP, not HTTPS (as in ORAS)."),
        click.option("--ca-file", type=click.Path(dir_okay=False),
                     help="CA certificate that signed the registry's certificate (as in ORAS)."),
        click.option("--insecure", is_flag=True,
                     help=f"{DEPRECATED}: use --tls-verify=false (still works)."),
    ]

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        values = {name: kwargs.pop(name) for name in _NAMES}
        if values.pop("insecure"):
            deprecated("--insecure", "--tls-verify=false")
            if values["tls_verify"]:
                raise click.UsageError("--insecure contradicts --tls-verify=true: pass one")
            values["tls_verify"] = False
        kwargs["registry"] = _build(values)
        return fn(*args, **kwargs)

    for option in reversed(options):
        wrapper = option(wrapper)
    return wrapper


def deprecated(old: str, new: str) -> None:
    """One line on stderr (with --json too): the old spelling works, the new one is shown."""
    err_console.print(f"[yellow]Note:[/] {old} is deprecated, use {new}", soft_wrap=True)


def _build(v: dict) -> Callable[[], RegistryOptions]:
    """Deferred: the password is read from stdin only when the registry is used (once)."""
    made: list[RegistryOptions] = []

    def make() -> RegistryOptions:
        if made:
            return made[0]
        password = None
        if v["password_stdin"]:
            if v["username"] is None:
                raise GpusnapError("--password-stdin needs --username",
                                   "pass -u USER with it: the password is read from stdin")
            password = sys.stdin.readline().rstrip("\r\n")
        made.append(RegistryOptions(username=v["username"], password=password,
                                    authfile=v["authfile"], insecure=v["tls_verify"] is False,
                                    plain_http=v["plain_http"], ca_file=v["ca_file"]))
        return made[0]
    return make


class TransferProgress:
    """Callbacks for the transfer code; draws a bar on stderr when it is a terminal."""

    def __init__(self, bar) -> None:
        self._bar = bar
        self._task = bar.add_task("", total=None, network=0) if bar else None
        self.network = 0

    def describe(self, text: str) -> None:
        if self._bar:
            self._bar.update(self._task, description=text)

    def total(self, n: int) -> None:
        if self._bar:
            self._bar.update(self._task, total=n)

    def advance(self, raw: int, network: int) -> None:
        self.network += network
        if self._bar:
            self._bar.update(self._task, advance=raw, network=self.network)


@contextlib.contextmanager
def transfer_progress(as_json: bool, text: str, verb: str = "sent") -> Iterator[TransferProgress]:
    if as_json or not err_console.is_terminal:
        yield TransferProgress(None)
        return
    # start-up: rich's progress only on a terminal (not --json)
    from rich.filesize import decimal
    from rich.progress import (BarColumn, DownloadColumn, Progress, ProgressColumn,
                               TextColumn, TimeRemainingColumn, TransferSpeedColumn)

    class _Network(ProgressColumn):
        """What crossed the network, beside what was processed."""
        def render(self, task):
            return f"{verb} {decimal(int(task.fields.get('network', 0)))}"

    columns = [TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
               TransferSpeedColumn(), _Network(), TimeRemainingColumn()]
    with Progress(*columns, console=err_console.real, transient=True) as bar:
        progress = TransferProgress(bar)
        progress.describe(text)
        yield progress
