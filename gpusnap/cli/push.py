"""gpusnap push"""

from __future__ import annotations

import sys
from typing import Callable

import click

from gpusnap.cli import containerd
from gpusnap.cli import detach as bg
from gpusnap.cli.output import console, emit, gpu_back_note, handle_errors, human_bytes, json_option
from gpusnap.cli.registry_options import registry_options, transfer_progress
from gpusnap.cli.trust_options import trust_options
from gpusnap.errors import GpusnapError
from gpusnap.oci.registry import RegistryOptions, TransientError
from gpusnap.ops import advice
from gpusnap.ops.uploads import Tracker
from gpusnap.trust.options import TrustOptions


def _trust_line(r: dict) -> None:
    t = r.get("trust") or {}
    parts = []
    if t.get("signed"):
        parts.append("signed by " + ", ".join(k[:19] for k in t["signature_key_ids"]))
    if t.get("encrypted"):
        parts.append("encrypted to " + ", ".join(k[:19] for k in t["recipients"]))
    if parts:
        console.print(f"  {'; '.join(parts)}")


def human_push(r: dict, target: bool = False) -> None:
    """``target``: the restore command is for another host (migrate), not this one."""
    if r.get("format") == "podman":
        console.print(f"[bold green]Pushed[/] {r['reference']} as a Podman checkpoint image in "
                      f"{r['seconds']:.2f} s: {r['files']} files, {human_bytes(r['bytes'])}, "
                      f"one layer of {human_bytes(r['bytes_sent'])}")
    else:
        had = r["chunks"] - r["chunks_sent"]
        console.print(f"[bold green]Pushed[/] {r['reference']} in {r['seconds']:.2f} s: "
                      f"{r['files']} files, {human_bytes(r['bytes'])} in {r['chunks']} chunks; "
                      f"sent {r['chunks_sent']} chunks ({human_bytes(r['bytes_sent'])} compressed)"
                      + (f"; the other {had} were in the registry already or repeats" if had
                         else ""))
    console.print(f"  digest: {r['digest']}")
    _trust_line(r)
    state = r.get("container_state")
    if state:
        console.print(f"  container {state['name']}: {state['says']}")
    if retaken := advice.retaken(r):
        console.print(f"  {retaken}")
    gpu_back_note(r)
    if r.get("pre_checkpoint"):
        console.print(f"[bold]On the target host, warm its chunk cache now:[/]\n"
                      f"  {r['prefetch_command']}\n"
                      f"[bold]Then here:[/] gpusnap migrate {r['container']} REF (the same "
                      "repository) stops the container and sends only what changed since")
    elif target:
        console.print(f"[bold]On the target host run:[/]\n  {r['restore_command']}")
    else:
        console.print(f"  restore with: {r['restore_command']}")
        if r.get("restore_renamed"):
            console.print(f"  [dim](--name: {r['restore_renamed']} exists on this host; leave it "
                          "out on another host)[/]")
    refused = r.get("restore_refused")
    if refused:
        console.print(f"  [bold yellow]Warning:[/] this host would refuse that restore: "
                      f"{refused['error']}")
        if refused.get("hint"):
            console.print(f"    [dim]->[/] {refused['hint']}")


def run_push(source: str, ref: str, registry: Callable[[], RegistryOptions], as_json: bool,
             leave_running: bool, level: int, image_format: str = "gpusnap",
             trust: TrustOptions | None = None, containerd_address: str | None = None,
             here: bool = True, pre_checkpoint: bool = False,
             tracker: Tracker | None = None, container_only: bool = False) -> dict:
    """Push, then say what became of the container and how to restore it
    (``here``: on this host; else on another one). ``tracker``: a background
    upload's state file, kept up to date (cli/detach.py). ``container_only``:
    SOURCE names a container even where a file of its name lies here."""
    from gpusnap.ops import push as ops  # registry code: imported only when used

    with transfer_progress(as_json, f"Pushing {source}") as bar:
        def checkpointing(name: str) -> None:
            bar.describe(f"Checkpointing {name}")

        def pushing(total: int) -> None:
            bar.describe(f"Pushing {source}")
            bar.total(total)
            if tracker:
                tracker.total(total)

        def advance(raw: int, network: int) -> None:
            bar.advance(raw, network)
            if tracker:
                tracker.advance(raw, network)

        try:
            r = ops.push(source, ref, registry(), leave_running=leave_running, level=level,
                         progress=advance, total=pushing, on_checkpoint=checkpointing,
                         image_format=image_format, trust=trust,
                         containerd_address=containerd_address, pre_checkpoint=pre_checkpoint,
                         on_checkpointed=tracker.checkpointed if tracker else None,
                         container_only=container_only)
        except TransientError as exc:  # true of push: the registry's blobs are asked first
            again = "push again: chunks the registry already has are not sent again"
            raise GpusnapError(exc.message,
                               f"{exc.hint}; then {again}" if exc.hint else again) from None
    return advice.after_push(r, registry(), trust, here, leave_running, pre_checkpoint,
                             containerd_address)


