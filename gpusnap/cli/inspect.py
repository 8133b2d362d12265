"""gpusnap inspect"""

from __future__ import annotations

from pathlib import Path

import click

from gpusnap import archive
from gpusnap.cli.output import console, emit, handle_errors, human_bytes, json_option, step
from gpusnap.cli.registry_options import registry_options
from gpusnap.cli.trust_options import trust_options
from gpusnap.errors import GpusnapError
from gpusnap.oci import reference
from gpusnap.runtime import podman
from gpusnap.trust.options import TrustOptions


def _human_trust(t: dict | None) -> None:
    """Signed and encrypted, as the registry holds it (inspect verifies nothing)."""
    if t is None:
        return
    if t["signed"]:
        ids = ", ".join(k[:19] for k in t["signature_key_ids"]) or "no key id"
        console.print(f"  signed: yes, by {ids} (not verified here: restore checks it "
                      "against the trust policy)")
    else:
        console.print("  signed: no")
    if t["encrypted"]:
        ids = ", ".join(k[:19] for k in t["recipients"]) or "unnamed keys"
        console.print(f"  encrypted: yes, to {ids}")
    else:
        console.print("  encrypted: no")


def _human_sealed(r: dict) -> None:
    c = r["container"]
    reg = r["registry"]
    notes = reg["annotations"]
    console.print(f"[bold]{r['source']}[/]: an encrypted checkpoint")
    console.print(f"  registry: {reg['digest']}, pushed {reg['created']}, {reg['layers']} chunks, "
                  f"{human_bytes(reg['stored_bytes'])} stored")
    console.print(f"  container: {c['name']}, image {c['image']}, runtime {r['runtime']}; "
                  f"total {human_bytes(r['total_bytes'])}; {r['gpu_count']} GPU(s) "
                  f"{notes.get('io.gpusnap.gpu.names', '')}".rstrip())
    _human_trust(r["trust"])
    console.print("  files, processes and GPU details are in the encrypted config: pass "
                  "--decrypt-key KEY to see them")


def _human_podman(r: dict) -> None:
    c = r["container"]
    console.print(f"[bold]{r['source']}[/]: a Podman checkpoint image")
    _human_trust(r.get("trust"))
    console.print(f"  container: {c['name']}, image {c['image']}, runtime {r['runtime']}, "
                  f"CRIU {r['criu_version'] or '?'}, Podman {r['podman_version'] or '?'}, "
                  f"{r['host']['arch']}; {human_bytes(r['stored_bytes'])} stored")
    console.print(f"  restore with: {r['restore']}")


def _human(r: dict) -> None:
    if r.get("format") == "podman":
        _human_podman(r)
        return
    if r.get("sealed"):
        _human_sealed(r)
        return
    c = r["container"]
    console.print(f"[bold]{r['source']}[/]")
    reg = r.get("registry")
    if reg:
        console.print(f"  registry: {reg['digest']}, pushed {reg['created']}, {reg['files']} files "
                      f"in {reg['chunks']} chunks, {human_bytes(reg['stored_bytes'])} stored")
        _human_trust(r.get("trust"))
    engine = ""
    if r.get("engine") == "containerd":
        cd = r.get("containerd") or {}
        engine = (f" under containerd (namespace {cd.get('namespace') or '?'}, snapshotter "
                  f"{cd.get('snapshotter') or '?'}); restore with --to containerd://NS/ID")
    console.print(f"  container: {c['name']} ({(c['id'] or '')[:12]}), image {c['image']}, "
                  f"runtime {r['runtime']}{engine}")
    crit = r["criu"]
    console.print(f"  CRIU images: {crit['processes']} process(es), memory "
                  f"{human_bytes(crit['memory_pages_bytes'])}, images "
                  f"{human_bytes(crit['images_bytes'])}; rootfs diff "
                  f"{human_bytes(r['rootfs_diff_bytes'])}; total {human_bytes(r['total_bytes'])}")
    if r["devices"]:
        console.print(f"  devices: {', '.join(r['devices'])}")
    gpu = r["gpu"]
    if gpu is None:
        console.print("  GPU: none (no gpusnap manifest)")
        return
    console.print(f"  GPU: driver {gpu['driver']} (CUDA {gpu['cuda']}), CRIU {gpu['criu']}, "
                  f"host {gpu['host'].get('hostname')}, quiesced by {gpu['quiesced_by']}")
    for g in gpu["gpus"]:
        console.print(f"    GPU {g['index']}: {g['name']} {g['uuid']} (cc {g['compute_capability']}, "
                      f"{human_bytes(g['memory_total'])}, bus {g['pci_bus_id']})")
    for p in gpu["processes"]:
        used = sum(p["gpu_memory"].values())
        console.print(f"    pid {p['pid']} ({p['comm']}): {human_bytes(used)} of GPU memory")


@click.command("inspect")
@click.argument("source")
@trust_options("inspect")
@registry_options
@json_option
@handle_errors
def inspect_cmd(source: str, trust: TrustOptions, registry, as_json: bool) -> None:
    """Show what a checkpoint holds: processes, sizes, GPUs, versions.

    SOURCE is an exported archive, a checkpoint directory, a checkpointed
    container, or a registry reference (only its manifest and config are read;
    it says whether it is signed and encrypted, to whom; --decrypt-key opens an
    encrypted config).
    """
    if Path(source).exists():
        contents = archive.read(source)
    elif podman.exists(source):
        ctr = podman.inspect(source)
        if not ctr.checkpoint_dir.is_dir():
            raise GpusnapError(f"container {ctr.name} has no checkpoint",
                               "checkpoint it with `gpusnap checkpoint`")
        contents = archive.read_directory(ctr.userdata)
    elif reference.names_registry(source):  # parsed strictly there: a typo is named
        from gpusnap.ops import pull  # registry code: imported only when used

        with step(f"Reading {source}...", as_json):
            result = pull.inspect(source, registry(), trust)
        emit(as_json, result, _human)
        return
    else:
        raise GpusnapError(f"{source}: no such file, directory or container",
                           "pass an archive from `gpusnap checkpoint --export` or a checkpointed "
                           "container's name (`podman ps -a`)")
    emit(as_json, contents.summary(), _human)


COMMANDS = [inspect_cmd]
