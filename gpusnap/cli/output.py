"""Output shared by all verbs: --json, progress, sizes, one-line errors."""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import os
import select
import signal
import sys
from typing import Callable, Iterator

import click

from gpusnap.errors import GpusnapError
from gpusnap.redact import redact


class LazyConsole:
    """A rich Console made on first use: importing rich is a noticeable part of
    a command's start, and one with --json prints nothing through it (a replica's restore answers
    sooner). ``real`` is the Console itself, for rich's own classes."""

    def __init__(self, **options) -> None:
        self._options = options
        self._console = None

    @property
    def real(self):
        if self._console is None:
            from rich.console import Console  # start-up: rich only on first use

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


ROOT_NEEDED = GpusnapError(
    "gpusnap needs root: CRIU, which checkpoints and restores the container's processes, "
    "runs only as root",
    "run it as root (`sudo gpusnap ...`); Podman checkpoints rootful containers only, so a "
    "rootless one must be run by root to be checkpointed")


def handle_errors(fn: Callable | None = None, *, root: bool = True) -> Callable:
    """Turn GpusnapError into one line (plus what to do), never a traceback.
    ``root``: the command needs root, said in one line before anything is tried
    (`@handle_errors(root=False)` for those that do not: gpus, key)."""
    if fn is None:
        return functools.partial(handle_errors, root=root)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        interrupted = _note_interrupts()
        try:  # a Ctrl-C anywhere in here, the report of an error included, is said so
            return _one_line(fn, root, interrupted, *args, **kwargs)
        except KeyboardInterrupt:
            if kwargs.get("as_json", False):
                click.echo(json.dumps({"error": "interrupted (Ctrl-C)", "hint": "`gpusnap doctor` "
                                       "checks for anything left half done"}))
            else:
                err_console.print("[bold red]Interrupted[/] (Ctrl-C). `gpusnap doctor` checks for "
                                  "anything left half done.")
            sys.exit(130)

    return wrapper


def _one_line(fn: Callable, root: bool, interrupted: list[bool], *args, **kwargs):
    try:
        if root and os.geteuid() != 0:
            raise ROOT_NEEDED
        return fn(*args, **kwargs)
    except GpusnapError as exc:
        # Ctrl-C reached the child (Podman) first: it failed of it. An error built
        # for the Ctrl-C (exit 130: where the checkpoint is kept, the upload's id)
        # is the line to keep.
        if interrupted and exc.exit_code != 130:
            raise KeyboardInterrupt from None
        _say(exc.message, exc.hint, kwargs.get("as_json", False))
        sys.exit(exc.exit_code)
    except click.exceptions.Exit:  # click's own way out
        raise
    except BrokenPipeError as exc:
        if _stdout_closed():  # `gpusnap ... | head`: click's quiet end, as before
            raise
        _say(*_os_words(exc), kwargs.get("as_json", False))  # a pipe of gpusnap's own (zstd)
        sys.exit(1)
    except Exception as exc:  # noqa: BLE001 -- still one line, the traceback on ask
        if interrupted:  # Ctrl-C reached a child first: it failed of it
            raise KeyboardInterrupt from None
        if os.environ.get(DEBUG_ENV):
            raise
        if isinstance(exc, OSError) and exc.errno is not None and \
                not type(exc).__module__.startswith(("requests", "urllib3")):
            _say(*_os_words(exc), kwargs.get("as_json", False))  # the host's refusal, unworded
            sys.exit(1)
        _say(f"internal error: {type(exc).__name__}: {exc}",
             f"this is a gpusnap bug: run it again with {DEBUG_ENV}=1 for the traceback and "
             "report it; `gpusnap doctor` checks for anything left half done",
             kwargs.get("as_json", False))
        sys.exit(70)  # EX_SOFTWARE


DEBUG_ENV = "GPUSNAP_DEBUG"


def _say(message: str, hint: str | None, as_json: bool) -> None:
    # A message may quote what a user typed (user:password@host/...) or a library said;
    # a name with brackets in it is text, not rich's markup.
    from rich.markup import escape  # start-up: only where there is an error to print

    message, hint = redact(message), redact(hint) if hint else hint
    if as_json:
        click.echo(json.dumps({"error": message, "hint": hint}))
    else:
        err_console.print(f"[bold red]Error:[/] {escape(message)}", soft_wrap=True)
        if hint:
            err_console.print(f"  [dim]->[/] {escape(hint)}", soft_wrap=True)


def _stdout_closed() -> bool:
    """Whether stdout is a pipe nobody reads any more (poll says POLLERR there)."""
    try:
        poll = select.poll()
        poll.register(sys.stdout.fileno(), select.POLLOUT)
        return any(ev & (select.POLLERR | select.POLLHUP) for _, ev in poll.poll(0))
    except (OSError, ValueError, AttributeError):  # not a real file (a test's runner)
        return False


def _os_words(exc: OSError) -> tuple[str, str]:
    what = exc.strerror or str(exc)
    where = f": {exc.filename}" if exc.filename else ""
    if exc.errno == errno.ENOSPC:
        hint = "free space on that filesystem, then run the command again"
    elif exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        hint = "pick a path this user can write, or check its permissions"
    else:
        hint = "check that path, then run the command again"
    return f"{what}{where}", f"{hint}; `gpusnap doctor` checks for anything left half done"


def _note_interrupts() -> list[bool]:
    """A list that gets an entry at Ctrl-C (which is still KeyboardInterrupt).
    Ctrl-C goes to the whole process group: a Podman we wait on gets it too,
    and its failure may arrive before our KeyboardInterrupt does."""
    seen: list[bool] = []

    def on_sigint(signum, frame):
        seen.append(True)
        raise KeyboardInterrupt

    with contextlib.suppress(ValueError):  # not the main thread (a test's caller)
        signal.signal(signal.SIGINT, on_sigint)
    return seen


def gpu_back_note(r: dict) -> None:
    """A leave-running checkpoint's GPUs not given back (yet): on stderr, as an error is."""
    if r.get("gpu_back_detail"):
        from rich.markup import escape  # start-up: rich only where there is this to say
        mark = "[bold red]Error:[/]" if r["gpu_back"] is False else "[bold yellow]Note:[/]"
        err_console.print(f"{mark} {escape(r['gpu_back_detail'])}")
        err_console.print(f"  [dim]->[/] {escape(r['gpu_back_hint'])}")
