"""Encrypted checkpoints: every chunk and the config sealed with AES-256-GCM
under keys derived from one data key; the data key wrapped for each recipient
in a JWE (jwe.py), as ocicrypt wraps layer keys.

Convergent per chunk, so dedup survives encryption: a chunk's key is
HKDF(data key, raw digest) and its nonce HMAC(nonce key, the sealed bytes),
so the same chunk under the same data key always gives the same blob, and two
different plaintexts never share a key and nonce (the nonce follows the
plaintext, SIV-style: a chunk compressed at another zstd level is another
plaintext, another nonce). What this reveals to whoever reads the registry:
which chunks are equal (within and across checkpoints with the same data
key) and their sizes; nothing of their content. The data key is the same for
pushes from one host to the same recipients (see data_key_for), different
when a recipient is added or removed.

Blob layout: nonce (12 bytes) || ciphertext || GCM tag (16 bytes).

Manifest conventions (ocicrypt's, where they fit): media types get
"+encrypted"; the config descriptor carries
"org.opencontainers.image.enc.keys.jwe" (base64 JWE whose plaintext is
{"symkey": base64 data key, "cipheroptions": {}, ...}) and
"org.opencontainers.image.enc.pubopts" (base64 {"cipher": SCHEME, ...}).
Chunk layers carry no key annotation: 16,000 copies of the wrapped key would
not fit in a manifest, and a chunk's key follows from the data key and its
raw digest, which only the (encrypted) config lists.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
from pathlib import Path
from typing import Mapping, Sequence

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from gpusnap.errors import GpusnapError
from gpusnap.trust import jwe, keys

SCHEME = "GPUSNAP_CONVERGENT_AES_256_GCM_V1"
ENCRYPTED = "+encrypted"
ANN_KEYS_JWE = "org.opencontainers.image.enc.keys.jwe"
ANN_PUBOPTS = "org.opencontainers.image.enc.pubopts"
ANN_RECIPIENTS = "io.gpusnap.enc.recipients"  # comma-separated key ids, for `inspect`
SECRET_PATH = Path("/var/lib/gpusnap/data-key.secret")
SECRET_ENV = "GPUSNAP_DATA_KEY_SECRET"  # another path, for tests and shared secrets
NONCE, TAG = 12, 16
OVERHEAD = NONCE + TAG


def encrypted_media_type(media_type: str) -> str:
    return media_type if media_type.endswith(ENCRYPTED) else media_type + ENCRYPTED


def is_encrypted(media_type: str) -> bool:
    return media_type.endswith(ENCRYPTED)


def plain_media_type(media_type: str) -> str:
    return media_type[:-len(ENCRYPTED)] if is_encrypted(media_type) else media_type


def _hkdf(secret: bytes, salt: bytes, info: bytes, length: int = 32) -> bytes:
    return HKDF(hashes.SHA256(), length, salt, info).derive(secret)


def host_secret(path: Path | None = None) -> bytes:
    """32 random bytes kept root-only on this host, made on first use."""
    path = path or Path(os.environ.get(SECRET_ENV) or SECRET_PATH)
    if not path.exists():
        _create_secret(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise GpusnapError(f"cannot read the data key secret {path}: {exc.strerror}",
                           "run as root") from None
    if len(data) != 32:
        raise GpusnapError(f"the data key secret {path} is damaged (not 32 bytes)",
                           "remove it: the next encrypted push makes a new one (its "
                           "chunks then share nothing with earlier pushes)")
    return data


def _create_secret(path: Path) -> None:
    """Written whole to a temporary file, then linked into place: a concurrent
    push sees no file or the whole secret, never an empty one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(os.urandom(32))
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass  # another push made it first: use theirs
    except OSError as exc:
        raise GpusnapError(f"cannot create the data key secret {path}: {exc.strerror}",
                           "run as root") from None
    finally:
        tmp.unlink(missing_ok=True)


