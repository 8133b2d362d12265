"""The registry-facing side of trust, as gpusnap/ops/push.py and pull.py call it:
sign a pushed manifest and store the signature on its `.sig` tag, decide
whether a pulled manifest is trusted (verify.check, before any chunk is read),
seal a push to its recipients and open a pull with a recipient's key, and
describe a checkpoint's signatures and recipients without any key (inspect).
The decisions themselves are pure and live in signature.py, verify.py,
policy.py and encrypt.py (docs/trust.md)."""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from gpusnap.errors import GpusnapError
from gpusnap.oci.reference import Reference
from gpusnap.oci.registry import OCI_MANIFEST, RegistryClient
from gpusnap.trust import (encrypt, hostkey, jwe, keys, ocicrypt_layer, policy, signature,
                           verify)
from gpusnap.trust.options import TrustOptions

SIGNATURE_LIMIT = 1 << 20  # a signature manifest is a few hundred bytes per key
_RECIPIENT_KINDS = ("ecdsa-p256", "rsa")


def load_private_keys(paths: Sequence[str], passphrase_file: str | None) -> list[keys.PrivateKey]:
    """The private keys, the passphrase given only to those that are protected
    (one --passphrase-file serves a protected signing key beside a clear one)."""
    if not paths:
        return []
    passphrase = keys.passphrase_from(passphrase_file)
    return [keys.load_private_key(path, passphrase, only_if_protected=True) for path in paths]


def fetch_signature(client: RegistryClient, digest: str) -> bytes | None:
    """The manifest under the `.sig` tag of ``digest``; None when there is none."""
    tag = signature.signature_tag(digest)
    resp = client.request("GET", client.url(f"manifests/{tag}"), headers={"Accept": OCI_MANIFEST})
    try:
        if resp.status_code == 404:
            return None
        if resp.status_code != 200:
            raise GpusnapError(f"{client.ref}: cannot read its signature tag {tag} (HTTP "
                               f"{resp.status_code})", "try again; nothing was restored")
        body = resp.content
    finally:
        resp.close()
    if len(body) > SIGNATURE_LIMIT:
        raise GpusnapError(f"{client.ref}: its signature tag {tag} holds {len(body)} bytes, "
                           "not a signature", "someone wrote to the signature tag: sign again")
    return body


# -- push ---------------------------------------------------------------------------


@dataclass
class PushTrust:
    """What a push signs and encrypts; keys are loaded before anything is
    checkpointed or sent, so a wrong key or passphrase fails first."""
    signers: list[keys.PrivateKey] = field(default_factory=list)
    recipients: list[keys.PublicKey] = field(default_factory=list)
    cipher: encrypt.ChunkCipher | None = None  # gpusnap format: seals chunks and the config
    config_notes: dict[str, str] = field(default_factory=dict)

    def __repr__(self) -> str:
        return (f"PushTrust(signers={[keys.short_id(keys.key_id(k)) for k in self.signers]}, "
                f"recipients={[keys.short_id(keys.key_id(k)) for k in self.recipients]})")

    @classmethod
    def load(cls, opts: TrustOptions | None, chunked: bool = True) -> "PushTrust":
        """``chunked``: the gpusnap format (a data key for convergent chunk
        encryption); else --format podman (a random layer key per push)."""
        opts = opts or TrustOptions()
        # No --sign-key: this host's own key (made on first use), which this host
        # trusts; --no-sign: none.
        paths = () if opts.no_sign else opts.sign_keys or (str(hostkey.ensure()),)
        signers = load_private_keys(paths, opts.passphrase_file)
        for key, path in zip(signers, paths):
            if keys.kind(key) not in keys.KEY_TYPES:
                raise GpusnapError(f"{path} is a {keys.kind(key)} key, which cannot sign "
                                   "checkpoints", "sign with an Ed25519 or ECDSA P-256 key "
                                   "(`gpusnap key generate -o NAME` writes NAME.key)")
        recipients: dict[str, keys.PublicKey] = {}
        for path in opts.encrypt_to:
            key = keys.load_public_key(path)
            if not keys.kind(key).startswith(_RECIPIENT_KINDS):
                raise GpusnapError(f"{path} is a {keys.kind(key)} key, which cannot be an "
                                   "encryption recipient", "encrypt to P-256 (`gpusnap key "
                                   "generate --type ecdsa-p256 -o NAME` writes NAME.pub) or RSA "
                                   "public keys")
            recipients.setdefault(keys.key_id(key), key)
        trust = cls(signers, list(recipients.values()))
        if trust.recipients and chunked:
            data_key = encrypt.data_key_for(trust.recipients, encrypt.host_secret())
            trust.cipher = encrypt.ChunkCipher(data_key)
            trust.config_notes = encrypt.config_annotations(data_key, trust.recipients)
        return trust

    @property
    def encrypts(self) -> bool:
        return bool(self.recipients)

    def seal_config(self, config: bytes) -> bytes:
        return self.cipher.seal_config(config) if self.cipher else config

    def finish_manifest(self, manifest: bytes) -> bytes:
        """The checkpoint manifest marked encrypted, when it is."""
        return encrypt.mark_encrypted(manifest, self.config_notes) if self.cipher else manifest

    def layer_encryptor(self) -> ocicrypt_layer.LayerEncryptor | None:
        """--format podman: ocicrypt's layer encryption, one random key per push."""
        return ocicrypt_layer.LayerEncryptor() if self.recipients else None

    def sign(self, client: RegistryClient, digest: str, size: int) -> list[str]:
        """Sign manifest ``digest`` with every signer and push the signature
        manifest to its `.sig` tag (other keys' signatures there are kept).
        The key ids that signed."""
        if not self.signers:
            return []
        repository = f"{client.ref.registry}/{client.ref.repository}"
        existing = fetch_signature(client, digest)
        for key in self.signers:
            art = signature.build_artifact(key, repository, digest, size, existing)
            for blob, data in art.blobs.items():
                if not client.blob_exists(blob):
                    client.put_blob(blob, data)
            client.put_manifest(art.manifest, signature.OCI_MANIFEST, art.tag)
            existing = art.manifest
        return [keys.key_id(k) for k in self.signers]

    def facts(self, signed_by: list[str]) -> dict:
        """For the push result (--json)."""
        return {"signed": bool(signed_by), "signature_key_ids": signed_by,
                "encrypted": self.encrypts,
                "recipients": [keys.key_id(k) for k in self.recipients]}


