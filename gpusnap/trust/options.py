"""What the trust flags of push, migrate, pull, restore and inspect asked for:
file paths only. The keys are loaded by gpusnap/trust/remote.py when the
command runs (this module imports no `cryptography`: the CLI loads it at
start-up on hosts that may lack it)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TrustOptions:
    sign_keys: tuple[str, ...] = ()  # push: private keys to sign the manifest digest with
    encrypt_to: tuple[str, ...] = ()  # push: recipients' public keys
    decrypt_keys: tuple[str, ...] = ()  # pull/restore/inspect: recipients' private keys
    passphrase_file: str | None = None  # for passphrase-protected private keys
    skip_verify: bool = False  # pull/restore: --insecure-policy (or its old --insecure-skip-verify)
    no_sign: bool = False  # push: --no-sign, not even with this host's key (trust/hostkey.py)

    @property
    def signs(self) -> bool:
        """Whether the push signs: with --sign-key's keys, else this host's."""
        return not self.no_sign

    @property
    def encrypts(self) -> bool:
        return bool(self.encrypt_to)