def recipients_id(recipients: Sequence[keys.PublicKey]) -> bytes:
    ids = sorted({keys.key_id(r) for r in recipients})
    if not ids:
        raise GpusnapError("no recipient to encrypt to", "pass --encrypt-to PUBKEY")
    return "\n".join(ids).encode()


def data_key_for(recipients: Sequence[keys.PublicKey], secret: bytes) -> bytes:
    """The data key for this recipient set: HKDF(host secret, recipient key ids).

    Why derived and not random per push: equal chunks must give equal blobs
    across pushes for dedup, so the key must repeat; deriving it from a host
    secret needs no state per recipient set and no private key (the pusher
    usually holds only the recipients' public keys, so it could not unwrap a
    previous push's key). Another recipient set gets an unrelated key, so a
    removed recipient cannot read later pushes."""
    return _hkdf(secret, b"gpusnap data key v1", recipients_id(recipients))


class ChunkCipher:
    """Seals and opens chunks and the config under one data key (thread-safe:
    no state but the derived keys)."""

    def __init__(self, data_key: bytes) -> None:
        if len(data_key) != 32:
            raise GpusnapError("the data key is not 32 bytes", "the checkpoint's key "
                               "annotation is damaged, or it was encrypted by another tool")
        self._key = data_key
        self._config_keys = self._keys(b"config")  # distinct info from every "chunk ..." key
        # a public name for this data key: the local chunk cache keeps its
        # raw digest -> blob index per data key with it
        self.key_id = "sha256:" + _hkdf(data_key, b"gpusnap chunk v1", b"key id").hex()

    def __repr__(self) -> str:
        return f"ChunkCipher(key_id={self.key_id[:19]})"

    def _keys(self, label: bytes) -> tuple[AESGCM, bytes]:
        okm = _hkdf(self._key, b"gpusnap chunk v1", label, 64)
        return AESGCM(okm[:32]), okm[32:]

    @staticmethod
    def _seal(keys_: tuple[AESGCM, bytes], aad: bytes, plain: bytes) -> bytes:
        aead, nonce_key = keys_
        nonce = hmac.new(nonce_key, plain, hashlib.sha256).digest()[:NONCE]
        return nonce + aead.encrypt(nonce, plain, aad)

    @staticmethod
    def _open(keys_: tuple[AESGCM, bytes], aad: bytes, blob: bytes | bytearray) -> bytes:
        if len(blob) < OVERHEAD:
            raise InvalidTag()
        view = memoryview(blob)
        return keys_[0].decrypt(bytes(view[:NONCE]), view[NONCE:], aad)

    def seal_chunk(self, raw_digest: str, frame: bytes) -> bytes:
        """The blob for one chunk: ``frame`` is what is stored (the zstd frame),
        ``raw_digest`` the digest of the uncompressed chunk (its key)."""
        return self._seal(self._keys(b"chunk " + raw_digest.encode()), raw_digest.encode(),
                          frame)

    def open_chunk(self, raw_digest: str, blob: bytes | bytearray, where: str) -> bytes:
        try:
            return self._open(self._keys(b"chunk " + raw_digest.encode()), raw_digest.encode(),
                              blob)
        except InvalidTag:
            raise GpusnapError(f"chunk {raw_digest} of {where} does not decrypt: it was "
                               "altered", "the registry's copy is damaged or tampered with; "
                               "nothing was restored") from None

    def seal_config(self, config: bytes) -> bytes:
        return self._seal(self._config_keys, b"config", config)

    def open_config(self, blob: bytes | bytearray, where: str) -> bytes:
        try:
            return self._open(self._config_keys, b"config", blob)
        except InvalidTag:
            raise GpusnapError(f"{where}: the checkpoint config does not decrypt with the "
                               "unwrapped data key: it was altered",
                               "the registry's copy is damaged or tampered with; nothing was "
                               "restored") from None

    def cache_index(self, raw_digest: str) -> str:
        """Where ChunkCache.blob_for/remember keep this chunk's blob under this
        data key (plain chunks use the raw digest itself)."""
        return "sha256:" + hashlib.sha256(f"{self.key_id}\n{raw_digest}".encode()).hexdigest()


