"""A signed, encrypted push and its restore, end to end through the real bundle
format and chunker, with a dict for a registry: nothing of a planted secret is
stored; the right key restores every byte, the wrong key fails in one line;
a second push to the same recipients reuses the unchanged chunks' blobs."""

from __future__ import annotations

import hashlib
import io
import json
import os

import pytest
import zstandard

from gpusnap.errors import GpusnapError
from gpusnap.oci import bundle as fmt
from gpusnap.oci import chunker
from gpusnap.oci.reference import parse as parse_ref
from gpusnap.trust import encrypt as enc
from gpusnap.trust import keys, policy, signature, verify

SECRET = b"sk-PLANTED-api-token-7f3a9c"
REF = parse_ref("reg.io/ckpt/app:v1")
REPO = "reg.io/ckpt/app"
PARAMS = chunker.ChunkParams(16 << 10, 64 << 10, 256 << 10)


def sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def memory(seed: int = 0, size: int = 1 << 20) -> bytes:
    """Process memory: pseudo-random pages with the secret planted in many."""
    out = bytearray()
    block = 0
    while len(out) < size:
        page = hashlib.sha256(f"{seed}-{block}".encode()).digest() * 128
        if block % 3 == 0:
            page = page[:1000] + SECRET + page[1000 + len(SECRET):]
        out += page
        block += 1
    return bytes(out[:size])


def push(registry: dict, data: bytes, recipients, secret: bytes, signer) -> str:
    cipher = enc.ChunkCipher(enc.data_key_for(recipients, secret))
    cctx = zstandard.ZstdCompressor(level=3)
    chunks = []
    for piece in chunker.split(io.BytesIO(data), PARAMS, len(data)):
        raw = sha(piece)
        blob = cipher.seal_chunk(raw, cctx.compress(piece))
        registry[sha(blob)] = blob
        chunks.append(fmt.Chunk(raw, len(piece), sha(blob), len(blob)))
    entry = fmt.FileEntry("checkpoint/pages-1.img", "file", size=len(data), chunks=chunks)
    b = fmt.Bundle(files=[entry], summary={"container": {"name": "app"}}, gpu_manifest=None,
                   chunking={}, compression={})
    config = cipher.seal_config(b.to_json())
    registry[sha(config)] = config
    notes = enc.config_annotations(enc.data_key_for(recipients, secret), recipients)
    manifest = enc.mark_encrypted(fmt.build_manifest(b, sha(config), len(config), {}, None), notes)
    digest = sha(manifest)
    registry["manifest"] = manifest
    art = signature.build_artifact(signer, REPO, digest, len(manifest))
    registry.update(art.blobs)
    registry[art.tag] = art.manifest
    return digest


def restore(registry: dict, digest: str, pol: policy.Policy, private) -> bytes:
    manifest_bytes = registry["manifest"]
    assert sha(manifest_bytes) == digest
    verify.check(pol, REF, digest, registry.get(signature.signature_tag(digest)),
                 lambda d, s: registry[d])
    manifest = json.loads(manifest_bytes)
    assert enc.is_encrypted_manifest(manifest)
    config_desc = manifest["config"]
    cipher = enc.ChunkCipher(enc.unwrap_data_key(config_desc["annotations"], private, str(REF)))
    b = fmt.Bundle.from_json(cipher.open_config(registry[config_desc["digest"]], str(REF)), str(REF))
    out = bytearray()
    dctx = zstandard.ZstdDecompressor()
    for c in b.files[0].chunks:
        blob = registry[c.blob]
        if sha(blob) != c.blob:  # as RegistryClient.get_blob checks
            raise GpusnapError(f"blob {c.blob} does not match its digest")
        raw = dctx.decompress(cipher.open_chunk(c.digest, blob, str(REF)))
        assert sha(raw) == c.digest
        out += raw
    return bytes(out)


@pytest.fixture
def setup(tmp_path):
    signer = keys.generate("ed25519")
    recipient = keys.generate("ecdsa-p256")
    keys.write_keypair(str(tmp_path / "ci"), signer)
    (tmp_path / "policy.json").write_text(json.dumps(
        {"default": {"type": "reject"},
         "scopes": {"reg.io/ckpt": {"type": "signedBy", "keyPaths": ["ci.pub"]}}}))
    os.chmod(tmp_path / "policy.json", 0o644)
    return signer, recipient, policy.load(tmp_path / "policy.json"), os.urandom(32)


