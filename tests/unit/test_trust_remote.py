"""The trust wiring without a registry: chunks sealed by the Uploader and opened by
the Downloader, the chunk cache keeping plain and sealed entries apart, the
key checks a push makes before anything is checkpointed, and the recipient's
key picked among several --decrypt-key."""

from __future__ import annotations

import hashlib
import os

import pytest
from cryptography.hazmat.primitives.asymmetric import rsa

from gpusnap.cli import trust_options
from gpusnap.errors import GpusnapError
from gpusnap.oci.cache import ChunkCache
from gpusnap.oci.reference import parse as parse_ref
from gpusnap.oci.transfer import Downloader, Uploader
from gpusnap.trust import encrypt as enc
from gpusnap.trust import keys, remote, verify
from gpusnap.trust.options import TrustOptions

SECRET = b"PLANTED-api-token-4b1d"


class FakeClient:
    """The blob half of RegistryClient, on a dict."""

    def __init__(self) -> None:
        self.ref = parse_ref("reg.io/ckpt/app:v1")
        self.blobs: dict[str, bytes] = {}
        self.puts = 0

    def blob_exists(self, digest: str) -> bool:
        return digest in self.blobs

    def put_blob(self, digest: str, data: bytes) -> None:
        assert "sha256:" + hashlib.sha256(data).hexdigest() == digest
        self.blobs[digest] = bytes(data)
        self.puts += 1

    def get_blob(self, digest: str, size: int) -> bytearray:
        return bytearray(self.blobs[digest])


def chunks() -> list[bytes]:
    return [hashlib.sha256(bytes([i])).digest() * 2000 + SECRET * 50 for i in range(6)]


def upload(client, cache, cipher=None):
    up = Uploader(client, cache, 3, 2, cipher=cipher)
    try:
        return [f.result() for f in [up.submit(c) for c in chunks()]]
    finally:
        up.close()


def download(client, cache, got, cipher=None) -> list[bytes]:
    down = Downloader(client, cache, 2, cipher=cipher)
    try:
        return list(down.fetch(got))
    finally:
        down.close()


def test_sealed_chunks_round_trip_and_cache_entries_never_mix(tmp_path):
    client, cache = FakeClient(), ChunkCache(tmp_path / "cache")
    cipher = enc.ChunkCipher(os.urandom(32))
    sealed = upload(client, cache, cipher)
    assert not any(SECRET in blob for blob in client.blobs.values())
    assert download(client, None, sealed, cipher) == chunks()
    raw = sealed[0].digest
    assert cache.blob_for(raw) is None  # indexed under the data key, not the raw digest
    assert cache.blob_for(cipher.cache_index(raw))[0] == sealed[0].blob

    puts = client.puts
    again = upload(client, cache, enc.ChunkCipher(cipher._key))  # same data key: dedup
    assert [c.blob for c in again] == [c.blob for c in sealed] and client.puts == puts

    plain = upload(client, cache)  # same cache, no cipher: plain blobs of their own
    assert not {c.blob for c in plain} & {c.blob for c in sealed}
    assert download(client, cache, plain) == chunks()
    assert cache.blob_for(raw)[0] == plain[0].blob

    with pytest.raises(GpusnapError, match="does not decrypt: it was altered"):
        download(client, None, sealed, enc.ChunkCipher(os.urandom(32)))


def test_push_keys_are_checked_before_anything_runs(tmp_path, monkeypatch):
    monkeypatch.setenv(enc.SECRET_ENV, str(tmp_path / "secret" / "data-key.secret"))
    signer = keys.generate("ed25519")
    keys.write_keypair(str(tmp_path / "sig"), signer)
    with pytest.raises(GpusnapError, match="cannot be an encryption recipient"):
        remote.PushTrust.load(TrustOptions(encrypt_to=(str(tmp_path / "sig.pub"),)))
    big = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    keys.write_keypair(str(tmp_path / "rsa"), big)
    with pytest.raises(GpusnapError, match="cannot sign checkpoints"):
        remote.PushTrust.load(TrustOptions(sign_keys=(str(tmp_path / "rsa.key"),)))
    trust = remote.PushTrust.load(TrustOptions(
        sign_keys=(str(tmp_path / "sig.key"),),
        encrypt_to=(str(tmp_path / "rsa.pub"), str(tmp_path / "rsa.pub"))))
    assert len(trust.recipients) == 1 and trust.cipher is not None  # a repeat counts once
    assert trust.facts([keys.key_id(signer)])["recipients"] == [keys.key_id(big)]
    podman = remote.PushTrust.load(TrustOptions(encrypt_to=(str(tmp_path / "rsa.pub"),)),
                                   chunked=False)
    assert podman.cipher is None and podman.layer_encryptor() is not None
    assert remote.PushTrust.load(None).finish_manifest(b"{}") == b"{}"


def test_one_passphrase_serves_protected_and_clear_keys(tmp_path, monkeypatch):
    protected, clear = keys.generate("ed25519"), keys.generate("ecdsa-p256")
    keys.write_keypair(str(tmp_path / "p"), protected, b"pass phrase")
    keys.write_keypair(str(tmp_path / "c"), clear)
    monkeypatch.setenv(keys.PASSPHRASE_ENV, "pass phrase")
    got = remote.load_private_keys([str(tmp_path / "p.key"), str(tmp_path / "c.key")], None)
    assert [keys.key_id(k) for k in got] == [keys.key_id(protected), keys.key_id(clear)]


def test_the_recipients_key_is_found_among_several():
    mine, other = keys.generate("ecdsa-p256"), keys.generate("ecdsa-p256")
    data_key = os.urandom(32)
    notes = enc.config_annotations(data_key, [mine.public_key()])
    assert remote.unwrap(notes, [other, mine], "ref") == data_key
    with pytest.raises(GpusnapError, match="is not encrypted to any of keys"):
        remote.unwrap(notes, [other, keys.generate("ecdsa-p256")], "ref")
    with pytest.raises(GpusnapError, match="^ref is encrypted"):
        remote.unwrap(notes, [], "ref")


def test_cli_warning_is_the_verifiers():
    assert trust_options.SKIP_WARNING == verify.SKIP_WARNING
