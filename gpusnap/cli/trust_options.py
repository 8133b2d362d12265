"""Trust flags (docs/trust.md): sign and encrypt on push and migrate; verify and
decrypt on pull and restore; decrypt (optional) on inspect. The command
receives one ``trust: TrustOptions``; keys are loaded when it runs."""

from __future__ import annotations

import functools
from typing import Callable

import click

from gpusnap.cli.output import err_console
from gpusnap.cli.registry_options import DEPRECATED, deprecated
from gpusnap.trust import PASSPHRASE_ENV
from gpusnap.trust.options import TrustOptions

# verify.SKIP_WARNING, without importing `cryptography` at start-up
SKIP_WARNING = ("signature verification skipped (--insecure-policy): this checkpoint "
                "runs as root with nobody vouching for it")
_PASSPHRASE = click.option("--passphrase-file", metavar="FILE",
                           help=f"Passphrase of the private keys (else ${PASSPHRASE_ENV}).")
_FLAGS = {
    "sign": click.option("--sign-key", "sign_keys", multiple=True, metavar="KEY",
                         type=click.Path(dir_okay=False),
                         help="Sign the pushed checkpoint with this private key (repeatable) "
                              "instead of this host's own (/etc/gpusnap/keys/host.key); "
                              "restores check signatures against the trust policy."),
    "nosign": click.option("--no-sign", "no_sign", is_flag=True,
                           help="Push it unsigned (a restore elsewhere then needs a policy "
                                "that accepts anything there, or --insecure-policy)."),
    "encrypt": click.option("--encrypt-to", "encrypt_to", multiple=True, metavar="PUBKEY",
                            type=click.Path(dir_okay=False),
                            help="Encrypt to this public key (P-256 or RSA, repeatable): only "
                                 "its private key can restore the checkpoint."),
    "decrypt": click.option("--decrypt-key", "decrypt_keys", multiple=True, metavar="KEY",
                            type=click.Path(dir_okay=False),
                            help="Private key of a recipient of an encrypted checkpoint "
                                 "(repeatable)."),
    # skopeo's name for "accept anything, no policy check"; the old spelling still works
    "skip": click.option("--insecure-policy", "skip_verify", is_flag=True,
                         help="Restore without checking the signature against the trust "
                              "policy (the checkpoint runs as root: only for testing)."),
    "skip-old": click.option("--insecure-skip-verify", "skip_verify_old", is_flag=True,
                             help=f"{DEPRECATED}: use --insecure-policy (still works)."),
}
KINDS = {"push": ("sign", "nosign", "encrypt"), "pull": ("decrypt", "skip", "skip-old"),
         "inspect": ("decrypt",)}


def trust_options(kind: str) -> Callable[[Callable], Callable]:
    """The flags of ``kind`` (push, pull, inspect) and --passphrase-file."""
    names = KINDS[kind]
    params = {"sign": "sign_keys", "nosign": "no_sign", "encrypt": "encrypt_to",
              "decrypt": "decrypt_keys",
              "skip": "skip_verify", "skip-old": "skip_verify_old"}

    def decorate(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            values = {params[n]: kwargs.pop(params[n]) for n in names}
            if values.pop("skip_verify_old", False):
                deprecated("--insecure-skip-verify", "--insecure-policy")
                values["skip_verify"] = True
            for key in ("sign_keys", "encrypt_to", "decrypt_keys"):
                if key in values:
                    values[key] = tuple(values[key])
            if values.get("no_sign") and values.get("sign_keys"):
                raise click.UsageError("--no-sign and --sign-key contradict each other")
            kwargs["trust"] = TrustOptions(passphrase_file=kwargs.pop("passphrase_file"),
                                           **values)
            return fn(*args, **kwargs)

        for option in reversed([_FLAGS[n] for n in names] + [_PASSPHRASE]):
            wrapper = option(wrapper)
        return wrapper
    return decorate


def warn_skipped(decision: dict) -> None:
    """Loud, on stderr (with --json too), once every check passed and before the
    download: a restore refused for another reason skipped nothing."""
    if decision.get("skipped"):
        err_console.print(f"[bold yellow]WARNING:[/] {SKIP_WARNING}", soft_wrap=True)


def trust_line(decision: dict | None) -> str | None:
    """One line for the human output of pull and restore."""
    if not decision:
        return None
    enc = "; decrypted" if decision.get("encrypted") else ""
    if decision.get("verified"):
        return (f"  signature: verified, key {decision.get('key_id', '')[:19]} "
                f"(policy {decision.get('policy')}, scope {decision.get('scope')}){enc}")
    if decision.get("skipped"):
        return f"  [bold yellow]signature: NOT verified[/] (--insecure-policy){enc}"
    return f"  [bold yellow]signature: not verified[/]: {decision.get('warning', '')}{enc}"
