"""Signatures stored under the cosign-like sha256-<hex>.sig tag: built,
verified, and refused when any signed byte changes."""

from __future__ import annotations

import base64
import hashlib
import json

import pytest
from cryptography.hazmat.primitives.asymmetric import rsa

from gpusnap.errors import GpusnapError
from gpusnap.trust import keys, signature as sig

REPO = "registry.example.com:5000/ckpt/app"
CHECKPOINT = json.dumps({"schemaVersion": 2, "layers": [{"digest": "sha256:" + "1" * 64}]},
                        separators=(",", ":")).encode()
DIGEST = "sha256:" + hashlib.sha256(CHECKPOINT).hexdigest()


class Registry:
    """Blobs by digest, as RegistryClient.get_blob returns them."""

    def __init__(self, blobs: dict[str, bytes]) -> None:
        self.blobs = dict(blobs)

    def get(self, digest: str, size: int) -> bytes:
        return self.blobs[digest]


def signed(key, repo=REPO, digest=DIGEST, existing=None):
    art = sig.build_artifact(key, repo, digest, len(CHECKPOINT), existing)
    return art, Registry(art.blobs)


def test_tag_and_payload_follow_cosign():
    assert sig.signature_tag(DIGEST) == "sha256-" + DIGEST[7:] + ".sig"
    with pytest.raises(GpusnapError, match="not a sha256 manifest digest"):
        sig.signature_tag("latest")
    doc = json.loads(sig.payload(REPO, DIGEST))
    assert doc["critical"] == {"identity": {"docker-reference": REPO},
                               "image": {"docker-manifest-digest": DIGEST},
                               "type": "gpusnap signature"}


@pytest.mark.parametrize("kind", keys.KEY_TYPES)
def test_round_trip(kind):
    key = keys.generate(kind)
    art, reg = signed(key)
    m = json.loads(art.manifest)
    assert art.tag == sig.signature_tag(DIGEST)
    assert m["artifactType"] == sig.ARTIFACT_TYPE and m["mediaType"] == sig.OCI_MANIFEST
    assert m["subject"] == {"mediaType": sig.OCI_MANIFEST, "digest": DIGEST, "size": len(CHECKPOINT)}
    assert m["config"]["digest"] in art.blobs and art.blobs[m["config"]["digest"]] == b"{}"
    for d, data in art.blobs.items():
        assert d == "sha256:" + hashlib.sha256(data).hexdigest()
    ok = sig.verify_artifact(art.manifest, reg.get, REPO, DIGEST,
                             {keys.key_id(key): key.public_key()})
    assert ok.key_id == keys.key_id(key)
    assert ok.algorithm == sig.ALGORITHMS[kind]


def _layer(manifest: bytes) -> dict:
    return json.loads(manifest)["layers"][0]


def _with_layer(manifest: bytes, **changes) -> bytes:
    m = json.loads(manifest)
    m["layers"][0].update(changes)
    return json.dumps(m).encode()


def test_every_signature_byte_matters():
    key = keys.generate("ed25519")
    trusted = {keys.key_id(key): key.public_key()}
    art, reg = signed(key)
    layer = _layer(art.manifest)
    raw = base64.b64decode(layer["annotations"][sig.ANN_SIGNATURE])
    for i in range(len(raw)):
        bad = bytearray(raw)
        bad[i] ^= 0x01
        notes = dict(layer["annotations"], **{sig.ANN_SIGNATURE: base64.b64encode(bad).decode()})
        with pytest.raises(GpusnapError, match="does not verify"):
            sig.verify_artifact(_with_layer(art.manifest, annotations=notes), reg.get, REPO,
                                DIGEST, trusted)


def test_every_payload_byte_matters():
    key = keys.generate("ecdsa-p256")
    trusted = {keys.key_id(key): key.public_key()}
    art, reg = signed(key)
    layer = _layer(art.manifest)
    body = reg.blobs[layer["digest"]]
    for i in range(len(body)):
        bad = bytearray(body)
        bad[i] ^= 0x20
        bad = bytes(bad)
        # the blob changed under its digest: the digest check catches it
        reg_same_digest = Registry({**reg.blobs, layer["digest"]: bad})
        with pytest.raises(GpusnapError, match="does not match its digest"):
            sig.verify_artifact(art.manifest, reg_same_digest.get, REPO, DIGEST, trusted)
        # an attacker who also rewrites the descriptor: the signature catches it
        d = "sha256:" + hashlib.sha256(bad).hexdigest()
        forged = _with_layer(art.manifest, digest=d)
        with pytest.raises(GpusnapError, match="does not verify"):
            sig.verify_artifact(forged, Registry({d: bad}).get, REPO, DIGEST, trusted)


