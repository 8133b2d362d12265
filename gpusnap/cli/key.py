"""gpusnap key generate / id / export / trust"""

from __future__ import annotations

import os

import click

from gpusnap.cli.output import console, emit, handle_errors, json_option
from gpusnap.errors import GpusnapError
from gpusnap.trust import KEY_TYPES, PASSPHRASE_ENV


def _human_generate(r: dict) -> None:
    console.print(f"[bold green]Generated[/] an {r['type']} key pair: {r['private_key']} (0600"
                  f"{', passphrase-protected' if r['encrypted'] else ''}) and {r['public_key']}")
    console.print(f"  key id: {r['key_id']}")
    console.print(f"  sign with: gpusnap push --sign-key {r['private_key']} ...; trust it on a "
                  f"host: gpusnap key trust {r['public_key']}")


@click.group("key")
def key_group() -> None:
    """Key pairs for signing (and encrypting) checkpoints."""


@key_group.command("generate")
@click.option("--type", "key_type", type=click.Choice(KEY_TYPES), default="ed25519",
              show_default=True, help="ed25519 signs; ecdsa-p256 signs and is an encryption "
              "recipient (--encrypt-to). Use separate key pairs for the two.")
@click.option("-o", "--output", "prefix", required=True, metavar="PREFIX",
              help="Writes PREFIX.key (private, 0600) and PREFIX.pub (public).")
@click.option("--passphrase-file", metavar="FILE", help="Protect PREFIX.key with the passphrase "
              f"in FILE (else ${PASSPHRASE_ENV}, else none).")
@json_option
@handle_errors(root=False)
def generate_cmd(key_type: str, prefix: str, passphrase_file: str | None, as_json: bool) -> None:
    """Generate a key pair in standard PEM files (PKCS#8 / SubjectPublicKeyInfo)."""
    from gpusnap.trust import keys  # cryptography: only where keys are used
    key = keys.generate(key_type)
    passphrase = keys.passphrase_from(passphrase_file)
    priv, pub = keys.write_keypair(prefix, key, passphrase)
    emit(as_json, {"type": key_type, "private_key": str(priv), "public_key": str(pub),
                   "key_id": keys.key_id(key), "encrypted": passphrase is not None},
         _human_generate)


@key_group.command("id")
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--passphrase-file", metavar="FILE", help="For a passphrase-protected .key.")
@json_option
@handle_errors(root=False)
def id_cmd(file: str, passphrase_file: str | None, as_json: bool) -> None:
    """Print the id (sha256 of the public key) of a .pub or .key file, as
    signatures, policies and error lines name keys."""
    from gpusnap.trust import keys  # cryptography: only where keys are used
    try:
        with open(file, "rb") as f:
            private = b"PRIVATE KEY" in f.read()
    except OSError as exc:
        raise GpusnapError(f"cannot read {file}: {exc.strerror}") from None
    key = (keys.load_private_key(file, keys.passphrase_from(passphrase_file)) if private
           else keys.load_public_key(file))
    emit(as_json, {"file": file, "type": keys.kind(key), "key_id": keys.key_id(key)},
         lambda r: console.print(f"{r['key_id']}  {r['type']}  {r['file']}"))




@key_group.command("export")
@click.option("-o", "--output", metavar="FILE",
              help="Write the public key to FILE (else to stdout).")
@json_option
@handle_errors
def export_cmd(output: str | None, as_json: bool) -> None:
    """This host's public signing key (push and migrate sign with it unless
    told otherwise; made on first use). Copy it to another host and run
    `gpusnap key trust FILE` there: that host then restores what this one pushes."""
    from gpusnap.trust import hostkey, keys  # cryptography: only where keys are used
    key = hostkey.signing_key()
    pem, key_id = keys.public_pem(key), keys.key_id(key)
    if output:
        try:
            with open(output, "wb") as f:
                f.write(pem)
        except OSError as exc:
            raise GpusnapError(f"cannot write {output}: {exc.strerror}") from None
    elif not as_json:
        click.echo(pem.decode(), nl=False)
        return
    emit(as_json, {"key_id": key_id, "output": output, "public_key": pem.decode()},
         lambda r: console.print(f"Wrote this host's public key {r['key_id'][:19]} to "
                                 f"{r['output']}; on another host: gpusnap key trust "
                                 f"{r['output']}"))


@key_group.command("trust")
@click.argument("file", type=click.Path(dir_okay=False))
@json_option
@handle_errors
def trust_cmd(file: str, as_json: bool) -> None:
    """Trust checkpoints signed by the key in FILE (a .pub from `gpusnap key
    export` on the pushing host): restores here accept them. With a policy
    file (/etc/gpusnap/policy.json) the policy decides: add FILE to its keyPaths."""
    from gpusnap.trust import hostkey, policy  # cryptography: only where keys are used
    key_id, dest = hostkey.trust(file)
    note = None
    if policy.DEFAULT_PATH.exists() or os.environ.get(policy.POLICY_ENV):
        note = ("a policy file decides here, not the trusted keys: add the key to its "
                "keyPaths (docs/trust.md)")
    emit(as_json, {"key_id": key_id, "trusted": str(dest), "note": note},
         lambda r: console.print(f"[bold green]Trusted[/] key {r['key_id'][:19]} ({r['trusted']})"
                                 + (f"\n  [bold yellow]Note:[/] {r['note']}" if r['note'] else "")))


COMMANDS = [key_group]
