"""gpusnap key generate / gpusnap key id"""

from __future__ import annotations

import click

from gpusnap.cli.output import console, emit, handle_errors, json_option
from gpusnap.errors import GpusnapError
from gpusnap.trust import KEY_TYPES, PASSPHRASE_ENV


def _human_generate(r: dict) -> None:
    console.print(f"[bold green]Generated[/] an {r['type']} key pair: {r['private_key']} (0600"
                  f"{', passphrase-protected' if r['encrypted'] else ''}) and {r['public_key']}")
    console.print(f"  key id: {r['key_id']}")
    console.print(f"  sign with: gpusnap push --sign-key {r['private_key']} ...; trust it: add "
                  f"{r['public_key']} to keyPaths in /etc/gpusnap/policy.json")


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


COMMANDS = [key_group]
