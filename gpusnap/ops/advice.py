"""What a push, migrate or pull tells the user when it is done: what became of
the container, the command that restores what was sent (flags included, as
printed), and whether this host's trust policy would refuse that restore.
Computed here, in the library, for the CLI and for `--json` alike."""

from __future__ import annotations

import shlex
from pathlib import Path

from gpusnap.errors import GpusnapError
from gpusnap.oci import podman_image, reference
from gpusnap.oci.registry import RegistryClient, RegistryOptions
from gpusnap.trust.options import TrustOptions


def restore_flags(opts: RegistryOptions) -> list[str]:
    """The registry flags a restore of what was just pushed with ``opts`` needs
    (new spellings; a password is never repeated, --password-stdin asks for it)."""
    flags = []
    if opts.plain_http:
        flags.append("--plain-http")
    elif opts.insecure:
        flags.append("--tls-verify=false")
    elif opts.ca_file:
        flags += ["--ca-file", str(Path(opts.ca_file).absolute())]
    if opts.authfile:
        flags += ["--authfile", str(Path(opts.authfile).absolute())]
    if opts.username is not None:
        flags += ["--username", opts.username, "--password-stdin"]
    return flags


def gpusnap_command(args: list[str], opts: RegistryOptions) -> str:
    """`gpusnap ARGS` with the registry flags a restore or prefetch of what was
    pushed with ``opts`` needs, quoted for a shell."""
    return " ".join(shlex.quote(a) for a in ["gpusnap", *args, *restore_flags(opts)])


def push_command(source: str, ref_text: str, opts: RegistryOptions,
                 trust: TrustOptions | None, image_format: str,
                 containerd_address: str | None = None) -> str:
    """`gpusnap push SOURCE REF` with the flags a push with these options had."""
    args = ["push", source, ref_text]
    if image_format != "gpusnap":
        args += ["--format", image_format]
    if containerd_address and source.startswith("containerd://"):
        args += ["--containerd-address", containerd_address]
    for key in trust.sign_keys if trust else ():
        args += ["--sign-key", str(Path(key).absolute())]
    for key in trust.encrypt_to if trust else ():
        args += ["--encrypt-to", str(Path(key).absolute())]
    if trust and trust.no_sign:
        args.append("--no-sign")
    if trust and trust.passphrase_file:
        args += ["--passphrase-file", str(Path(trust.passphrase_file).absolute())]
    return gpusnap_command(args, opts)


def container_state(r: dict, leave_running: bool, pre_checkpoint: bool = False,
                    migrate: bool = False, uploading: bool = False) -> dict | None:
    """What the push (or ``migrate``) did to the container it checkpointed: a
    checkpoint that succeeded left it running or stopped it, as asked (no engine
    call: migrate's time is benchmarked; the tests compare this with Podman's word).
    ``uploading``: a background upload goes on (`--detach`)."""
    name = r.get("container")
    if not name:
        return None
    stopped = "stopped" if r.get("source_kind") == "containerd-container" else "exited"
    status = "running" if leave_running else stopped
    if status == "running" and pre_checkpoint:
        says = ("checkpointed and still running: a pre-copy round (`gpusnap migrate` without "
                "-P stops it and sends what changed since)")
    elif status == "running" and (migrate or uploading):
        says = "checkpointed and still running" + ("" if uploading else " (--leave-running)")
    elif status == "running":
        says = "checkpointed and still running (push copies; --stop moves it, as migrate does)"
    elif uploading:
        says = f"checkpointed and stopped ({status}); its state is being uploaded"
    else:
        says = f"checkpointed and stopped ({status}); its state now lives in {r['reference']}"
    return {"name": name, "status": status, "stopped": status != "running", "says": says}


def name_args(name: str | None) -> list[str]:
    """``--name NAME-2`` where a container named ``name`` exists here, else nothing."""
    from gpusnap.ops.restore import free_name  # start-up: CRIU and GPU code, for this line only

    return ["--name", new] if (new := free_name(name)) else []