def checkpoint_options(fn: Callable) -> Callable:
    """Flags for a push that checkpoints a container first (push, migrate)."""
    return click.option("--compression-level", "level", default=3, show_default=True,
                        type=click.IntRange(1, 19), help="zstd level of the chunks.")(fn)


def leave_running_option(fn: Callable) -> Callable:
    """migrate's: it moves a container, so it stops it unless told otherwise."""
    return click.option("-R", "--leave-running", is_flag=True,
                        help="Keep the container running (a copy, not a move).")(fn)


@click.command("push")
@click.argument("source")
@click.argument("ref")
@click.option("--stop", is_flag=True,
              help="A container is stopped once checkpointed: a move, as `gpusnap migrate` "
                   "does (default: it keeps running, a copy).")
@click.option("-R", "--leave-running", is_flag=True,
              help="Keep the container running: the default now, accepted for scripts.")
@checkpoint_options
@click.option("--format", "image_format", type=click.Choice(["gpusnap", "podman"]),
              default="gpusnap", show_default=True,
              help="gpusnap: chunks that later pushes and pulls reuse; podman: a checkpoint "
                   "image `podman container restore REF` takes (as --create-image makes).")
@containerd.address_option
@bg.detach_options
@trust_options("push")
@registry_options
@json_option
@handle_errors
def push_cmd(source: str, ref: str, stop: bool, leave_running: bool, level: int,
             image_format: str, containerd_address: str | None, detach: bool,
             upload_state: str | None, trust: TrustOptions,
             registry: Callable[[], RegistryOptions], as_json: bool) -> None:
    """Push a checkpoint to an OCI registry as REF (HOST[:PORT]/REPO:TAG).

    SOURCE is an exported archive, a checkpoint directory, or a running
    container: checkpointed first and left running, as `podman push` copies
    (--stop stops it: a move). Chunks the registry already has are not sent
    again. --sign-key signs it, --encrypt-to encrypts it (docs/trust.md). The
    output says what became of the container and the command that restores it.

    SOURCE containerd://[NAMESPACE/]NAME is a containerd container (checkpointed
    first, as `ctr c checkpoint --task --rw`; stopped only with --stop) or
    a checkpoint image `ctr c checkpoint --task` made; with a slash, the first
    segment is the namespace. `gpusnap restore REF --to containerd://NS/ID`
    restores it.

    -d/--detach (a container SOURCE) returns once it is checkpointed on local
    storage and uploads in the background: `gpusnap status ID` follows it.
    """
    if stop and leave_running:
        raise GpusnapError("--stop and --leave-running contradict each other",
                           "pass --stop to move the container, nothing to copy it")
    if detach:
        from gpusnap.runtime import podman  # start-up: --detach only (a big module)

        bg.refuse_source(source)
        if not podman.exists(source):
            raise GpusnapError(f"{source}: no such file, directory or container",
                               "pass a running container's name (`podman ps`)")
        bg.start("push", source, ref, not stop, registry, as_json, trust=trust,
                 image_format=image_format)
        return

    def push(tracker: Tracker | None = None) -> dict:
        return run_push(source, ref, registry, as_json, not stop, level, image_format,
                        trust, containerd_address, tracker=tracker)
    report_push(push, upload_state, as_json, human_push)


def report_push(push: Callable[[Tracker | None], dict], upload_state: str | None,
                as_json: bool, human: Callable[[dict], None]) -> None:
    """``push`` here, or as the background process of ``upload_state``; its
    result said, and the exit status a container left off its GPUs gets."""
    result = bg.background(upload_state, push) if upload_state else push(None)
    emit(as_json, result, human)
    if result.get("gpu_back_interrupted"):  # pushed; Ctrl-C cut the wait for its GPUs
        sys.exit(130)
    if result.get("gpu_back") is False:  # pushed, but the container is off its GPUs
        sys.exit(1)


COMMANDS = [push_cmd]
