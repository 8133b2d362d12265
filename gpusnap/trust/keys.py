"""Keys in standard PEM files: private keys PKCS#8 (optionally under a
passphrase), public keys SubjectPublicKeyInfo, as openssl, cosign and ocicrypt
read them.

Signing keys are Ed25519 or ECDSA P-256; encryption recipients are P-256 or
RSA (>= 2048 bits), the two kinds ocicrypt's JWE key wrap takes. A key id is
"sha256:" + the hex sha256 of the public key's DER: the same for the .key and
the .pub, and what policies, signatures and error lines name.

No key byte or passphrase ever goes into an exception or a repr: errors name
the file and what is wrong with it.
"""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path
from typing import Union

from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa

from gpusnap.errors import GpusnapError
from gpusnap.trust import KEY_TYPES, PASSPHRASE_ENV  # noqa: F401 -- re-exported

MIN_RSA_BITS = 2048

PrivateKey = Union[ed25519.Ed25519PrivateKey, ec.EllipticCurvePrivateKey, rsa.RSAPrivateKey]
PublicKey = Union[ed25519.Ed25519PublicKey, ec.EllipticCurvePublicKey, rsa.RSAPublicKey]


def generate(key_type: str = "ed25519") -> PrivateKey:
    if key_type == "ed25519":
        return ed25519.Ed25519PrivateKey.generate()
    if key_type == "ecdsa-p256":
        return ec.generate_private_key(ec.SECP256R1())
    raise GpusnapError(f"unknown key type {key_type!r}", f"pass one of {', '.join(KEY_TYPES)}")


def kind(key: PrivateKey | PublicKey) -> str:
    """'ed25519', 'ecdsa-p256', 'rsa-N', or what else it is (for error lines)."""
    if isinstance(key, (ed25519.Ed25519PrivateKey, ed25519.Ed25519PublicKey)):
        return "ed25519"
    if isinstance(key, (ec.EllipticCurvePrivateKey, ec.EllipticCurvePublicKey)):
        return "ecdsa-p256" if isinstance(key.curve, ec.SECP256R1) else f"ec-{key.curve.name}"
    if isinstance(key, (rsa.RSAPrivateKey, rsa.RSAPublicKey)):
        return f"rsa-{key.key_size}"
    return type(key).__name__


def public_of(key: PrivateKey | PublicKey) -> PublicKey:
    return key.public_key() if hasattr(key, "private_bytes") else key  # type: ignore[union-attr]


def public_der(key: PrivateKey | PublicKey) -> bytes:
    return public_of(key).public_bytes(serialization.Encoding.DER,
                                       serialization.PublicFormat.SubjectPublicKeyInfo)


def key_id(key: PrivateKey | PublicKey) -> str:
    return "sha256:" + hashlib.sha256(public_der(key)).hexdigest()


def short_id(kid: str) -> str:
    """What error lines show: enough to tell keys apart."""
    return kid[:19]


def private_pem(key: PrivateKey, passphrase: bytes | None = None) -> bytes:
    enc = (serialization.BestAvailableEncryption(passphrase) if passphrase
           else serialization.NoEncryption())
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, enc)


def public_pem(key: PrivateKey | PublicKey) -> bytes:
    return public_of(key).public_bytes(serialization.Encoding.PEM,
                                       serialization.PublicFormat.SubjectPublicKeyInfo)


def passphrase_from(file: str | None = None) -> bytes | None:
    """The passphrase of a private key: --passphrase-file, else $GPUSNAP_KEY_PASSPHRASE.
    Never a command-line value: `ps` shows those to every user."""
    if file:
        try:
            text = Path(file).read_bytes()
        except OSError as exc:
            raise GpusnapError(f"cannot read the passphrase file {file}: {exc.strerror}") from None
        return text.rstrip(b"\r\n") or None
    env = os.environ.get(PASSPHRASE_ENV)
    return env.encode() if env else None


