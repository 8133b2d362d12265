"""The --format podman layer, encrypted as ocicrypt does (AES-256-CTR +
HMAC-SHA256, JWE-wrapped options): round trip, tampering, the option shapes."""

from __future__ import annotations

import base64
import json
import os

import pytest

from gpusnap.errors import GpusnapError
from gpusnap.trust import jwe, keys
from gpusnap.trust.encrypt import ANN_KEYS_JWE, ANN_PUBOPTS
from gpusnap.trust.ocicrypt_layer import CIPHER, LayerEncryptor, decrypt_layer

SECRET = b"PLANTED-layer-secret"


def encrypt(layer: bytes, recipients, piece: int = 1000):
    e = LayerEncryptor()
    blob = b"".join(e.update(layer[i:i + piece]) for i in range(0, len(layer), piece))
    return blob, e.finish(recipients)


def test_round_trip_streamed_and_shapes():
    key = keys.generate("ecdsa-p256")
    layer = os.urandom(5000) + SECRET * 100
    blob, notes = encrypt(layer, [key.public_key()])
    assert len(blob) == len(layer) and SECRET not in blob  # CTR: same length
    assert decrypt_layer(blob, notes, key, "r") == layer
    public = json.loads(base64.b64decode(notes[ANN_PUBOPTS]))
    assert public["cipher"] == CIPHER == "AES_256_CTR_HMAC_SHA256"
    assert len(base64.b64decode(public["hmac"])) == 32
    private = json.loads(jwe.decrypt(base64.b64decode(notes[ANN_KEYS_JWE]), key, "r"))
    assert set(private) == {"symkey", "digest", "cipheroptions"}
    assert len(base64.b64decode(private["symkey"])) == 32
    assert len(base64.b64decode(private["cipheroptions"]["nonce"])) == 16
    assert "LayerEncryptor()" == repr(LayerEncryptor())


def test_every_key_is_fresh():
    key = keys.generate("ecdsa-p256")
    a, _ = encrypt(b"same layer" * 100, [key.public_key()])
    b, _ = encrypt(b"same layer" * 100, [key.public_key()])
    assert a != b


def test_tampered_layer_or_wrong_key_refused():
    key = keys.generate("ecdsa-p256")
    layer = os.urandom(300)
    blob, notes = encrypt(layer, [key.public_key()])
    for i in (0, 150, len(blob) - 1):
        bad = bytearray(blob)
        bad[i] ^= 1
        with pytest.raises(GpusnapError, match="does not match its HMAC"):
            decrypt_layer(bytes(bad), notes, key, "r")
    with pytest.raises(GpusnapError, match="is not encrypted to key"):
        decrypt_layer(blob, notes, keys.generate("ecdsa-p256"), "r")
    with pytest.raises(GpusnapError, match="annotations are missing"):
        decrypt_layer(blob, {}, key, "r")
