"""Key pairs: PEM round trips, key ids, passphrases, the `gpusnap key` commands,
and that no key byte or passphrase reaches an error line."""

from __future__ import annotations

import json
import os
import stat

import pytest
from click.testing import CliRunner
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from gpusnap.cli.key import key_group
from gpusnap.errors import GpusnapError
from gpusnap.trust import keys


@pytest.mark.parametrize("kind", keys.KEY_TYPES)
def test_write_and_load_round_trip(tmp_path, kind):
    key = keys.generate(kind)
    priv, pub = keys.write_keypair(str(tmp_path / "k"), key)
    assert stat.S_IMODE(os.stat(priv).st_mode) == 0o600
    assert priv.read_bytes().startswith(b"-----BEGIN PRIVATE KEY-----")  # PKCS#8
    assert pub.read_bytes().startswith(b"-----BEGIN PUBLIC KEY-----")  # SPKI
    loaded, loaded_pub = keys.load_private_key(priv), keys.load_public_key(pub)
    assert keys.kind(loaded) == keys.kind(loaded_pub) == kind
    assert keys.key_id(loaded) == keys.key_id(loaded_pub) == keys.key_id(key)
    assert keys.key_id(key) != keys.key_id(keys.generate(kind))


def test_key_id_is_sha256_of_spki_der(tmp_path):
    import hashlib
    key = keys.generate("ed25519")
    der = key.public_key().public_bytes(serialization.Encoding.DER,
                                        serialization.PublicFormat.SubjectPublicKeyInfo)
    assert keys.key_id(key) == "sha256:" + hashlib.sha256(der).hexdigest()


def test_passphrase_protected(tmp_path, monkeypatch):
    monkeypatch.delenv(keys.PASSPHRASE_ENV, raising=False)
    key = keys.generate("ecdsa-p256")
    priv, _ = keys.write_keypair(str(tmp_path / "k"), key, b"s3cret-pass")
    assert b"ENCRYPTED PRIVATE KEY" in priv.read_bytes()
    assert keys.key_id(keys.load_private_key(priv, b"s3cret-pass")) == keys.key_id(key)
    with pytest.raises(GpusnapError, match="protected by a passphrase") as e:
        keys.load_private_key(priv)
    assert keys.PASSPHRASE_ENV in e.value.hint
    with pytest.raises(GpusnapError, match="wrong passphrase") as e:
        keys.load_private_key(priv, b"wrong-guess")
    assert "wrong-guess" not in str(e.value) and "s3cret" not in str(e.value)


def test_passphrase_sources(tmp_path, monkeypatch):
    f = tmp_path / "pp"
    f.write_bytes(b"from-file\n")
    monkeypatch.setenv(keys.PASSPHRASE_ENV, "from-env")
    assert keys.passphrase_from(str(f)) == b"from-file"
    assert keys.passphrase_from(None) == b"from-env"
    monkeypatch.delenv(keys.PASSPHRASE_ENV)
    assert keys.passphrase_from(None) is None


def test_refuses_group_readable_private_key(tmp_path):
    priv, _ = keys.write_keypair(str(tmp_path / "k"), keys.generate())
    os.chmod(priv, 0o640)
    with pytest.raises(GpusnapError, match=r"read by other users \(mode 0640\)") as e:
        keys.load_private_key(priv)
    assert e.value.hint == f"chmod 600 {priv}"


def test_write_refuses_to_overwrite(tmp_path):
    keys.write_keypair(str(tmp_path / "k"), keys.generate())
    before = (tmp_path / "k.key").read_bytes()
    with pytest.raises(GpusnapError, match="exists already"):
        keys.write_keypair(str(tmp_path / "k"), keys.generate())
    assert (tmp_path / "k.key").read_bytes() == before


def test_bad_key_files_give_one_line_without_key_bytes(tmp_path):
    priv, pub = keys.write_keypair(str(tmp_path / "k"), keys.generate())
    secret_body = priv.read_bytes().splitlines()[1].decode()
    with pytest.raises(GpusnapError, match="holds a private key where a public key belongs") as e:
        keys.load_public_key(priv)
    assert secret_body not in str(e.value) and secret_body not in repr(e.value)
    with pytest.raises(GpusnapError, match="is not a PEM private key") as e:
        keys.load_private_key(pub)
    assert "pass the .key file" in e.value.hint
    damaged = tmp_path / "damaged.key"
    damaged.write_bytes(priv.read_bytes().replace(secret_body[10:20].encode(), b"A" * 10))
    os.chmod(damaged, 0o600)
    with pytest.raises(GpusnapError, match="cannot load the private key") as e:
        keys.load_private_key(damaged)
    assert secret_body[:20] not in str(e.value)
    with pytest.raises(GpusnapError, match="cannot read the public key"):
        keys.load_public_key(tmp_path / "missing.pub")
    garbage = tmp_path / "g.pub"
    garbage.write_text("hello")
    with pytest.raises(GpusnapError, match="is not a PEM public key"):
        keys.load_public_key(garbage)


def test_unsupported_key_types(tmp_path):
    p384 = ec.generate_private_key(ec.SECP384R1())
    small_rsa = rsa.generate_private_key(65537, 1024)
    for name, key in (("p384", p384), ("rsa1024", small_rsa)):
        path = tmp_path / f"{name}.pub"
        path.write_bytes(keys.public_pem(key))
        with pytest.raises(GpusnapError, match="which gpusnap does not take"):
            keys.load_public_key(path)
    with pytest.raises(GpusnapError, match="unknown key type"):
        keys.generate("dsa")


def test_cli_generate_json_and_id(tmp_path, monkeypatch):
    monkeypatch.delenv(keys.PASSPHRASE_ENV, raising=False)
    runner = CliRunner()
    prefix = str(tmp_path / "signer")
    r = runner.invoke(key_group, ["generate", "--type", "ecdsa-p256", "--output", prefix, "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert out["type"] == "ecdsa-p256" and out["encrypted"] is False
    assert out["private_key"] == prefix + ".key" and out["public_key"] == prefix + ".pub"
    assert "PRIVATE" not in r.output
    assert stat.S_IMODE(os.stat(prefix + ".key").st_mode) == 0o600
    for f in (prefix + ".key", prefix + ".pub"):
        r2 = runner.invoke(key_group, ["id", f, "--json"])
        assert r2.exit_code == 0, r2.output
        assert json.loads(r2.output)["key_id"] == out["key_id"]
    again = runner.invoke(key_group, ["generate", "--output", prefix, "--json"])
    assert again.exit_code == 1
    assert json.loads(again.output)["error"] == f"{prefix}.key exists already"


def test_cli_generate_with_passphrase_file(tmp_path, monkeypatch):
    monkeypatch.delenv(keys.PASSPHRASE_ENV, raising=False)
    pp = tmp_path / "pp"
    pp.write_text("correct horse\n")
    r = CliRunner().invoke(key_group, ["generate", "-o", str(tmp_path / "k"),
                                       "--passphrase-file", str(pp), "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["encrypted"] is True and "correct horse" not in r.output
    keys.load_private_key(tmp_path / "k.key", b"correct horse")
    r2 = CliRunner().invoke(key_group, ["id", str(tmp_path / "k.key"), "--json"])
    assert r2.exit_code == 1 and "protected by a passphrase" in json.loads(r2.output)["error"]