def test_signed_encrypted_round_trip_stores_no_secret(setup):
    signer, recipient, pol, secret = setup
    data = memory()
    assert data.count(SECRET) > 50
    registry: dict = {}
    digest = push(registry, data, [recipient.public_key()], secret, signer)
    for name, stored in registry.items():
        assert SECRET not in stored and SECRET[:8] not in stored, name
    m = json.loads(registry["manifest"])
    assert m["config"]["mediaType"] == fmt.CONFIG_MEDIA_TYPE + "+encrypted"
    assert {layer["mediaType"] for layer in m["layers"]} == {fmt.CHUNK_MEDIA_TYPE + "+encrypted"}
    assert all(x["annotations"][fmt.TITLE].endswith(".zst.enc") for x in m["layers"])
    assert enc.recipients_of(m["config"]["annotations"], "r") == [keys.key_id(recipient)]
    assert restore(registry, digest, pol, recipient) == data


def test_wrong_key_and_tampering_are_refused(setup):
    signer, recipient, pol, secret = setup
    registry: dict = {}
    digest = push(registry, memory(), [recipient.public_key()], secret, signer)
    with pytest.raises(GpusnapError, match=r"^reg.io/ckpt/app:v1 is not encrypted to key"):
        restore(registry, digest, pol, keys.generate("ecdsa-p256"))
    # one chunk replaced by the registry, manifest re-digested: the signature refuses it
    m = json.loads(registry["manifest"])
    victim = m["layers"][3]["digest"]
    bad = bytearray(registry[victim])
    bad[40] ^= 1
    forged = dict(registry)
    forged[sha(bytes(bad))] = bytes(bad)
    m["layers"][3]["digest"] = sha(bytes(bad))
    forged["manifest"] = json.dumps(m, separators=(",", ":")).encode()
    forged_digest = sha(forged["manifest"])
    forged[signature.signature_tag(forged_digest)] = registry[signature.signature_tag(digest)]
    with pytest.raises(GpusnapError, match="is for manifest"):
        restore(forged, forged_digest, pol, recipient)
    # the blob damaged in place: its digest refuses it (GCM is the second line: the
    # chunk digests are in the encrypted config, which no one can rewrite without the key)
    damaged = dict(registry)
    damaged[victim] = bytes(bad)
    with pytest.raises(GpusnapError, match=f"blob {victim} does not match its digest"):
        restore(damaged, digest, pol, recipient)
    # a config sealed under another data key (this helper does not check the config's
    # digest, as get_blob would): GCM refuses it
    other: dict = {}
    push(other, memory(seed=1), [keys.generate("ecdsa-p256").public_key()], secret, signer)
    cfg = json.loads(registry["manifest"])["config"]["digest"]
    swapped = dict(registry)
    swapped[cfg] = other[json.loads(other["manifest"])["config"]["digest"]]
    with pytest.raises(GpusnapError, match="config does not decrypt"):
        restore(swapped, digest, pol, recipient)


def test_second_push_to_same_recipients_dedups(setup):
    signer, recipient, pol, secret = setup
    first, second = memory(), bytearray(memory())
    second[500_000:500_100] = b"x" * 100  # one page changed
    r1: dict = {}
    r2: dict = {}
    push(r1, first, [recipient.public_key()], secret, signer)
    push(r2, bytes(second), [recipient.public_key()], secret, signer)
    layers1 = {x["digest"] for x in json.loads(r1["manifest"])["layers"]}
    layers2 = {x["digest"] for x in json.loads(r2["manifest"])["layers"]}
    assert len(layers2 - layers1) <= 2 and len(layers1 & layers2) >= len(layers1) - 2
    # another recipient set: another data key, nothing shared
    r3: dict = {}
    push(r3, first, [recipient.public_key(), keys.generate("ecdsa-p256").public_key()], secret,
         signer)
    assert not layers1 & {x["digest"] for x in json.loads(r3["manifest"])["layers"]}
