"""Signatures of pushed checkpoints, stored beside them in the registry.

What is signed is a small JSON payload naming the repository and the
checkpoint manifest's digest (cosign's "simple signing" shape), so a
signature vouches for the manifest and, through its digests, for the config
and every chunk. Signatures are kept in an OCI image manifest tagged
``sha256-<hex>.sig`` in the checkpoint's repository (cosign's scheme): any
registry stores it, docker-registry 2.8 included, which has no referrers API.
The manifest also names the checkpoint as its ``subject``, so registries that
have the referrers API list it there too.

One layer per signing key: the payload blob (identical for every key), the
signature and key id in the layer's annotations. Signing again with another
key adds a layer; with the same key, replaces its layer.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Callable, Mapping

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec, ed25519

from gpusnap.errors import GpusnapError
from gpusnap.trust import keys

ARTIFACT_TYPE = "application/vnd.gpusnap.signature.v1"
PAYLOAD_MEDIA_TYPE = "application/vnd.gpusnap.signature.payload.v1+json"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
EMPTY_MEDIA_TYPE = "application/vnd.oci.empty.v1+json"
EMPTY = b"{}"
PAYLOAD_TYPE = "gpusnap signature"
ANN_SIGNATURE = "io.gpusnap.signature"  # base64 of the raw signature bytes
ANN_KEY_ID = "io.gpusnap.signature.keyid"
ANN_ALGORITHM = "io.gpusnap.signature.algorithm"
ALGORITHMS = {"ed25519": "ed25519", "ecdsa-p256": "ecdsa-p256-sha256"}
_DIGEST = re.compile(r"^sha256:[a-f0-9]{64}$")

FetchBlob = Callable[[str, int], bytes]  # (digest, size) -> bytes, e.g. RegistryClient.get_blob


def sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def signature_tag(manifest_digest: str) -> str:
    """The tag that holds a manifest's signatures: sha256:ab.. -> sha256-ab...sig."""
    if not _DIGEST.match(manifest_digest):
        raise GpusnapError(f"cannot sign {manifest_digest!r}: not a sha256 manifest digest")
    return manifest_digest.replace(":", "-") + ".sig"


def payload(repository: str, manifest_digest: str) -> bytes:
    """REPO is registry/repository, no tag: a tag moves, the digest does not."""
    signature_tag(manifest_digest)  # validates the digest
    doc = {"critical": {"identity": {"docker-reference": repository},
                        "image": {"docker-manifest-digest": manifest_digest},
                        "type": PAYLOAD_TYPE},
           "optional": {}}
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def sign_bytes(key: keys.PrivateKey, data: bytes) -> tuple[bytes, str]:
    """(signature, algorithm name)."""
    if isinstance(key, ed25519.Ed25519PrivateKey):
        return key.sign(data), ALGORITHMS["ed25519"]
    if isinstance(key, ec.EllipticCurvePrivateKey) and isinstance(key.curve, ec.SECP256R1):
        return key.sign(data, ec.ECDSA(hashes.SHA256())), ALGORITHMS["ecdsa-p256"]
    raise GpusnapError(f"a {keys.kind(key)} key cannot sign checkpoints",
                       "sign with an Ed25519 or ECDSA P-256 key (`gpusnap key generate`)")


def verify_bytes(public: keys.PublicKey, data: bytes, signature: bytes) -> bool:
    try:
        if isinstance(public, ed25519.Ed25519PublicKey):
            public.verify(signature, data)
            return True
        if isinstance(public, ec.EllipticCurvePublicKey) and isinstance(public.curve, ec.SECP256R1):
            public.verify(signature, data, ec.ECDSA(hashes.SHA256()))
            return True
    except InvalidSignature:
        return False
    return False  # an RSA or other key never vouches for a checkpoint


@dataclass
class SignatureArtifact:
    """What to push, in order: ``blobs`` (digest -> bytes; skip those the registry
    has), then ``manifest`` (media type OCI_MANIFEST) under tag ``tag``."""
    tag: str
    manifest: bytes
    blobs: dict[str, bytes] = field(default_factory=dict)


def _descriptor(media_type: str, data: bytes) -> dict:
    return {"mediaType": media_type, "digest": sha256(data), "size": len(data)}


def build_artifact(key: keys.PrivateKey, repository: str, manifest_digest: str,
                   manifest_size: int, existing: bytes | None = None) -> SignatureArtifact:
    """The signature manifest for one checkpoint manifest. ``existing`` is the
    manifest already under the .sig tag, if any: its other keys' layers are kept."""
    body = payload(repository, manifest_digest)
    signature, algorithm = sign_bytes(key, body)
    kid = keys.key_id(key)
    layer = _descriptor(PAYLOAD_MEDIA_TYPE, body)
    layer["annotations"] = {ANN_SIGNATURE: base64.b64encode(signature).decode(),
                            ANN_KEY_ID: kid, ANN_ALGORITHM: algorithm}
    layers = [layer]
    if existing:
        old = _parse_manifest(existing, signature_tag(manifest_digest))
        layers = [x for x in old["layers"]
                  if (x.get("annotations") or {}).get(ANN_KEY_ID) != kid] + layers
    manifest = {
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "artifactType": ARTIFACT_TYPE,
        "config": _descriptor(EMPTY_MEDIA_TYPE, EMPTY),
        "layers": layers,
        "subject": {"mediaType": OCI_MANIFEST, "digest": manifest_digest, "size": manifest_size},
    }
    return SignatureArtifact(signature_tag(manifest_digest),
                             json.dumps(manifest, separators=(",", ":")).encode(),
                             {sha256(EMPTY): EMPTY, sha256(body): body})


