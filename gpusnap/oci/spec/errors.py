"""The one error a spec edit raises: the field at fault, what is wrong, nothing changed."""

from __future__ import annotations

from gpusnap.errors import GpusnapError


class SpecError(GpusnapError, ValueError):
    def __init__(self, message: str) -> None:
        super().__init__(message, "the checkpoint's spec was left as it was")
