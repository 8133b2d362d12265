"""gpusnap push"""

from __future__ import annotations

from typing import Callable

import click

from gpusnap.cli import containerd
from gpusnap.cli.output import console, emit, handle_errors, human_bytes, json_option
from gpusnap.cli.registry_options import registry_options, transfer_progress
from gpusnap.cli.trust_options import trust_options
from gpusnap.oci.registry import RegistryOptions
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


def human_push(r: dict) -> None:
    if r.get("format") == "podman":
        console.print(f"[bold green]Pushed[/] {r['reference']} as a Podman checkpoint image in "
                      f"{r['seconds']:.2f} s: {r['files']} files, {human_bytes(r['bytes'])}, "
                      f"one layer of {human_bytes(r['bytes_sent'])}")
        console.print(f"  digest: {r['digest']}")
        _trust_line(r)
        console.print(f"  restore with: {r['restore_command']}")
        return
    had = r["chunks"] - r["chunks_sent"]
    console.print(f"[bold green]Pushed[/] {r['reference']} in {r['seconds']:.2f} s: "
                  f"{r['files']} files, {human_bytes(r['bytes'])} in {r['chunks']} chunks; "
                  f"sent {r['chunks_sent']} chunks ({human_bytes(r['bytes_sent'])} compressed)"
                  + (f"; the other {had} were in the registry already or repeats" if had else ""))
    console.print(f"  digest: {r['digest']}")
    _trust_line(r)
    key = " --decrypt-key KEY" if (r.get("trust") or {}).get("encrypted") else ""
    notes = r.get("annotations") or {}
    if notes.get("io.gpusnap.engine") == "containerd":  # into containerd: say where
        key += f" --to containerd://NAMESPACE/{notes.get('io.gpusnap.container.name') or 'ID'}"
    console.print(f"  restore with: gpusnap restore {r['pinned']}{key}")


def run_push(source: str, ref: str, registry: Callable[[], RegistryOptions], as_json: bool,
             leave_running: bool, level: int, image_format: str = "gpusnap",
             trust: TrustOptions | None = None, containerd_address: str | None = None) -> dict:
    from gpusnap.ops import push as ops  # registry code: imported only when used

    with transfer_progress(as_json, f"Pushing {source}") as bar:
        def checkpointing(name: str) -> None:
            bar.describe(f"Checkpointing {name}")

        def pushing(total: int) -> None:
            bar.describe(f"Pushing {source}")
            bar.total(total)

        return ops.push(source, ref, registry(), leave_running=leave_running, level=level,
                        progress=bar.advance, total=pushing, on_checkpoint=checkpointing,
                        image_format=image_format, trust=trust,
                        containerd_address=containerd_address)


def checkpoint_options(fn: Callable) -> Callable:
    """Flags for a push that may checkpoint a container first (push, migrate)."""
    fn = click.option("--compression-level", "level", default=3, show_default=True,
                      type=click.IntRange(1, 19), help="zstd level of the chunks.")(fn)
    return click.option("-R", "--leave-running", is_flag=True,
                        help="A container is checkpointed first: keep it running "
                             "(a copy, not a move).")(fn)


@click.command("push")
@click.argument("source")
@click.argument("ref")
@checkpoint_options
@click.option("--format", "image_format", type=click.Choice(["gpusnap", "podman"]),
              default="gpusnap", show_default=True,
              help="gpusnap: chunks that later pushes and pulls reuse; podman: a checkpoint "
                   "image `podman container restore REF` takes (as --create-image makes).")
@containerd.address_option
@trust_options("push")
@registry_options
@json_option
@handle_errors
def push_cmd(source: str, ref: str, leave_running: bool, level: int, image_format: str,
             containerd_address: str | None, trust: TrustOptions,
             registry: Callable[[], RegistryOptions], as_json: bool) -> None:
    """Push a checkpoint to an OCI registry as REF (HOST[:PORT]/REPO:TAG).

    SOURCE is an exported archive, a checkpoint directory, or a running
    container (checkpointed first). Chunks the registry already has are not
    sent again. --sign-key signs it, --encrypt-to encrypts it (docs/trust.md).

    SOURCE containerd://[NAMESPACE/]NAME is a containerd container (checkpointed
    first, as `ctr c checkpoint --task --rw`; stopped unless --leave-running) or
    a checkpoint image `ctr c checkpoint --task` made; with a slash, the first
    segment is the namespace. `gpusnap restore REF --to containerd://NS/ID`
    restores it.
    """
    emit(as_json, run_push(source, ref, registry, as_json, leave_running, level, image_format,
                           trust, containerd_address), human_push)


COMMANDS = [push_cmd]
