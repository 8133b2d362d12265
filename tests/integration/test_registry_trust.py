"""Signed and encrypted checkpoints through a real registry (docker-registry, TLS,
htpasswd, on loopback), docs/trust.md: a signed push restores verified and the
container goes on; a tampered manifest or chunk, an unsigned checkpoint or one
signed by an untrusted key is refused in one line with nothing restored; an
encrypted push leaves none of a secret planted in the container's memory in
the registry's storage, while a plain push of the same container does; the
right key restores it, a wrong one is one line; re-pushes to the same
recipients dedup; no output, journal or log holds the registry password, a
private key or its passphrase."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
import zstandard

from tests.conftest import (COUNTER, DEMO_IMAGE, GPUSNAP, assert_continued, assert_one_line_error,
                            born, podman, read_counter, run, wait_counter)
from tests.integration import oci_registry
from tests.integration.oci_registry import USER, Registry, make_registry

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
JOURNAL = Path(os.environ.get("GPUSNAP_STATE_DIR", "/run/gpusnap")) / "journal.jsonl"


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch) -> None:
    """Each test its own chunk cache and data key secret (docs/trust.md)."""
    monkeypatch.setenv("GPUSNAP_CACHE_DIR", str(tmp_path / "chunk-cache"))
    monkeypatch.setenv("GPUSNAP_DATA_KEY_SECRET", str(tmp_path / "secret" / "data-key.secret"))


@dataclass
class Keys:
    dir: Path
    policy: Path

    def key(self, name: str) -> str:
        return str(self.dir / f"{name}.key")

    def pub(self, name: str) -> str:
        return str(self.dir / f"{name}.pub")


def generate(d: Path, name: str, kind: str, passphrase_file: Path | None = None) -> None:
    extra = ["--passphrase-file", str(passphrase_file)] if passphrase_file else []
    run([GPUSNAP, "key", "generate", "--type", kind, "-o", str(d / name), *extra], check=True)


def write_policy(path: Path, scope: str, trusted: list[str]) -> None:
    path.write_text(json.dumps({
        "default": {"type": "reject"},
        "scopes": {scope: {"type": "signedBy", "keyPaths": trusted}}}))
    os.chmod(path, 0o644)  # as root, a policy others can write is refused


@pytest.fixture
def keys(tmp_path, monkeypatch, registry) -> Keys:
    """ci (trusted signer), rogue (an untrusted signer), enc and other (P-256
    recipients); a policy trusting ci for this registry's trust/ repositories."""
    d = tmp_path / "keys"
    d.mkdir()
    for name, kind in (("ci", "ed25519"), ("rogue", "ed25519"), ("enc", "ecdsa-p256"),
                       ("other", "ecdsa-p256")):
        generate(d, name, kind)
    policy = d / "policy.json"
    write_policy(policy, f"{registry.host}/trust", [str(d / "ci.pub")])
    monkeypatch.setenv("GPUSNAP_POLICY", str(policy))
    return Keys(d, policy)


def gs(registry: Registry, *args: str, password: str | None = None,
       env: dict | None = None) -> subprocess.CompletedProcess:
    """gpusnap with this registry's flags, the password on stdin."""
    return run([GPUSNAP, *args, *registry.flags()],
               input=(password or oci_registry.PASSWORD) + "\n", env=env)


def gs_json(registry: Registry, *args: str, **kw) -> dict:
    res = gs(registry, *args, "--json", **kw)
    assert res.returncode == 0, (args, res.stdout, res.stderr)
    return json.loads(res.stdout)


def unique_ref(registry: Registry, tag: str = "v1") -> str:
    return registry.ref(f"trust/t-{uuid.uuid4().hex[:8]}:{tag}")


def export(container: str, path: Path) -> Path:
    run([GPUSNAP, "checkpoint", container, "--export", str(path), "--leave-running", "--json"],
        check=True)
    return path


def _staged() -> list[Path]:
    return [p for d in ("/var/tmp", "/var/lib/containers") for p in Path(d).glob(".gpusnap-pull-*")]


@pytest.fixture(autouse=True)
def staged_before() -> set[Path]:
    """Pulls staged by other runs on this shared host are not this test's."""
    return set(_staged())


def assert_nothing_restored(name: str, staged_before: set[Path]) -> None:
    assert podman("container", "exists", name, check=False).returncode == 1
    left = set(_staged()) - staged_before
    assert not left, left


def manifest_of(registry: Registry, ref: str) -> tuple[bytes, dict]:
    res = run(["oras", "manifest", "fetch", *registry.oras_flags(), ref], check=True)
    body = res.stdout.encode()
    return body, json.loads(body)