def _parse_manifest(body: bytes, where: str) -> dict:
    try:
        manifest = json.loads(body)
        ok = (isinstance(manifest, dict) and manifest.get("artifactType") == ARTIFACT_TYPE
              and isinstance(manifest.get("layers"), list))
    except ValueError:
        ok = False
    if not ok:
        raise GpusnapError(f"{where} is not a gpusnap signature",
                           "something else was pushed under the signature tag: sign again "
                           "(`gpusnap push --sign-key`)")
    return manifest


@dataclass(frozen=True)
class Verified:
    key_id: str
    algorithm: str
    repository: str


def verify_artifact(body: bytes, fetch: FetchBlob, repository: str, manifest_digest: str,
                    trusted: Mapping[str, keys.PublicKey], match_repository: bool = True,
                    where: str | None = None) -> Verified:
    """The first signature by a trusted key (key id -> public key) that vouches
    for ``manifest_digest`` in ``repository``; else one GpusnapError saying why.

    A damaged or forged signature by a trusted key fails at once, even if
    another layer would verify: it means someone wrote to the signature tag."""
    where = where or f"{repository}@{manifest_digest}"
    manifest = _parse_manifest(body, f"the signature of {where}")
    seen: list[str] = []
    for layer in manifest["layers"]:
        notes = layer.get("annotations") or {}
        kid = str(notes.get(ANN_KEY_ID, ""))
        seen.append(kid)
        if kid not in trusted:
            continue
        return _verify_layer(layer, notes, fetch, trusted[kid], kid, repository,
                             manifest_digest, match_repository, where)
    if not seen:
        raise GpusnapError(f"{where}: its signature manifest holds no signature",
                           "sign it again (`gpusnap push --sign-key`)")
    names = ", ".join(keys.short_id(k) or "(no key id)" for k in seen)
    refused = UntrustedSigner(f"{where} is signed only by keys the policy does not trust "
                              f"({names})", "add the signer's public key to the policy's "
                              "keyPaths for this repository (`gpusnap key id FILE.pub` prints "
                              "a key's id)")
    refused.where, refused.key_ids = where, names
    raise refused


class UntrustedSigner(GpusnapError):
    """Signed, but by no key the policy trusts; ``where`` and the signers'
    ``key_ids`` for a caller that words the refusal for its own trust."""

    where = key_ids = ""


def _verify_layer(layer: dict, notes: Mapping, fetch: FetchBlob, public: keys.PublicKey,
                  kid: str, repository: str, manifest_digest: str, match_repository: bool,
                  where: str) -> Verified:
    by = f"{where}: the signature by key {keys.short_id(kid)}"
    altered = "the checkpoint or its signature was altered in the registry; nothing was restored"
    if layer.get("mediaType") != PAYLOAD_MEDIA_TYPE or not _DIGEST.match(str(layer.get("digest"))):
        raise GpusnapError(f"{by} has no payload", altered)
    body = fetch(layer["digest"], int(layer.get("size") or 0))
    if sha256(bytes(body)) != layer["digest"]:
        raise GpusnapError(f"{by}: the payload does not match its digest", altered)
    try:
        signature = base64.b64decode(str(notes.get(ANN_SIGNATURE, "")), validate=True)
    except (binascii.Error, ValueError):
        signature = b""
    if not signature or not verify_bytes(public, bytes(body), signature):
        raise GpusnapError(f"{by} does not verify", altered)
    try:  # only now: the payload is the signer's
        critical = json.loads(body)["critical"]
        kind, signed_digest = critical["type"], critical["image"]["docker-manifest-digest"]
        signed_repo = critical["identity"]["docker-reference"]
    except (ValueError, KeyError, TypeError):
        raise GpusnapError(f"{by} signs a payload gpusnap cannot read",
                           "it was made by another tool or a newer gpusnap") from None
    if kind != PAYLOAD_TYPE:
        raise GpusnapError(f"{by} is a {kind!r}, not a {PAYLOAD_TYPE!r}",
                           "it was made by another tool")
    if signed_digest != manifest_digest:
        raise GpusnapError(f"{by} is for manifest {signed_digest}, not {manifest_digest}",
                           "the tag was moved to another checkpoint than the one signed; "
                           "nothing was restored")
    if match_repository and signed_repo != repository:
        raise GpusnapError(f"{by} is for {signed_repo}, not {repository}",
                           'a copy from another repository: set "signedIdentity": '
                           '"matchDigestOnly" for this scope in the policy to accept copies')
    return Verified(kid, str(notes.get(ANN_ALGORITHM, "")), signed_repo)
