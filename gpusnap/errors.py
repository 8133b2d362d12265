"""One error type that the CLI turns into one clear line, never a traceback."""

from __future__ import annotations


class GpusnapError(Exception):
    """A failure the user can act on.

    ``message`` says what happened, ``hint`` what to do next.
    """

    def __init__(self, message: str, hint: str | None = None, exit_code: int = 1) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint
        self.exit_code = exit_code

    def __str__(self) -> str:
        return self.message if not self.hint else f"{self.message} ({self.hint})"

    def __reduce__(self):  # whole across processes (gpusnap/oci/segments.py's workers)
        return (type(self), (self.message, self.hint, self.exit_code))
