"""Whether a folder holds a whole CRIU dump: CRIU writes inventory.img last.

Its own module, importing nothing: the OCI hook asks it at every container's
create (action/prestart.py), where each import is start-up time.
"""

from __future__ import annotations

from pathlib import Path

INVENTORY = "inventory.img"


def whole(folder: Path) -> bool:
    """Whether ``folder`` holds a whole CRIU dump."""
    return (folder / INVENTORY).is_file()
