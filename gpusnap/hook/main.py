"""OCI prestart/poststop hook: record a container's GPUs at create, validate them at restore.

runc runs prestart hooks on `create` and again on `restore` (during CRIU's
setup-namespaces step), with the container state on stdin, and the stage as
argument (`gpusnap-hook prestart|poststop`); the work is gpusnap/action/prestart.py's.
The hook must never stop a container that gpusnap has nothing to say about:
any unexpected failure exits 0 after a note in the journal; only a restore
onto GPUs that cannot take the checkpoint fails, and so does one whose GPU
manifest, plan or io.gpusnap.gpu-map annotation cannot be read (its GPUs
cannot be checked, and its post-resume would fail on them after CRIU's work).
"""

from __future__ import annotations

import json
import sys
from typing import NoReturn

from gpusnap import journal
from gpusnap.action import prestart
from gpusnap.waits import leave


def main() -> int:
    try:
        state = json.load(sys.stdin)
        stage = sys.argv[1] if len(sys.argv) > 1 and sys.argv[1] in prestart.STAGES else None
        return prestart.run(state, stage)
    except Exception as exc:  # never block a container gpusnap cannot judge
        # str() of an OSError names the file; repr() drops it
        journal.record("hook-error", error=f"{type(exc).__name__}: {exc}")
        return 0


def entry() -> NoReturn:
    """The console script's: out through `leave`, so an NVML call still in flight
    never holds runc in libcuda's exit handlers past the hook's timeout."""
    leave(main())


if __name__ == "__main__":
    entry()