def put_manifest(registry: Registry, repository: str, tag: str, body: bytes) -> str:
    """What someone with write access to the registry can do."""
    import requests

    resp = requests.put(f"https://{registry.host}/v2/{repository}/manifests/{tag}", data=body,
                        headers={"Content-Type": OCI_MANIFEST}, verify=str(registry.ca),
                        auth=(USER, oci_registry.PASSWORD), timeout=30)
    assert resp.status_code == 201, resp.text
    return "sha256:" + hashlib.sha256(body).hexdigest()


def sig_tag(digest: str) -> str:
    return digest.replace(":", "-") + ".sig"


# -- signing ------------------------------------------------------------------------


def test_signed_push_restores_verified_and_the_container_goes_on(registry, keys, counter):
    ref = unique_ref(registry)
    before, token = read_counter(counter), born(counter)
    pushed = gs_json(registry, "push", counter, ref, "--stop", "--sign-key", keys.key("ci"))
    assert pushed["trust"]["signed"] and not pushed["trust"]["encrypted"]
    ci_id = json.loads(run([GPUSNAP, "key", "id", keys.pub("ci"), "--json"],
                           check=True).stdout)["key_id"]
    assert pushed["trust"]["signature_key_ids"] == [ci_id]
    _, sig = manifest_of(registry, ref.rsplit(":", 1)[0] + ":" + sig_tag(pushed["digest"]))
    assert sig["artifactType"] == "application/vnd.gpusnap.signature.v1"
    assert sig["subject"]["digest"] == pushed["digest"]

    info = gs_json(registry, "inspect", ref)
    assert info["trust"]["signed"] and info["trust"]["signature_key_ids"] == [ci_id]
    assert info["trust"]["verified"] is None  # inspect does not verify
    podman("rm", counter)

    restored = gs_json(registry, "restore", ref)
    assert restored["trust"]["verified"] is True and restored["trust"]["key_id"] == ci_id
    assert restored["trust"]["digest"] == pushed["digest"]
    assert restored["trust"]["policy"] == str(keys.policy)
    assert restored["container"]["status"] == "running"
    assert_continued(counter, before, token)
    value = read_counter(counter)
    assert wait_counter(counter, value) > value

    human = gs(registry, "inspect", ref)
    assert human.returncode == 0 and "signed: yes" in human.stdout, human.stdout


