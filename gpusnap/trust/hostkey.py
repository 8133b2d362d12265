"""This host's signing key, and the public keys it trusts with no policy file.

Trust that works on one host with no setup, and two commands to take it to
another: `make install` (or the first push) makes this host's key pair in
/etc/gpusnap/keys/ (host.key, 0600; host.pub) and trusts it, push and migrate
sign with it unless told otherwise, and with no /etc/gpusnap/policy.json a
restore accepts what a key in /etc/gpusnap/keys/trusted/ signed, nothing else.
On another host, `gpusnap key trust FILE.pub` (the file `gpusnap key export`
wrote here) adds this host's key there. ``GPUSNAP_KEYS_DIR`` moves the folder
(tests stand in for a second host with it).
"""

from __future__ import annotations

import os
from pathlib import Path

from gpusnap.errors import GpusnapError
from gpusnap.trust import keys

KEYS_ENV = "GPUSNAP_KEYS_DIR"
DEFAULT_DIR = Path("/etc/gpusnap/keys")
HOST = "host"  # host.key and host.pub in the folder
TRUSTED = "trusted"


def folder() -> Path:
    return Path(os.environ.get(KEYS_ENV) or DEFAULT_DIR)


def trusted_dir() -> Path:
    return folder() / TRUSTED


def private_path() -> Path:
    return folder() / f"{HOST}.key"


def ensure() -> Path:
    """This host's private signing key, made (and trusted here) on first use."""
    priv = private_path()
    if priv.exists():
        return priv
    try:
        folder().mkdir(mode=0o755, parents=True, exist_ok=True)
        keys.write_keypair(str(folder() / HOST), keys.generate("ed25519"))
    except GpusnapError:
        if not priv.exists():  # not another gpusnap making it at the same moment
            raise
    trust(folder() / f"{HOST}.pub")
    return priv


def signing_key() -> keys.PrivateKey:
    """This host's signing key, its key pair made first where missing."""
    return keys.load_private_key(ensure())


def trust(pub: str | Path) -> tuple[str, Path]:
    """Trust the public key in ``pub`` for restores with no policy file: copied
    into the trusted folder under its id. (key id, where it went)."""
    key = keys.load_public_key(pub)
    if keys.kind(key) not in keys.KEY_TYPES:
        raise GpusnapError(f"{pub} is a {keys.kind(key)} key, which cannot sign checkpoints",
                           "trust the .pub that `gpusnap key export` wrote on the pushing host")
    key_id = keys.key_id(key)
    dest = trusted_dir() / f"{key_id.removeprefix('sha256:')[:16]}.pub"
    try:
        trusted_dir().mkdir(mode=0o755, parents=True, exist_ok=True)
        partial = dest.with_suffix(".partial")
        partial.write_bytes(keys.public_pem(key))
        partial.chmod(0o644)
        partial.replace(dest)
    except OSError as exc:
        raise GpusnapError(f"cannot write {dest}: {exc.strerror}",
                           "run it as root: the folder decides what root restores") from None
    return key_id, dest


def trusted() -> dict[str, keys.PublicKey]:
    """The trusted public keys by id (none: no folder)."""
    found = {}
    try:
        files = sorted(trusted_dir().glob("*.pub"))
    except OSError:
        return {}
    for path in files:
        key = keys.load_public_key(path)
        found[keys.key_id(key)] = key
    return found