def test_every_checkpoint_manifest_byte_matters():
    key = keys.generate("ed25519")
    trusted = {keys.key_id(key): key.public_key()}
    art, reg = signed(key)
    for i in range(len(CHECKPOINT)):
        bad = bytearray(CHECKPOINT)
        bad[i] ^= 0x01
        other = "sha256:" + hashlib.sha256(bad).hexdigest()
        # the signature found (e.g. the old .sig copied to the new digest's tag) is for the old one
        with pytest.raises(GpusnapError, match=f"is for manifest {DIGEST}, not {other}"):
            sig.verify_artifact(art.manifest, reg.get, REPO, other, trusted)


def test_untrusted_and_mislabelled_keys():
    signer, other = keys.generate("ed25519"), keys.generate("ed25519")
    art, reg = signed(signer)
    with pytest.raises(GpusnapError, match=r"signed only by keys the policy does not trust "
                                           r"\(sha256:") as e:
        sig.verify_artifact(art.manifest, reg.get, REPO, DIGEST,
                            {keys.key_id(other): other.public_key()})
    assert "gpusnap key id" in e.value.hint
    # the layer claims to be by the trusted key, but the trusted key did not sign it
    layer = _layer(art.manifest)
    notes = dict(layer["annotations"], **{sig.ANN_KEY_ID: keys.key_id(other)})
    with pytest.raises(GpusnapError, match="does not verify"):
        sig.verify_artifact(_with_layer(art.manifest, annotations=notes), reg.get, REPO, DIGEST,
                            {keys.key_id(other): other.public_key()})


def test_identity_check_and_opt_out():
    key = keys.generate("ed25519")
    trusted = {keys.key_id(key): key.public_key()}
    art, reg = signed(key, repo="registry.example.com:5000/ckpt/other")
    with pytest.raises(GpusnapError, match="is for registry.example.com:5000/ckpt/other, not") as e:
        sig.verify_artifact(art.manifest, reg.get, REPO, DIGEST, trusted)
    assert "matchDigestOnly" in e.value.hint
    assert sig.verify_artifact(art.manifest, reg.get, REPO, DIGEST, trusted,
                               match_repository=False).repository.endswith("/other")


def test_second_key_adds_a_layer_same_key_replaces():
    a, b = keys.generate("ed25519"), keys.generate("ecdsa-p256")
    first, reg = signed(a)
    second, reg2 = signed(b, existing=first.manifest)
    assert len(json.loads(second.manifest)["layers"]) == 2
    blobs = Registry({**reg.blobs, **reg2.blobs})
    for k in (a, b):
        assert sig.verify_artifact(second.manifest, blobs.get, REPO, DIGEST,
                                   {keys.key_id(k): k.public_key()}).key_id == keys.key_id(k)
    third, _ = signed(a, existing=second.manifest)
    ids = [x["annotations"][sig.ANN_KEY_ID] for x in json.loads(third.manifest)["layers"]]
    assert sorted(ids) == sorted([keys.key_id(a), keys.key_id(b)])


def test_not_a_signature_and_non_signing_keys():
    key = keys.generate("ed25519")
    trusted = {keys.key_id(key): key.public_key()}
    for body in (b"not json", json.dumps({"artifactType": "something/else", "layers": []}).encode()):
        with pytest.raises(GpusnapError, match="is not a gpusnap signature"):
            sig.verify_artifact(body, Registry({}).get, REPO, DIGEST, trusted)
    empty = json.dumps({"artifactType": sig.ARTIFACT_TYPE, "layers": []}).encode()
    with pytest.raises(GpusnapError, match="holds no signature"):
        sig.verify_artifact(empty, Registry({}).get, REPO, DIGEST, trusted)
    with pytest.raises(GpusnapError, match="cannot sign checkpoints"):
        sig.build_artifact(rsa.generate_private_key(65537, 2048), REPO, DIGEST, 1)
