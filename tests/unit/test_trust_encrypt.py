"""Chunk encryption: convergent (dedup survives), authenticated (any changed
byte is refused), the data key wrapped per recipient (JWE, P-256 and RSA)."""

from __future__ import annotations

import base64
import functools
import hashlib
import json
import os
import random
import stat

import pytest
import zstandard
from cryptography.hazmat.primitives.asymmetric import rsa

from gpusnap.errors import GpusnapError
from gpusnap.trust import encrypt as enc
from gpusnap.trust import jwe, keys

SECRET = b"PLANTED-SECRET-TOKEN-0123456789"


def raw_chunk(n: int = 256 << 10, seed: int = 1) -> bytes:
    """Memory-like data: some random pages, some repeats of a planted secret."""
    rnd = hashlib.sha256(str(seed).encode()).digest() * (n // 64)
    return (rnd[: n // 2] + SECRET * (n // 2 // len(SECRET) + 1))[:n]


def digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def test_chunk_round_trip_through_zstd_and_no_plaintext_left():
    cipher = enc.ChunkCipher(os.urandom(32))
    raw = raw_chunk()
    frame = zstandard.ZstdCompressor(level=3).compress(raw)
    blob = cipher.seal_chunk(digest(raw), frame)
    assert len(blob) == len(frame) + enc.OVERHEAD
    assert SECRET not in blob and SECRET[:12] not in blob
    back = zstandard.ZstdDecompressor().decompress(cipher.open_chunk(digest(raw), blob, "ref"))
    assert back == raw


def test_convergent_same_key_same_blob_other_key_other_blob():
    key = os.urandom(32)
    raw = raw_chunk()
    a = enc.ChunkCipher(key).seal_chunk(digest(raw), raw)
    assert enc.ChunkCipher(key).seal_chunk(digest(raw), raw) == a  # another push: dedup
    assert enc.ChunkCipher(os.urandom(32)).seal_chunk(digest(raw), raw) != a
    other = raw_chunk(seed=2)
    assert enc.ChunkCipher(key).seal_chunk(digest(other), other)[:12] != a[:12]


def test_other_frame_of_the_same_chunk_gets_another_nonce():
    """The key follows the raw digest; a different zstd level is a different
    plaintext under that key, and must never reuse its nonce."""
    cipher = enc.ChunkCipher(os.urandom(32))
    rnd = random.Random(7)
    raw = " ".join(rnd.choice(["page", "tensor", "weight", "kv", "cache", "0x7f"])
                   for _ in range(50000)).encode()
    f1 = zstandard.ZstdCompressor(level=1).compress(raw)
    f19 = zstandard.ZstdCompressor(level=19).compress(raw)
    assert f1 != f19
    b1, b19 = cipher.seal_chunk(digest(raw), f1), cipher.seal_chunk(digest(raw), f19)
    assert b1[:enc.NONCE] != b19[:enc.NONCE]
    assert cipher.open_chunk(digest(raw), b19, "ref") == f19


def test_any_changed_byte_is_refused():
    cipher = enc.ChunkCipher(os.urandom(32))
    raw = b"small chunk of process memory" * 3
    blob = cipher.seal_chunk(digest(raw), raw)
    for i in range(len(blob)):
        bad = bytearray(blob)
        bad[i] ^= 0x80
        with pytest.raises(GpusnapError, match=r"does not decrypt: it was altered"):
            cipher.open_chunk(digest(raw), bad, "reg/app:v1")
    for cut in (blob[:-1], blob[:enc.OVERHEAD - 1], b""):
        with pytest.raises(GpusnapError, match="does not decrypt"):
            cipher.open_chunk(digest(raw), cut, "reg/app:v1")
    with pytest.raises(GpusnapError, match="does not decrypt"):  # swapped for another chunk
        cipher.open_chunk(digest(b"other"), blob, "reg/app:v1")
    with pytest.raises(GpusnapError, match="does not decrypt"):  # the wrong data key
        enc.ChunkCipher(os.urandom(32)).open_chunk(digest(raw), blob, "reg/app:v1")


def test_config_sealed_deterministically():
    cipher = enc.ChunkCipher(os.urandom(32))
    config = json.dumps({"files": [{"path": "checkpoint/pages-1.img",
                                    "chunks": [[digest(b"x"), 1, "b", 2]]}]}).encode()
    blob = cipher.seal_config(config)
    assert blob == cipher.seal_config(config) and b"pages-1.img" not in blob
    assert cipher.open_config(blob, "ref") == config
    with pytest.raises(GpusnapError, match="config does not decrypt"):
        cipher.open_config(blob[:-1] + bytes([blob[-1] ^ 1]), "ref")
    with pytest.raises(GpusnapError, match="does not decrypt"):  # a chunk key cannot open it
        cipher.open_chunk("config", blob, "ref")


def test_cipher_hides_its_key_and_namespaces_the_cache():
    key = os.urandom(32)
    cipher = enc.ChunkCipher(key)
    assert key.hex() not in repr(cipher) and key.hex() not in cipher.key_id
    d = digest(b"chunk")
    assert cipher.cache_index(d) != d
    assert cipher.cache_index(d) == enc.ChunkCipher(key).cache_index(d)
    assert cipher.cache_index(d) != enc.ChunkCipher(os.urandom(32)).cache_index(d)
    with pytest.raises(GpusnapError, match="not 32 bytes"):
        enc.ChunkCipher(b"short")


def test_data_key_follows_the_recipient_set(tmp_path):
    a, b, c = (keys.generate("ecdsa-p256").public_key() for _ in range(3))
    secret = enc.host_secret(tmp_path / "lib" / "secret")
    assert enc.data_key_for([a, b], secret) == enc.data_key_for([b, a, b], secret)
    assert enc.data_key_for([a, b], secret) != enc.data_key_for([a, b, c], secret)
    assert enc.data_key_for([a, b], secret) != enc.data_key_for([a, b], os.urandom(32))
    with pytest.raises(GpusnapError, match="no recipient"):
        enc.data_key_for([], secret)


def test_host_secret_is_root_only_and_kept(tmp_path, monkeypatch):
    path = tmp_path / "var" / "lib" / "gpusnap" / "data-key.secret"
    monkeypatch.setenv(enc.SECRET_ENV, str(path))
    first = enc.host_secret()
    assert len(first) == 32 and enc.host_secret() == first
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(path.parent).st_mode) == 0o700
    assert os.listdir(path.parent) == ["data-key.secret"]  # no temporary file left
    path.write_bytes(b"12345")
    with pytest.raises(GpusnapError, match="damaged"):
        enc.host_secret()


@functools.lru_cache(maxsize=1)
def _rsa_key() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(65537, 2048)  # slow to make: one for the module


def recipients():
    return keys.generate("ecdsa-p256"), _rsa_key()


def test_wrapped_data_key_for_each_recipient():
    ec_key, rsa_key = recipients()
    data_key = os.urandom(32)
    notes = enc.config_annotations(data_key, [ec_key.public_key(), rsa_key.public_key()])
    assert set(notes) == {enc.ANN_KEYS_JWE, enc.ANN_PUBOPTS, enc.ANN_RECIPIENTS}
    assert json.loads(base64.b64decode(notes[enc.ANN_PUBOPTS]))["cipher"] == enc.SCHEME
    assert data_key.hex() not in json.dumps(notes)
    assert base64.b64encode(data_key).decode() not in json.dumps(notes)
    for k in (ec_key, rsa_key):
        assert enc.unwrap_data_key(notes, k, "reg/app:v1") == data_key
    assert enc.recipients_of(notes, "r") == [keys.key_id(ec_key), keys.key_id(rsa_key)]


def test_wrong_decryption_key_is_one_clear_line():
    ec_key, _ = recipients()
    data_key = os.urandom(32)
    notes = enc.config_annotations(data_key, [ec_key.public_key()])
    wrong = keys.generate("ecdsa-p256")
    with pytest.raises(GpusnapError) as e:
        enc.unwrap_data_key(notes, wrong, "reg/app:v1")
    msg = str(e.value)
    assert msg.startswith(f"reg/app:v1 is not encrypted to key {keys.short_id(keys.key_id(wrong))} "
                          f"(its recipients: {keys.short_id(keys.key_id(ec_key))})")
    assert "--decrypt-key" in e.value.hint and "\n" not in msg
    assert base64.b64encode(data_key).decode() not in msg + repr(e.value)


def test_recipient_without_key_id_is_still_tried_and_wrong_key_refused():
    """ocicrypt's JWE carries no kid: every recipient is tried."""
    ec_key, _ = recipients()
    doc = json.loads(jwe.encrypt(b'{"symkey":"x"}', [ec_key.public_key()]))
    del doc["recipients"][0]["header"]["kid"]
    raw = json.dumps(doc).encode()
    assert jwe.decrypt(raw, ec_key, "r") == b'{"symkey":"x"}'
    with pytest.raises(GpusnapError, match=r"is not encrypted to key .*\(its recipients: \?\)"):
        jwe.decrypt(raw, keys.generate("ecdsa-p256"), "r")


def test_tampered_or_foreign_key_annotations():
    ec_key, _ = recipients()
    notes = enc.config_annotations(os.urandom(32), [ec_key.public_key()])
    doc = json.loads(base64.b64decode(notes[enc.ANN_KEYS_JWE]))
    ct = bytearray(jwe.unb64u(doc["ciphertext"]))
    ct[0] ^= 1
    doc["ciphertext"] = jwe.b64u(bytes(ct))
    bad = dict(notes, **{enc.ANN_KEYS_JWE: base64.b64encode(json.dumps(doc).encode()).decode()})
    with pytest.raises(GpusnapError, match="wrapped key does not decrypt: it was altered"):
        enc.unwrap_data_key(bad, ec_key, "r")
    foreign = dict(notes, **{enc.ANN_PUBOPTS: base64.b64encode(
        b'{"cipher":"AES_256_CTR_HMAC_SHA256"}').decode()})
    with pytest.raises(GpusnapError, match="encrypted with 'AES_256_CTR_HMAC_SHA256'"):
        enc.unwrap_data_key(foreign, ec_key, "r")
    missing = {k: v for k, v in notes.items() if k != enc.ANN_KEYS_JWE}
    with pytest.raises(GpusnapError, match="has no org.opencontainers.image.enc.keys.jwe"):
        enc.unwrap_data_key(missing, ec_key, "r")
    with pytest.raises(GpusnapError, match="not a JWE"):
        jwe.decrypt(b"[]", ec_key, "r")


def test_signing_only_keys_cannot_be_recipients():
    with pytest.raises(GpusnapError, match="cannot be an encryption recipient"):
        enc.config_annotations(os.urandom(32), [keys.generate("ed25519").public_key()])


def test_media_types():
    mt = "application/vnd.gpusnap.checkpoint.chunk.v1+zstd"
    e = enc.encrypted_media_type(mt)
    assert e == mt + "+encrypted" and enc.encrypted_media_type(e) == e
    assert enc.is_encrypted(e) and not enc.is_encrypted(mt)
    assert enc.plain_media_type(e) == mt == enc.plain_media_type(mt)