def test_tampered_manifest_or_chunk_is_refused_and_nothing_restored(registry, keys, counter,
                                                                    tmp_path, staged_before):
    token = born(counter)
    archive = export(counter, tmp_path / "c.tar.zst")
    ref = unique_ref(registry)
    repository = ref.split("/", 1)[1].rsplit(":", 1)[0]
    tag = ref.rsplit(":", 1)[1]
    pushed = gs_json(registry, "push", str(archive), ref, "--sign-key", keys.key("ci"))
    podman("rm", "-f", "-t", "0", counter)
    body, manifest = manifest_of(registry, ref)
    sig_body, _ = manifest_of(registry, ref.rsplit(":", 1)[0] + ":" + sig_tag(pushed["digest"]))

    # a chunk changed in the registry's storage: its digest no longer matches
    layer = max(manifest["layers"], key=lambda x: x["size"])
    blob = registry.blob_file(layer["digest"])
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF
    blob.write_bytes(bytes(data))
    try:
        res = gs(registry, "restore", ref)
        assert_one_line_error(res, "does not match its digest")
        assert_nothing_restored(counter, staged_before)
    finally:
        data[len(data) // 2] ^= 0xFF
        blob.write_bytes(bytes(data))

    # the manifest rewritten (another container name) under the same tag: unsigned
    forged = dict(manifest, annotations={**manifest["annotations"],
                                         "io.gpusnap.container.name": "someone-else"})
    forged_body = json.dumps(forged, separators=(",", ":")).encode()
    forged_digest = put_manifest(registry, repository, tag, forged_body)
    res = gs(registry, "restore", ref)
    assert_one_line_error(res, "is not signed", sig_tag(forged_digest))
    assert_nothing_restored(counter, staged_before)

    # ... and the original signature copied onto the forged manifest's tag
    put_manifest(registry, repository, sig_tag(forged_digest), sig_body)
    res = gs(registry, "restore", ref)
    assert_one_line_error(res, "is for manifest", pushed["digest"], forged_digest)
    assert_nothing_restored(counter, staged_before)
    res = gs(registry, "pull", ref, "-o", str(tmp_path / "x.tar.zst"))
    assert_one_line_error(res, "is for manifest")
    assert not list(tmp_path.glob("x.tar.zst*"))

    # the pinned original still restores, verified
    put_manifest(registry, repository, tag, body)
    restored = gs_json(registry, "restore", pushed["pinned"])
    assert restored["trust"]["verified"] is True
    assert_continued(counter, 0, token)


def test_unsigned_or_untrusted_is_refused_unless_insecure_skip_verify(registry, keys, counter,
                                                                      tmp_path, staged_before):
    before, token = read_counter(counter), born(counter)
    archive = export(counter, tmp_path / "c.tar.zst")
    unsigned = unique_ref(registry)
    gs_json(registry, "push", str(archive), unsigned, "--no-sign")
    rogue = unique_ref(registry)
    gs_json(registry, "push", str(archive), rogue, "--sign-key", keys.key("rogue"))
    podman("rm", "-f", "-t", "0", counter)

    res = gs(registry, "restore", unsigned)
    assert_one_line_error(res, "is not signed", "--insecure-policy")
    assert_nothing_restored(counter, staged_before)
    res = gs(registry, "restore", rogue)
    assert_one_line_error(res, "signed only by keys the policy does not trust")
    assert_nothing_restored(counter, staged_before)
    res = gs(registry, "pull", unsigned, "-o", str(tmp_path / "u.tar.zst"))
    assert_one_line_error(res, "is not signed")

    # no policy file at all: refused too, and says so
    res = gs(registry, "restore", unsigned,
             env={**os.environ, "GPUSNAP_POLICY": str(tmp_path / "none.json")})
    assert_one_line_error(res, "no policy file")

    res = gs(registry, "restore", unsigned, "--insecure-policy", "--json")
    assert res.returncode == 0, res.stderr
    assert "WARNING" in res.stderr and "--insecure-policy" in res.stderr
    restored = json.loads(res.stdout)
    assert restored["trust"]["verified"] is False and restored["trust"]["skipped"] is True
    assert "nobody vouching" in restored["trust"]["warning"]
    assert_continued(counter, before, token)


# -- encryption ---------------------------------------------------------------------


def planted(registry: Registry) -> list[bytes]:
    """Every blob in the registry's storage, and the zstd frames among them
    decompressed (a plain chunk is a zstd frame: that is what a reader gets)."""
    out = []
    dctx = zstandard.ZstdDecompressor()
    for data_file in (registry.storage / "docker/registry/v2/blobs").rglob("data"):
        data = data_file.read_bytes()
        out.append(data)
        try:
            out.append(dctx.decompress(data, max_output_size=64 << 20))
        except zstandard.ZstdError:
            pass
    return out


def test_encrypted_push_stores_no_secret_a_plain_push_does(keys, name, tmp_path, staged_before):
    """The secret lives only in a shell variable of the container's process: it
    is sent in by a file the process reads and deletes."""
    secret = f"gpusnap-planted-{uuid.uuid4().hex}"
    podman("run", "-d", "--name", name, "--network", "none", DEMO_IMAGE, "sh", "-c",
           "while [ ! -s /tmp/in ]; do sleep 0.05; done; S=$(cat /tmp/in); rm /tmp/in; "
           + COUNTER)
    podman("exec", name, "sh", "-c", f"printf %s {secret} > /tmp/in.new && mv /tmp/in.new /tmp/in")
    wait_counter(name, 3)
    enc_reg = make_registry(tmp_path / "enc-registry")
    plain_reg = make_registry(tmp_path / "plain-registry")
    try:
        write_policy(keys.policy, enc_reg.host, [keys.pub("ci")])
        enc_ref = enc_reg.ref("trust/secret:v1")
        before, token = read_counter(name), born(name)
        pushed = gs_json(enc_reg, "push", name, enc_ref, "--leave-running",
                         "--sign-key", keys.key("ci"), "--encrypt-to", keys.pub("enc"))
        assert pushed["trust"]["encrypted"] and len(pushed["trust"]["recipients"]) == 1
        plain_ref = plain_reg.ref("trust/secret:v1")
        gs_json(plain_reg, "push", name, plain_ref, "--leave-running")

        needle = secret.encode()
        assert any(needle in blob for blob in planted(plain_reg)), \
            "the plain push should hold the secret: the check would prove nothing"
        assert not any(needle in blob or needle[:24] in blob for blob in planted(enc_reg))
        _, manifest = manifest_of(enc_reg, enc_ref)
        assert manifest["config"]["mediaType"].endswith("+json+encrypted")
        assert {x["mediaType"] for x in manifest["layers"]} == \
            {"application/vnd.gpusnap.checkpoint.chunk.v1+zstd+encrypted"}

        info = gs_json(enc_reg, "inspect", enc_ref)  # no key: what the manifest says
        assert info["sealed"] and info["container"]["name"] == name
        assert info["trust"]["encrypted"] and info["trust"]["signed"]
        assert info["trust"]["recipients"] == pushed["trust"]["recipients"]
        opened = gs_json(enc_reg, "inspect", enc_ref, "--decrypt-key", keys.key("enc"))
        assert opened["criu"]["processes"] >= 1

        podman("rm", "-f", "-t", "0", name)
        res = gs(enc_reg, "restore", enc_ref)
        assert_one_line_error(res, "is encrypted", "--decrypt-key")
        assert_nothing_restored(name, staged_before)
        res = gs(enc_reg, "restore", enc_ref, "--decrypt-key", keys.key("other"))
        assert_one_line_error(res, "is not encrypted to key")
        assert_nothing_restored(name, staged_before)
        restored = gs_json(enc_reg, "restore", enc_ref, "--decrypt-key", keys.key("other"),
                           "--decrypt-key", keys.key("enc"))
        assert restored["trust"]["verified"] and restored["trust"]["encrypted"]
        assert_continued(name, before, token)
    finally:
        enc_reg.stop()
        plain_reg.stop()


def test_encrypted_re_push_dedups_and_plain_cache_entries_do_not_mix(registry, keys, counter,
                                                                    tmp_path):
    """One repository (a registry answers HEAD for the blobs of that repository)."""
    archive = export(counter, tmp_path / "c.tar.zst")
    repo = unique_ref(registry).rsplit(":", 1)[0]
    enc = ["--encrypt-to", keys.pub("enc"), "--sign-key", keys.key("ci")]
    first = gs_json(registry, "push", str(archive), f"{repo}:v1", *enc)
    assert first["chunks_sent"] > 0
    again = gs_json(registry, "push", str(archive), f"{repo}:v2", *enc)
    assert again["chunks_sent"] == 0 and again["bytes_sent"] == 0  # the same sealed blobs
    # another recipient set: another data key, nothing shared
    more = gs_json(registry, "push", str(archive), f"{repo}:v3", *enc,
                   "--encrypt-to", keys.pub("other"))
    assert more["chunks_sent"] > 0

    def layers(tag: str) -> set[str]:
        return {x["digest"] for x in manifest_of(registry, f"{repo}:{tag}")[1]["layers"]}

    assert layers("v2") == layers("v1") and not layers("v3") & layers("v1")
    # plain after encrypted, same chunk cache: plain blobs of their own, restorable
    plain_ref = f"{repo}:v4"
    plain = gs_json(registry, "push", str(archive), plain_ref, "--sign-key", keys.key("ci"))
    assert plain["chunks_sent"] > 0 and not plain["trust"]["encrypted"]
    assert not layers("v4") & (layers("v1") | layers("v3"))
    _, manifest = manifest_of(registry, plain_ref)
    assert {x["mediaType"] for x in manifest["layers"]} == \
        {"application/vnd.gpusnap.checkpoint.chunk.v1+zstd"}
    out = gs_json(registry, "pull", plain_ref, "-o", str(tmp_path / "p.tar.zst"))
    assert out["trust"]["verified"] and not out["trust"]["encrypted"]


def test_format_podman_push_is_encrypted_as_ocicrypt_does(registry, keys, counter, tmp_path):
    from gpusnap.trust import keys as trust_keys
    from gpusnap.trust.ocicrypt_layer import decrypt_layer

    archive = export(counter, tmp_path / "c.tar.zst")
    ref = unique_ref(registry)
    pushed = gs_json(registry, "push", str(archive), ref, "--format", "podman",
                     "--encrypt-to", keys.pub("enc"), "--sign-key", keys.key("ci"))
    assert pushed["trust"]["encrypted"] and pushed["trust"]["signed"]
    assert "--decryption-key" in pushed["restore_command"]
    _, manifest = manifest_of(registry, ref)
    layer = manifest["layers"][0]
    assert layer["mediaType"] == "application/vnd.oci.image.layer.v1.tar+zstd+encrypted"
    blob = registry.blob_file(layer["digest"]).read_bytes()
    private = trust_keys.load_private_key(keys.key("enc"))
    tar = zstandard.ZstdDecompressor().decompressobj().decompress(
        decrypt_layer(blob, layer["annotations"], private, ref))
    assert b"config.dump" in tar and b"spec.dump" in tar
    info = gs_json(registry, "inspect", ref)
    assert info["format"] == "podman" and info["trust"]["encrypted"] and info["trust"]["signed"]
    assert info["trust"]["recipients"] == pushed["trust"]["recipients"]


# -- no secret in any output --------------------------------------------------------


def test_no_password_key_or_passphrase_in_outputs_journal_or_logs(keys, name, tmp_path,
                                                                  monkeypatch):
    """A full cycle with passphrase-protected keys and a registry password of
    its own: migrate (checkpoint + sign + encrypt + push), inspect, pull,
    restore, and the failures a user meets (wrong passphrase, wrong password,
    wrong key); every stdout/stderr, the journal, the container's CRIU and
    hook logs and gpusnap's state dir are searched."""
    password = f"pw-{uuid.uuid4().hex}"
    passphrase = f"pp-{uuid.uuid4().hex}"
    monkeypatch.setattr(oci_registry, "PASSWORD", password)
    reg = make_registry(tmp_path / "registry")
    try:
        pp = tmp_path / "passphrase"
        pp.write_text(passphrase + "\n")
        os.chmod(pp, 0o600)
        d = tmp_path / "pkeys"
        d.mkdir()
        generate(d, "sign", "ecdsa-p256", pp)
        generate(d, "enc", "ecdsa-p256", pp)
        write_policy(keys.policy, reg.host, [str(d / "sign.pub")])
        bodies = []
        for f in ("sign.key", "enc.key"):
            pem = (d / f).read_text()
            assert "ENCRYPTED PRIVATE KEY" in pem
            body = "".join(line for line in pem.splitlines() if not line.startswith("-----"))
            bodies += [body, body[:48], base64.b64decode(body)[:32].hex()]
        needles = [password, passphrase, *bodies]

        podman("run", "-d", "--name", name, "--network", "none", DEMO_IMAGE, "sh", "-c", COUNTER)
        before = wait_counter(name, 3)
        token = born(name)
        ref = reg.ref("trust/scan:v1")
        outputs: list[str] = []

        def cmd(*args: str, ok: bool = True, env: dict | None = None, pw: str = password) -> dict:
            res = gs(reg, *args, "--json", password=pw, env=env)
            outputs.extend([res.stdout, res.stderr])
            assert (res.returncode == 0) == ok, (args, res.stdout, res.stderr)
            return json.loads(res.stdout) if res.stdout.strip() else {}

        env_pp = {**os.environ, "GPUSNAP_KEY_PASSPHRASE": passphrase}
        cmd("push", name, ref, "--leave-running", "--sign-key", str(d / "sign.key"), ok=False)
        cmd("push", name, ref, "--leave-running", "--sign-key", str(d / "sign.key"),
            "--passphrase-file", str(tmp_path / "keys" / "policy.json"), ok=False)
        cmd("push", name, ref, "--leave-running", pw="wrong-" + password, ok=False)
        cmd("migrate", name, ref, "--sign-key", str(d / "sign.key"),
            "--encrypt-to", str(d / "enc.pub"), "--passphrase-file", str(pp))
        podman("rm", name)
        cmd("inspect", ref)
        cmd("inspect", ref, "--decrypt-key", str(d / "enc.key"), env=env_pp)
        cmd("pull", ref, "-o", str(tmp_path / "p.tar.zst"), "--decrypt-key", str(d / "sign.key"),
            "--passphrase-file", str(pp), ok=False)
        cmd("pull", ref, "-o", str(tmp_path / "p.tar.zst"), "--decrypt-key", str(d / "enc.key"),
            "--passphrase-file", str(pp))
        restored = cmd("restore", ref, "--decrypt-key", str(d / "enc.key"), env=env_pp)
        assert restored["trust"]["verified"] and restored["trust"]["encrypted"]
        assert_continued(name, before, token)

        places: dict[str, str] = {f"output {i}": text for i, text in enumerate(outputs)}
        places["journal"] = JOURNAL.read_text(errors="replace")
        userdata = Path(podman("container", "inspect", name, "--format",
                               "{{.StaticDir}}").stdout.strip())
        state = JOURNAL.parent
        for root in (userdata, state, tmp_path / "chunk-cache"):
            for f in root.rglob("*"):
                try:  # the state dir is shared with other runs: files come and go
                    if f.is_file() and f.stat().st_size < 64 << 20:
                        places[str(f)] = f.read_bytes().decode("latin-1")
                except OSError:
                    continue
        assert any(f.endswith(".log") for f in places), sorted(places)
        for where, text in places.items():
            for needle in needles:
                assert needle not in text, f"{needle[:12]}... found in {where}"
    finally:
        reg.stop()
