"""The trust policy: longest scope wins, strict validation naming the field,
and the restore-time decision (verify.check)."""

from __future__ import annotations

import json
import os

import pytest

from gpusnap.errors import GpusnapError
from gpusnap.oci.reference import parse as ref
from gpusnap.trust import hostkey, keys, policy, signature, verify


@pytest.fixture
def signer(tmp_path):
    key = keys.generate("ed25519")
    keys.write_keypair(str(tmp_path / "ci"), key)
    return key


def write(tmp_path, doc) -> str:
    p = tmp_path / "policy.json"
    p.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    os.chmod(p, 0o644)
    return str(p)


def test_longest_scope_wins_on_path_boundaries(tmp_path, signer):
    pub = str(tmp_path / "ci.pub")
    p = policy.load(write(tmp_path, {
        "default": {"type": "reject"},
        "scopes": {
            "reg.io": {"type": "signedBy", "keyPaths": [pub]},
            "reg.io/ckpt": {"type": "insecureAcceptAnything"},
            "reg.io/ckpt/prod": {"type": "signedBy", "keyPaths": ["ci.pub"],  # relative: beside
                                 "signedIdentity": "matchDigestOnly"},
            "reg.io:5000": {"type": "reject"},
        }}))
    def scope(text):
        return p.for_reference(ref(text)).scope
    assert scope("reg.io/other/app:v1") == "reg.io"
    assert scope("reg.io/ckpt/app:v1") == "reg.io/ckpt"
    assert scope("reg.io/ckpt:v1") == "reg.io/ckpt"
    assert scope("reg.io/ckpt2/app:v1") == "reg.io"  # not a path prefix
    assert scope("reg.io/ckpt/prod/x@sha256:" + "a" * 64) == "reg.io/ckpt/prod"
    assert scope("reg.io:5000/ckpt/app") == "reg.io:5000"  # another port, another registry
    assert scope("other.io/ckpt/app") == "default"
    prod = p.for_reference(ref("reg.io/ckpt/prod/x"))
    assert list(prod.keys) == [keys.key_id(signer)] and prod.match_repository is False
    assert p.for_reference(ref("reg.io/a")).match_repository is True
    assert "PUBLIC KEY" not in repr(prod)


@pytest.mark.parametrize("doc,message", [
    ({}, 'has no "default" requirement'),
    ([], "is a list, not an object"),
    ({"default": {"type": "reject"}, "transports": {}}, "has unknown field(s) transports"),
    ({"default": {"type": "accept"}}, 'default.type is "accept"'),
    ({"default": {"type": "reject", "keyPaths": []}}, "default has unknown field(s) keyPaths"),
    ({"default": {"type": "signedBy"}}, "default is signedBy with no keys"),
    ({"default": {"type": "signedBy", "keyPaths": "x.pub"}}, "default.keyPaths is not a list"),
    ({"default": {"type": "signedBy", "keyPaths": ["missing.pub"]}},
     "default.keyPaths[0]: cannot read the public key"),
    ({"default": {"type": "signedBy", "keyData": ["not pem"]}},
     "default.keyData[0]: the inline key is not a PEM public key"),
    ({"default": {"type": "signedBy", "keyPaths": ["ci.pub"], "signedIdentity": "exact"}},
     'default.signedIdentity is "exact"'),
    ({"default": {"type": "reject"}, "scopes": {"reg.io/App": {"type": "reject"}}},
     'scopes["reg.io/App"] is not a scope'),
    ({"default": {"type": "reject"}, "scopes": {"reg.io/app:v1": {"type": "reject"}}},
     'scopes["reg.io/app:v1"] is not a scope'),
    ({"default": {"type": "reject"}, "scopes": {"reg.io/": {"type": "reject"}}},
     'scopes["reg.io/"] is not a scope'),
    ({"default": {"type": "reject"}, "scopes": {"reg.io": "reject"}},
     'scopes["reg.io"] is a str, not an object'),
    ('{"default": ', "not valid JSON"),
])
def test_strict_validation_names_the_field(tmp_path, signer, doc, message):
    path = write(tmp_path, doc)
    with pytest.raises(GpusnapError) as e:
        policy.load(path)
    assert message in e.value.message
    assert e.value.message.startswith(path)


def test_private_key_or_rsa_key_in_policy_is_refused(tmp_path, signer):
    with pytest.raises(GpusnapError, match=r"keyPaths\[0\]: .*holds a private key"):
        policy.load(write(tmp_path, {"default": {"type": "signedBy", "keyPaths": ["ci.key"]}}))
    from cryptography.hazmat.primitives.asymmetric import rsa
    (tmp_path / "rsa.pub").write_bytes(keys.public_pem(rsa.generate_private_key(65537, 2048)))
    with pytest.raises(GpusnapError, match=r"keyPaths\[0\] is a rsa-2048 key, which cannot sign"):
        policy.load(write(tmp_path, {"default": {"type": "signedBy", "keyPaths": ["rsa.pub"]}}))


def test_inline_key_data(tmp_path, signer):
    pem = keys.public_pem(signer).decode()
    p = policy.load(write(tmp_path, {"default": {"type": "signedBy", "keyData": [pem]}}))
    assert keys.key_id(signer) in p.default.keys