# -- pull ---------------------------------------------------------------------------


def needs_registry(ref: Reference, opts: TrustOptions | None) -> bool:
    """Whether the policy's decision on ``ref`` reads the registry (a signature)."""
    opts = opts or TrustOptions()
    return not opts.skip_verify and policy.load().for_reference(ref).type == "signedBy"


def check(client: RegistryClient, digest: str, opts: TrustOptions | None) -> dict:
    """The policy's decision on manifest ``digest`` (just read from ``client.ref``);
    a refusal is one GpusnapError. Call before the config or any chunk is read:
    every later read is a blob the verified manifest names by digest."""
    opts = opts or TrustOptions()
    pol = policy.load()
    sig = None
    if not opts.skip_verify and pol.for_reference(client.ref).type == "signedBy":
        sig = fetch_signature(client, digest)
    return verify.check(pol, client.ref, digest, sig, client.get_blob, opts.skip_verify)


def _jwe_recipients(notes: Mapping[str, str], where: str) -> list[str]:
    try:
        return [r for r in encrypt.recipients_of(notes, where) if r]
    except GpusnapError:
        return []


def unwrap(notes: Mapping[str, str], private: Sequence[keys.PrivateKey], where: str) -> bytes:
    """The data key of an encrypted checkpoint (its config descriptor's annotations),
    with whichever of ``private`` is a recipient."""
    recipients = _jwe_recipients(notes, where)
    if not private:
        named = ", ".join(keys.short_id(r) for r in recipients) or "unnamed keys"
        raise GpusnapError(f"{where} is encrypted (to {named})",
                           "pass --decrypt-key KEY, the private key of one of its recipients")
    ordered = sorted(private, key=lambda k: keys.key_id(k) not in recipients)
    errors = []
    for key in ordered:
        try:
            return encrypt.unwrap_data_key(notes, key, where)
        except GpusnapError as exc:
            if keys.key_id(key) in recipients:
                raise  # a recipient's own key failed: altered, or another scheme
            errors.append(exc)
    if len(errors) == 1:
        raise errors[0]
    tried = ", ".join(keys.short_id(keys.key_id(k)) for k in ordered)
    named = ", ".join(keys.short_id(r) for r in recipients) or "?"
    raise GpusnapError(f"{where} is not encrypted to any of keys {tried} (its recipients: "
                       f"{named})", "pass --decrypt-key with the private key of one of its "
                       "recipients")


def open_config(manifest: dict, blob: bytes, private: Sequence[keys.PrivateKey],
                where: str) -> tuple[bytes, encrypt.ChunkCipher | None]:
    """The config's plain bytes (``blob``: as the manifest's config descriptor
    names it) and, for an encrypted checkpoint, the cipher that opens its chunks."""
    desc = manifest["config"]
    cipher = None
    if encrypt.is_encrypted_manifest(manifest):
        cipher = encrypt.ChunkCipher(unwrap(desc.get("annotations") or {}, private, where))
    return (cipher.open_config(blob, where) if cipher else bytes(blob)), cipher


# -- inspect ------------------------------------------------------------------------


def _layer_recipients(manifest: dict, where: str) -> list[str]:
    """Recipients of an ocicrypt-encrypted layer (--format podman)."""
    for layer in manifest.get("layers") or []:
        notes = layer.get("annotations") or {}
        if encrypt.is_encrypted(str(layer.get("mediaType", ""))) and encrypt.ANN_KEYS_JWE in notes:
            try:
                blob = base64.b64decode(notes[encrypt.ANN_KEYS_JWE].split(",")[0])
                return [r for r in jwe.recipient_ids(blob) if r]
            except (GpusnapError, ValueError):
                return []
    return []


def describe(client: RegistryClient, digest: str, manifest: dict) -> dict:
    """Signed by which key ids (not verified: that is restore's job, with the
    policy) and encrypted to which recipients; needs no key and no policy."""
    where = str(client.ref)
    sig = fetch_signature(client, digest)
    signers: list[str] = []
    if sig is not None:
        try:
            signers = [str((layer.get("annotations") or {}).get(signature.ANN_KEY_ID, ""))
                       for layer in json.loads(sig).get("layers") or []]
        except (ValueError, AttributeError):
            signers = []
    config = manifest.get("config") or {}
    chunked = encrypt.is_encrypted_manifest(manifest)
    layered = any(encrypt.is_encrypted(str(x.get("mediaType", "")))
                  for x in manifest.get("layers") or [])
    recipients = (_jwe_recipients(config.get("annotations") or {}, where) if chunked
                  else _layer_recipients(manifest, where) if layered else [])
    return {"signed": sig is not None, "signature_key_ids": [s for s in signers if s],
            "signature_tag": signature.signature_tag(digest) if sig is not None else None,
            "verified": None, "encrypted": chunked or layered, "recipients": recipients}
