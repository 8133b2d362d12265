"""JWE (RFC 7516) in its general JSON serialization, as ocicrypt's JWE key
wrap writes it (go-jose NewMultiEncrypter): content encrypted with A256GCM
under a random content key, that key wrapped for each recipient with
ECDH-ES+A256KW (P-256 keys) or RSA-OAEP (RSA keys). Only those two: they are
what ocicrypt makes for EC and RSA recipients, so a key pair works for both.

Each recipient's header carries its key id ("kid", see keys.key_id), so a
wrong key fails with the recipients' ids instead of trying every one.
"""

from __future__ import annotations

import base64
import json
import os
import struct
from typing import Sequence

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.concatkdf import ConcatKDFHash
from cryptography.hazmat.primitives.keywrap import InvalidUnwrap, aes_key_unwrap, aes_key_wrap

from gpusnap.errors import GpusnapError
from gpusnap.trust import keys

ECDH_ALG = "ECDH-ES+A256KW"
RSA_ALG = "RSA-OAEP"
ENC = "A256GCM"


def b64u(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def unb64u(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _coord(n: int) -> str:
    return b64u(n.to_bytes(32, "big"))


def _concat_kdf(shared: bytes, alg: str, apu: bytes, apv: bytes) -> bytes:
    """RFC 7518 4.6.2: the key-wrap key from the ECDH shared secret."""
    def part(b: bytes) -> bytes:
        return struct.pack(">I", len(b)) + b
    other = part(alg.encode()) + part(apu) + part(apv) + struct.pack(">I", 256)
    return ConcatKDFHash(hashes.SHA256(), 32, other).derive(shared)


def _wrap_for(recipient: keys.PublicKey, cek: bytes) -> dict:
    header: dict = {"kid": keys.key_id(recipient)}
    if isinstance(recipient, ec.EllipticCurvePublicKey) and isinstance(recipient.curve, ec.SECP256R1):
        eph = ec.generate_private_key(ec.SECP256R1())
        nums = eph.public_key().public_numbers()
        kek = _concat_kdf(eph.exchange(ec.ECDH(), recipient), ECDH_ALG, b"", b"")
        header.update(alg=ECDH_ALG, epk={"kty": "EC", "crv": "P-256", "x": _coord(nums.x),
                                         "y": _coord(nums.y)})
        return {"header": header, "encrypted_key": b64u(aes_key_wrap(kek, cek))}
    if isinstance(recipient, rsa.RSAPublicKey):
        header["alg"] = RSA_ALG
        wrapped = recipient.encrypt(cek, padding.OAEP(padding.MGF1(hashes.SHA1()),  # noqa: S303
                                                      hashes.SHA1(), None))  # RSA-OAEP is SHA-1 by definition (RFC 7518 4.3)
        return {"header": header, "encrypted_key": b64u(wrapped)}
    raise GpusnapError(f"a {keys.kind(recipient)} key cannot be an encryption recipient",
                       "encrypt to P-256 (`gpusnap key generate --type ecdsa-p256 -o NAME` "
                       "writes NAME.pub) or RSA keys")


def encrypt(plaintext: bytes, recipients: Sequence[keys.PublicKey]) -> bytes:
    if not recipients:
        raise GpusnapError("no recipient to encrypt to", "pass --encrypt-to PUBKEY")
    cek, iv = os.urandom(32), os.urandom(12)
    protected = b64u(json.dumps({"enc": ENC}, separators=(",", ":")).encode())
    sealed = AESGCM(cek).encrypt(iv, plaintext, protected.encode())
    doc = {"protected": protected, "recipients": [_wrap_for(r, cek) for r in recipients],
           "iv": b64u(iv), "ciphertext": b64u(sealed[:-16]), "tag": b64u(sealed[-16:])}
    return json.dumps(doc, separators=(",", ":")).encode()


def recipient_ids(jwe: bytes) -> list[str]:
    """The key ids the JWE was wrapped for ('' for a recipient without one)."""
    doc = _parse(jwe, "the JWE")
    return [str(_headers(doc, r).get("kid", "")) for r in doc["recipients"]]


def _parse(jwe: bytes, where: str) -> dict:
    try:
        doc = json.loads(jwe)
        if "recipients" not in doc:  # flattened serialization: one recipient
            doc["recipients"] = [{"header": doc.get("header", {}),
                                  "encrypted_key": doc.get("encrypted_key", "")}]
        for name in ("protected", "iv", "ciphertext", "tag"):
            if not isinstance(doc[name], str):
                raise TypeError(name)
        if not isinstance(doc["recipients"], list):
            raise TypeError("recipients")
        return doc
    except (ValueError, KeyError, TypeError, AttributeError):
        raise GpusnapError(f"{where} is not a JWE in JSON serialization",
                           "the encrypted checkpoint's key annotation is damaged") from None


def _headers(doc: dict, recipient: dict) -> dict:
    """Protected, shared and per-recipient headers merged (go-jose moves a single
    recipient's header into the protected one)."""
    merged = dict(json.loads(unb64u(doc["protected"])))
    merged.update(doc.get("unprotected") or {})
    merged.update(recipient.get("header") or {})
    return merged


def _unwrap(private: keys.PrivateKey, header: dict, encrypted_key: bytes) -> bytes | None:
    """The content key, or None when this private key is not this recipient's."""
    alg = header.get("alg")
    try:
        if alg == ECDH_ALG and isinstance(private, ec.EllipticCurvePrivateKey):
            epk = header["epk"]
            if epk.get("crv") != "P-256" or not isinstance(private.curve, ec.SECP256R1):
                return None
            # from_encoded_point-style check: a point off the curve is refused here
            eph = ec.EllipticCurvePublicNumbers(int.from_bytes(unb64u(epk["x"]), "big"),
                                                int.from_bytes(unb64u(epk["y"]), "big"),
                                                ec.SECP256R1()).public_key()
            kek = _concat_kdf(private.exchange(ec.ECDH(), eph), ECDH_ALG,
                              unb64u(header.get("apu", "")), unb64u(header.get("apv", "")))
            return aes_key_unwrap(kek, encrypted_key)
        if alg == RSA_ALG and isinstance(private, rsa.RSAPrivateKey):
            return private.decrypt(encrypted_key, padding.OAEP(padding.MGF1(hashes.SHA1()),  # noqa: S303
                                                               hashes.SHA1(), None))
    except (InvalidUnwrap, ValueError, KeyError, TypeError):
        return None
    return None


def decrypt(jwe: bytes, private: keys.PrivateKey, where: str) -> bytes:
    """The plaintext, if ``private`` is one of the recipients; else one clear error."""
    doc = _parse(jwe, where)
    mine = keys.key_id(private)
    recipients = doc["recipients"]
    # the recipient named by our key id first, then those without a kid
    order = sorted(recipients, key=lambda r: _headers(doc, r).get("kid") != mine)
    for r in order:
        header = _headers(doc, r)
        if header.get("kid") not in (None, mine):
            continue
        if header.get("enc") != ENC:
            raise GpusnapError(f"{where}: content encryption {header.get('enc')!r} is not "
                               f"supported (only {ENC})", "it was encrypted by another tool")
        try:
            cek = _unwrap(private, header, unb64u(str(r.get("encrypted_key", ""))))
        except ValueError:
            cek = None
        if cek is None or len(cek) != 32:
            continue
        aad = doc["protected"].encode()
        if doc.get("aad"):
            aad += b"." + doc["aad"].encode()
        try:
            return AESGCM(cek).decrypt(unb64u(doc["iv"]), unb64u(doc["ciphertext"])
                                       + unb64u(doc["tag"]), aad)
        except (InvalidTag, ValueError):
            raise GpusnapError(f"{where}: the wrapped key does not decrypt: it was altered",
                               "the registry's copy is damaged or tampered with; nothing was "
                               "restored") from None
    ids = ", ".join(keys.short_id(str(_headers(doc, r).get("kid") or "?")) for r in recipients)
    raise GpusnapError(f"{where} is not encrypted to key {keys.short_id(mine)} "
                       f"(its recipients: {ids})",
                       "pass --decrypt-key with the private key of one of its recipients")