def test_missing_file_rejects_everything_unless_named(tmp_path, monkeypatch):
    monkeypatch.delenv(policy.POLICY_ENV, raising=False)
    monkeypatch.setattr(policy, "DEFAULT_PATH", tmp_path / "none.json")
    monkeypatch.setenv(hostkey.KEYS_ENV, str(tmp_path / "keys"))  # no key trusted here
    p = policy.load()
    assert p.source is None and p.for_reference(ref("reg.io/a")).type == "reject"
    with pytest.raises(GpusnapError, match="no policy file"):
        policy.load(tmp_path / "named.json")
    monkeypatch.setenv(policy.POLICY_ENV, str(tmp_path / "env.json"))
    with pytest.raises(GpusnapError, match="no policy file"):
        policy.load()


@pytest.mark.skipif(os.geteuid() != 0, reason="the check applies to root only")
def test_writable_policy_is_refused_for_root(tmp_path):
    path = write(tmp_path, {"default": {"type": "reject"}})
    os.chmod(path, 0o666)
    with pytest.raises(GpusnapError, match=r"can be written by other users \(mode 0666\)"):
        policy.load(path)


# -- verify.check: the decision restore makes -----------------------------------------------

REF = ref("reg.io/ckpt/app:v1")
DIGEST = "sha256:" + "c" * 64


def test_check_signed_unsigned_and_opt_outs(tmp_path, signer):
    p = policy.load(write(tmp_path, {
        "default": {"type": "reject"},
        "scopes": {"reg.io/ckpt": {"type": "signedBy", "keyPaths": ["ci.pub"]},
                   "reg.io/scratch": {"type": "insecureAcceptAnything"}}}))
    art = signature.build_artifact(signer, "reg.io/ckpt/app", DIGEST, 100)
    ok = verify.check(p, REF, DIGEST, art.manifest, lambda d, s: art.blobs[d])
    assert ok["verified"] is True and ok["key_id"] == keys.key_id(signer)
    assert ok["scope"] == "reg.io/ckpt"
    with pytest.raises(GpusnapError, match="is not signed") as e:
        verify.check(p, REF, DIGEST, None, lambda d, s: b"")
    assert "--insecure-policy" in e.value.hint
    skipped = verify.check(p, REF, DIGEST, None, lambda d, s: b"", skip_verify=True)
    assert skipped["verified"] is False and skipped["skipped"] and "skipped" in skipped["warning"]
    anything = verify.check(p, ref("reg.io/scratch/x"), DIGEST, None, lambda d, s: b"")
    assert anything["verified"] is False and "accepts anything" in anything["warning"]
    with pytest.raises(GpusnapError, match="rejects checkpoints from this registry"):
        verify.check(p, ref("other.io/x"), DIGEST, art.manifest, lambda d, s: art.blobs[d])
    other = keys.generate("ecdsa-p256")
    forged = signature.build_artifact(other, "reg.io/ckpt/app", DIGEST, 100)
    with pytest.raises(GpusnapError, match="signed only by keys the policy does not trust"):
        verify.check(p, REF, DIGEST, forged.manifest, lambda d, s: forged.blobs[d])


def test_check_without_policy_file(monkeypatch, tmp_path):
    monkeypatch.delenv(policy.POLICY_ENV, raising=False)
    monkeypatch.setattr(policy, "DEFAULT_PATH", tmp_path / "none.json")
    monkeypatch.setenv(hostkey.KEYS_ENV, str(tmp_path / "keys"))  # none trusted yet
    with pytest.raises(GpusnapError, match="no trust policy") as e:
        verify.check(policy.load(), REF, DIGEST, b"{}", lambda d, s: b"")
    assert "`gpusnap key trust signer.pub`" in e.value.hint


def test_without_a_policy_file_the_trusted_keys_decide(monkeypatch, tmp_path):
    """This host's own key (made on first use) and those `gpusnap key trust`
    added are accepted; another key's signature is refused with the two
    commands that would trust it."""
    monkeypatch.delenv(policy.POLICY_ENV, raising=False)
    monkeypatch.setattr(policy, "DEFAULT_PATH", tmp_path / "none.json")
    monkeypatch.setenv(hostkey.KEYS_ENV, str(tmp_path / "keys"))
    mine = keys.load_private_key(hostkey.ensure())
    assert (hostkey.private_path().stat().st_mode & 0o777) == 0o600
    art = signature.build_artifact(mine, "reg.io/ckpt/app", DIGEST, 100)
    ok = verify.check(policy.load(), REF, DIGEST, art.manifest, lambda d, s: art.blobs[d])
    assert ok["verified"] and ok["key_id"] == keys.key_id(mine)
    assert ok["policy"] == f"{hostkey.trusted_dir()} (no policy file)"

    other = keys.generate("ed25519")
    forged = signature.build_artifact(other, "reg.io/ckpt/app", DIGEST, 100)
    with pytest.raises(GpusnapError, match="signed only by keys this host does not trust") as e:
        verify.check(policy.load(), REF, DIGEST, forged.manifest, lambda d, s: forged.blobs[d])
    assert "gpusnap key export" in e.value.hint and "gpusnap key trust" in e.value.hint
    pub = tmp_path / "other.pub"
    pub.write_bytes(keys.public_pem(other))
    assert hostkey.trust(pub)[0] == keys.key_id(other)
    ok = verify.check(policy.load(), REF, DIGEST, forged.manifest, lambda d, s: forged.blobs[d])
    assert ok["key_id"] == keys.key_id(other)
    assert hostkey.ensure() == hostkey.private_path()  # made once, kept