def write_keypair(prefix: str, key: PrivateKey, passphrase: bytes | None = None) -> tuple[Path, Path]:
    """PREFIX.key (0600, created, never overwritten) and PREFIX.pub."""
    priv, pub = Path(prefix + ".key"), Path(prefix + ".pub")
    try:
        for p in (priv, pub):
            if p.exists():
                raise GpusnapError(f"{p} exists already",
                                   "remove it or pick another --output prefix")
        if not priv.absolute().parent.is_dir():
            raise GpusnapError(f"cannot write {priv}: {priv.absolute().parent} does not exist")
        fd = os.open(priv, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(private_pem(key, passphrase))
        os.chmod(priv, 0o600)  # the umask may have taken bits; never more than 0600
        pub.write_bytes(public_pem(key))
    except OSError as exc:  # a folder this user cannot enter or write, say
        raise GpusnapError(f"cannot write the key pair {prefix}.key/.pub: {exc.strerror}",
                           "pick an --output prefix in a folder you can write") from None
    return priv, pub


def _read(path: str | Path, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise GpusnapError(f"cannot read the {what} {path}: {exc.strerror}",
                           "`gpusnap key generate --output PREFIX` makes a key pair") from None


def load_private_key(path: str | Path, passphrase: bytes | None = None, *,
                     only_if_protected: bool = False) -> PrivateKey:
    """A private key (PKCS#8 or traditional PEM); refused when other users can read it.
    ``only_if_protected``: the passphrase goes to a protected key only (one
    passphrase for several keys, some in the clear)."""
    data = _read(path, "private key")
    if only_if_protected and b"ENCRYPTED" not in data:
        passphrase = None
    if b"PRIVATE KEY" not in data:
        hint = ("that is a public key: pass the .key file" if b"PUBLIC KEY" in data
                else "pass a PEM private key, as `gpusnap key generate` writes")
        raise GpusnapError(f"{path} is not a PEM private key", hint)
    mode = _mode(path)
    if mode is not None and mode & 0o077:
        raise GpusnapError(f"the private key {path} can be read by other users "
                           f"(mode {mode:04o})", f"chmod 600 {path}")
    try:
        key = serialization.load_pem_private_key(data, password=passphrase)
    except TypeError:  # encrypted without a passphrase, or a passphrase for a clear key
        if passphrase is None:
            raise GpusnapError(f"the private key {path} is protected by a passphrase",
                               f"set {PASSPHRASE_ENV} or pass --passphrase-file") from None
        raise GpusnapError(f"the private key {path} has no passphrase, but one was given",
                           f"unset {PASSPHRASE_ENV} / drop --passphrase-file") from None
    except (ValueError, UnsupportedAlgorithm):
        # cryptography says the same for a damaged file and a wrong passphrase
        raise GpusnapError(f"cannot load the private key {path}: a wrong passphrase, or the "
                           "file is damaged or of an unsupported type",
                           "check the passphrase; keys are PKCS#8 PEM Ed25519, P-256 or RSA")\
            from None
    _check_type(key, path)
    return key  # type: ignore[return-value]


def load_public_key(path: str | Path | None = None, data: bytes | None = None,
                    where: str | None = None) -> PublicKey:
    """A SubjectPublicKeyInfo PEM public key, from a file or inline bytes."""
    where = where or str(path)
    if data is None:
        data = _read(path, "public key")  # type: ignore[arg-type]
    if b"PRIVATE KEY" in data:
        raise GpusnapError(f"{where} holds a private key where a public key belongs",
                           "pass the .pub file; keep the .key on the machine that signs or "
                           "decrypts")
    try:
        key = serialization.load_pem_public_key(data)
    except (ValueError, UnsupportedAlgorithm):
        raise GpusnapError(f"{where} is not a PEM public key",
                           "pass a .pub file as `gpusnap key generate` or `openssl pkey -pubout` "
                           "writes") from None
    _check_type(key, where)
    return key  # type: ignore[return-value]


def _check_type(key: object, where: object) -> None:
    ok = isinstance(key, (ed25519.Ed25519PrivateKey, ed25519.Ed25519PublicKey)) or (
        isinstance(key, (ec.EllipticCurvePrivateKey, ec.EllipticCurvePublicKey))
        and isinstance(key.curve, ec.SECP256R1)) or (
        isinstance(key, (rsa.RSAPrivateKey, rsa.RSAPublicKey)) and key.key_size >= MIN_RSA_BITS)
    if not ok:
        raise GpusnapError(f"{where} is a {kind(key)} key, which gpusnap does not take",
                           "use Ed25519 or ECDSA P-256 (signing), P-256 or RSA >= 2048 bits "
                           "(encryption)")


def _mode(path: str | Path) -> int | None:
    try:
        return stat.S_IMODE(os.stat(path).st_mode)
    except OSError:
        return None  # _read says why