def config_annotations(data_key: bytes, recipients: Sequence[keys.PublicKey]) -> dict[str, str]:
    """The annotations of the encrypted config's descriptor."""
    private_opts = {"symkey": base64.b64encode(data_key).decode(),
                    "cipheroptions": {}, "scheme": SCHEME}
    wrapped = jwe.encrypt(json.dumps(private_opts, separators=(",", ":")).encode(), recipients)
    pubopts = {"cipher": SCHEME, "hmac": "", "cipheroptions": {}}
    return {ANN_KEYS_JWE: base64.b64encode(wrapped).decode(),
            ANN_PUBOPTS: base64.b64encode(json.dumps(pubopts, separators=(",", ":")).encode())
            .decode(),
            ANN_RECIPIENTS: ",".join(keys.key_id(r) for r in recipients)}


def mark_encrypted(manifest: bytes, annotations: Mapping[str, str]) -> bytes:
    """A checkpoint manifest (bundle.build_manifest's bytes, built from the sealed
    config and blobs) with "+encrypted" media types, the wrapped key on the config
    descriptor, and layer titles that say what `oras pull` writes (".zst.enc")."""
    doc = json.loads(manifest)
    doc["config"]["mediaType"] = encrypted_media_type(doc["config"]["mediaType"])
    doc["config"]["annotations"] = {**doc["config"].get("annotations", {}), **annotations}
    for layer in doc.get("layers") or []:
        layer["mediaType"] = encrypted_media_type(layer["mediaType"])
        notes = layer.get("annotations") or {}
        title = notes.get("org.opencontainers.image.title")
        if title and not title.endswith(".enc"):
            notes["org.opencontainers.image.title"] = title + ".enc"
    return json.dumps(doc, separators=(",", ":")).encode()


def is_encrypted_manifest(manifest: Mapping) -> bool:
    return is_encrypted(str((manifest.get("config") or {}).get("mediaType", "")))


def _b64(annotations: Mapping[str, str], name: str, where: str) -> bytes:
    try:
        return base64.b64decode(annotations[name], validate=True)
    except KeyError:
        raise GpusnapError(f"{where} is encrypted but its config has no {name} annotation",
                           "it was encrypted by another tool, or the manifest is damaged") from None
    except ValueError:
        raise GpusnapError(f"{where}: the {name} annotation is not base64",
                           "the manifest is damaged") from None


def unwrap_data_key(annotations: Mapping[str, str], private: keys.PrivateKey, where: str) -> bytes:
    """The data key, with one of the recipients' private keys."""
    try:
        pubopts = json.loads(_b64(annotations, ANN_PUBOPTS, where))
        cipher = pubopts.get("cipher")
    except (ValueError, AttributeError):
        cipher = None
    if cipher != SCHEME:
        raise GpusnapError(f"{where} is encrypted with {cipher!r}, not {SCHEME}",
                           "it was encrypted by another tool or a newer gpusnap")
    plain = jwe.decrypt(_b64(annotations, ANN_KEYS_JWE, where), private, where)
    try:
        key = base64.b64decode(json.loads(plain)["symkey"], validate=True)
    except (ValueError, KeyError, TypeError):
        raise GpusnapError(f"{where}: the wrapped data key is not readable",
                           "it was encrypted by another tool") from None
    if len(key) != 32:
        raise GpusnapError(f"{where}: the wrapped data key is not 32 bytes",
                           "it was encrypted by another tool")
    return key


def recipients_of(annotations: Mapping[str, str], where: str) -> list[str]:
    """The recipients' key ids, from the JWE itself (the plain annotation is a copy
    anyone could edit)."""
    return jwe.recipient_ids(_b64(annotations, ANN_KEYS_JWE, where))