def restore_command(r: dict, opts: RegistryOptions, trust: TrustOptions | None,
                    here: bool, containerd_address: str | None = None) -> tuple[str, str | None]:
    """The command that restores what was pushed, flags included; ``here``: on
    this host as it is now (a name in use gets --name); ``containerd_address``:
    the push's, where it named one. Also the name it avoided."""
    if r.get("format") == "podman":  # Podman restores it, with Podman's flags
        from gpusnap.ops.restore import free_name  # start-up: CRIU and GPU code, for this line only

        rename = free_name(r.get("container")) if here else None
        return podman_image.restore_command(r["reference"], opts, bool(
            (r.get("trust") or {}).get("encrypted")), rename=rename), \
            r.get("container") if rename else None
    args = ["gpusnap", "restore", r["pinned"], *restore_flags(opts)]
    if (r.get("trust") or {}).get("encrypted") or (trust and trust.encrypts):
        args += ["--decrypt-key", "KEY"]
    notes = r.get("annotations") or {}
    name = notes.get("io.gpusnap.container.name")
    renamed = None
    if notes.get("io.gpusnap.engine") == "containerd":  # into containerd: say where
        args += ["--to", _containerd_target(r.get("source") or "", name, here)]
        if containerd_address:  # the push's own containerd (k3s's, say), not the default socket
            args += ["--containerd-address", containerd_address]
    elif here and (other := name_args(name)):
        renamed = name
        args += other
    return " ".join(shlex.quote(a) if a != "KEY" else a for a in args), renamed


def _containerd_target(source: str, name: str | None, here: bool) -> str:
    """containerd://NS/ID for the restore: the pushed container's own namespace,
    and on this host (a copy: its container stays) another ID."""
    namespace = "default"
    if source.startswith("containerd://"):
        from gpusnap.ops.containerd_registry import parse_uri  # containerd pushes only

        namespace = parse_uri(source).namespace
    ident = name or "ID"
    return f"containerd://{namespace}/{ident}-2" if here and name else \
        f"containerd://{namespace}/{ident}"


def restore_file_command(path: str, name: str | None) -> str:
    """What restores a pulled archive here, as printed: --name where its
    container's name is taken on this host (as push's line has it)."""
    return " ".join(shlex.quote(a) for a in ["gpusnap", "restore", path, *name_args(name)])


def restore_refusal(r: dict, opts: RegistryOptions) -> dict | None:
    """Would this host's trust policy refuse `gpusnap restore` of what was just
    pushed? The same check restore makes (signature tag, policy), run now."""
    if r.get("format") == "podman":
        return None  # Podman's own policy decides
    from gpusnap.trust import remote  # cryptography: only where signatures are checked

    client = RegistryClient(reference.parse(r["pinned"]), opts)
    try:
        remote.check(client, r["digest"], None)
    except GpusnapError as exc:
        return {"error": exc.message, "hint": exc.hint}
    finally:
        client.close()
    return None


def after_push(r: dict, opts: RegistryOptions, trust: TrustOptions | None, here: bool,
               leave_running: bool, pre_checkpoint: bool,
               containerd_address: str | None = None) -> dict:
    """``r`` (a push's result) with what to tell the user: the container's state,
    the restore command (``here``: on this host; else on another one), the
    prefetch command after a pre-copy round, and this host's trust verdict."""
    r["container_state"] = container_state(r, leave_running or pre_checkpoint, pre_checkpoint,
                                           migrate=not here)
    r["restore_command"], r["restore_renamed"] = restore_command(r, opts, trust, here,
                                                                 containerd_address)
    if pre_checkpoint:
        r["prefetch_command"] = gpusnap_command(["pull", "--prefetch", r["pinned"]], opts)
    r["restore_refused"] = restore_refusal(r, opts)
    return r


def retaken(r: dict) -> str | None:
    """Why a --leave-running checkpoint was taken more than once, if it was."""
    again = r.get("retaken")
    if not again:
        return None
    return (f"taken {again['tries']} times: a file open at the dump changed before Podman "
            f"exported the root filesystem ({again['files'][0]})")
