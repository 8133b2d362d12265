"""gpusnap migrate"""

from __future__ import annotations

from typing import Callable

import click

from gpusnap.cli import detach as bg
from gpusnap.cli.output import handle_errors, json_option
from gpusnap.cli.push import (checkpoint_options, human_push, leave_running_option, report_push,
                              run_push)
from gpusnap.cli.registry_options import registry_options
from gpusnap.cli.trust_options import trust_options
from gpusnap.errors import GpusnapError
from gpusnap.oci.registry import RegistryOptions
from gpusnap.ops.container_busy import refuse_if_busy
from gpusnap.ops.uploads import Tracker
from gpusnap.runtime import podman
from gpusnap.trust.options import TrustOptions


def _human(r: dict) -> None:
    human_push(r, target=True)


@click.command("migrate")
@click.argument("container")
@click.argument("ref")
@leave_running_option
@click.option("-P", "--pre-checkpoint", is_flag=True,
              help="Push a first round and keep the container running; the target "
                   "prefetches it (`gpusnap pull --prefetch REF`) and a later `gpusnap migrate` "
                   "sends only what changed, while the container is stopped.")
@checkpoint_options
@bg.detach_options
@trust_options("push")
@registry_options
@json_option
@handle_errors
def migrate_cmd(container: str, ref: str, leave_running: bool, pre_checkpoint: bool, level: int,
                detach: bool, upload_state: str | None, trust: TrustOptions,
                registry: Callable[[], RegistryOptions], as_json: bool) -> None:
    """Checkpoint CONTAINER, stop it (unless --leave-running) and push it to REF;
    print the command that restores it on the target host.

    Pre-copy, for a short stop: `gpusnap migrate -P CTR REPO:pre` while it runs,
    `gpusnap pull --prefetch REPO:pre` on the target, then `gpusnap migrate CTR
    REPO:final` and `gpusnap restore REPO:final` there: only the chunks that
    changed since the first round cross while the container is down.

    -d/--detach returns once the container is checkpointed on local storage
    (stopped, its GPU free) and uploads in the background: `gpusnap status ID`
    follows it; run the restore on the target once it says done."""
    refuse_if_busy(container)  # before Podman is asked: it would wait on the other's dump
    if not podman.exists(container):
        raise GpusnapError(f"no such container: {container}", "list containers with `podman ps`")
    if detach:
        bg.start("migrate", container, ref, leave_running or pre_checkpoint, registry, as_json,
                 pre_checkpoint, trust)
        return

    def push(tracker: Tracker | None = None) -> dict:
        return run_push(container, ref, registry, as_json, leave_running, level, trust=trust,
                        here=False, pre_checkpoint=pre_checkpoint, tracker=tracker,
                        container_only=True)
    report_push(push, upload_state, as_json, _human)


COMMANDS = [migrate_cmd]
