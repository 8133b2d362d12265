"""One layer encrypted the way ocicrypt encrypts image layers, for `push
--format podman --encrypt-to`: tools built on ocicrypt (skopeo, containerd's
imgcrypt, Podman releases with --decryption-key) can then decrypt it.

ocicrypt's cipher "AES_256_CTR_HMAC_SHA256": a random 32-byte key and 16-byte
nonce, AES-256-CTR over the (compressed) layer, HMAC-SHA256 keyed with the
same key over the ciphertext. The layer descriptor gets "+encrypted" and two
annotations: org.opencontainers.image.enc.keys.jwe (base64 of a JWE whose
plaintext is {"symkey", "digest" of the plain layer, "cipheroptions":
{"nonce"}}) and org.opencontainers.image.enc.pubopts ({"cipher", "hmac",
"cipheroptions"}). Byte values in these JSON documents are standard base64,
as Go encodes []byte.

No chunks and a random key per push: this format has no dedup anyway.
Streams: pieces go through update() as the layer is compressed and uploaded.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
from typing import Mapping, Sequence

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives import hmac as chmac
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from gpusnap.errors import GpusnapError
from gpusnap.trust import jwe, keys
from gpusnap.trust.encrypt import ANN_KEYS_JWE, ANN_PUBOPTS

CIPHER = "AES_256_CTR_HMAC_SHA256"


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


class LayerEncryptor:
    def __init__(self) -> None:
        self._key, self._nonce = os.urandom(32), os.urandom(16)
        self._ctr = Cipher(algorithms.AES(self._key), modes.CTR(self._nonce)).encryptor()
        self._mac = chmac.HMAC(self._key, hashes.SHA256())
        self._plain = hashlib.sha256()

    def __repr__(self) -> str:
        return "LayerEncryptor()"

    def update(self, piece: bytes) -> bytes:
        """Ciphertext of the next piece of the plain (compressed) layer."""
        self._plain.update(piece)
        out = self._ctr.update(piece)
        self._mac.update(out)
        return out

    def finish(self, recipients: Sequence[keys.PublicKey]) -> dict[str, str]:
        """The encrypted layer descriptor's annotations; call after the last piece."""
        self._ctr.finalize()
        tag = self._mac.finalize()
        private = {"symkey": _b64(self._key), "digest": "sha256:" + self._plain.hexdigest(),
                   "cipheroptions": {"nonce": _b64(self._nonce)}}
        # "hmac" at the top is what ocicrypt writes and reads; newer code also looks
        # in cipheroptions: both, so either version verifies it
        public = {"cipher": CIPHER, "hmac": _b64(tag), "cipheroptions": {"hmac": _b64(tag)}}
        wrapped = jwe.encrypt(json.dumps(private, separators=(",", ":")).encode(), recipients)
        return {ANN_KEYS_JWE: _b64(wrapped),
                ANN_PUBOPTS: _b64(json.dumps(public, separators=(",", ":")).encode())}


def decrypt_layer(blob: bytes, annotations: Mapping[str, str], private: keys.PrivateKey,
                  where: str) -> bytes:
    """The plain layer (whole, in memory: for tests and small layers): HMAC and
    plain digest checked before anything is returned."""
    try:
        public = json.loads(base64.b64decode(annotations[ANN_PUBOPTS]))
        jwe_bytes = base64.b64decode(annotations[ANN_KEYS_JWE].split(",")[0])
    except (KeyError, ValueError):
        raise GpusnapError(f"{where}: the layer's encryption annotations are missing or "
                           "damaged", "it is not an ocicrypt-encrypted layer") from None
    if public.get("cipher") != CIPHER:
        raise GpusnapError(f"{where}: layer cipher {public.get('cipher')!r} is not supported",
                           f"only {CIPHER}")
    opts = json.loads(jwe.decrypt(jwe_bytes, private, where))
    key = base64.b64decode(opts["symkey"])
    nonce = base64.b64decode(opts["cipheroptions"]["nonce"])
    expected = base64.b64decode(public.get("hmac") or public["cipheroptions"]["hmac"])
    if not hmac.compare_digest(hmac.new(key, blob, hashlib.sha256).digest(), expected):
        raise GpusnapError(f"{where}: the encrypted layer does not match its HMAC: it was "
                           "altered", "the registry's copy is damaged or tampered with")
    dec = Cipher(algorithms.AES(key), modes.CTR(nonce)).decryptor()
    plain = dec.update(blob) + dec.finalize()
    if "sha256:" + hashlib.sha256(plain).hexdigest() != opts.get("digest"):
        raise GpusnapError(f"{where}: the decrypted layer does not match its digest",
                           "the registry's copy is damaged or tampered with")
    return plain
