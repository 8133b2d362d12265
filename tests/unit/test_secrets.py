"""No password, token, key or container environment in what gpusnap prints, logs,
journals or pushes: errors, the journal, `inspect`, annotations, the GPU manifest."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from gpusnap import archive, journal
from gpusnap.errors import GpusnapError
from gpusnap.oci import bundle, podman_image, reference
from gpusnap.redact import has_userinfo, redact

SECRET = "s3cr3t-Tok3n-9f8e7d6c5b4a"


@pytest.mark.parametrize("text", [
    f"user:{SECRET}@reg.io/app:v1",
    f"'user:{SECRET}@reg.io' is not a registry reference",
    f"https://user:{SECRET}@auth.reg.io/token?scope=x",
    f"Invalid header value: 'Bearer {SECRET}\\n'",
    f"Authorization: Basic {SECRET}==",
    f'{{"password": "{SECRET}"}}',
    f"GET /token?service=reg&token={SECRET}&x=1",
])
def test_redact_hides_credentials(text):
    assert SECRET not in redact(text)


@pytest.mark.parametrize("text", [
    "reg.io:5000/ckpt/app:v1@sha256:" + "a" * 64,
    "Basic authentication failed for user 'gpusnap' (--username)",
    "pass --username and --password-stdin, or `podman login reg.io`",
    "/var/lib/containers/storage: 12 MiB free",
])
def test_redact_leaves_ordinary_text(text):
    assert redact(text) == text and not has_userinfo(text.split(" ")[0])


@pytest.mark.parametrize("text", [f"user:{SECRET}@reg.io/app:v1", f"user:{SECRET}@reg.io",
                                  f"https://user:{SECRET}@reg.io/app", f"user:pa/{SECRET}@reg.io/app"])
def test_a_reference_with_credentials_is_refused_without_echoing_them(text):
    with pytest.raises(GpusnapError) as err:
        reference.parse(text)
    assert SECRET not in str(err.value)
    assert "credentials" in err.value.message and "--password-stdin" in err.value.hint
    assert reference.try_parse(text) is None


def test_references_with_digests_and_ports_still_parse():
    ref = reference.parse("reg.io:5000/app:v1@sha256:" + "b" * 64)
    assert (ref.registry, ref.tag) == ("reg.io:5000", "v1")
    with pytest.raises(GpusnapError, match="bad digest"):
        reference.parse("reg.io:5000/app:v1@sha256:short")


def test_cli_errors_are_redacted(capsys):
    from gpusnap.cli.output import handle_errors

    @handle_errors
    def failing(as_json: bool = False):
        raise GpusnapError(f"{'user:' + SECRET}@reg.io/x: no such file",
                           f"token service said token={SECRET}")

    for as_json in (False, True):
        with pytest.raises(SystemExit):
            failing(as_json=as_json)
        out, err = capsys.readouterr()
        assert SECRET not in out + err and "no such file" in out + err


def test_journal_records_are_redacted(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUSNAP_STATE_DIR", str(tmp_path / "state"))
    journal.record("failed", error=f"push to https://u:{SECRET}@reg.io/x failed", n=3)
    text = (tmp_path / "state" / "journal.jsonl").read_text()
    assert SECRET not in text and journal.read()[-1]["n"] == 3


def test_credentials_never_show_in_a_repr():
    from gpusnap.oci.auth import Credentials
    from gpusnap.oci.registry import RegistryOptions

    assert SECRET not in repr(RegistryOptions(username="u", password=SECRET))
    assert SECRET not in repr(Credentials("u", SECRET, "auth.json"))
    assert Credentials("u", SECRET, "x").password == SECRET


def test_a_spec_error_never_quotes_an_environment_value():
    from gpusnap.oci.spec import SpecError
    from gpusnap.oci.spec.validate import validate_env

    for env in ([SECRET], [1, f"K={SECRET}"]):
        with pytest.raises(SpecError) as err:
            validate_env({"env": env})
        assert SECRET not in str(err.value)


# --- the registry client ---------------------------------------------------------------


class _Registry(BaseHTTPRequestHandler):
    """/v2/ asks for a Bearer token from ``realm``; the token service answers ``token``
    (``token_fails``: its first answers are 503s, counted in ``token_asked``)."""
    realm = ""
    token = ""
    token_status = 200
    token_fails = 0
    token_asked = 0

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        if self.path.startswith("/token"):
            type(self).token_asked += 1
            body = json.dumps({"token": self.token}).encode()
            self.send_response(503 if self.token_asked <= self.token_fails else self.token_status)
        elif self.headers.get("Authorization"):
            body = b"{}"
            self.send_response(200)
        else:
            body = b'{"errors":[{"code":"UNAUTHORIZED","message":"authentication required"}]}'
            self.send_response(401)
            self.send_header("WWW-Authenticate", f'Bearer realm="{self.realm}",service="reg"')
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def registry():
    server = ThreadingHTTPServer(("127.0.0.1", 0), type("H", (_Registry,), {}))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def _client(server, password: str = "pw", retries: int = 1):
    pytest.importorskip("requests")
    from gpusnap.oci.registry import RegistryClient, RegistryOptions

    ref = reference.parse(f"127.0.0.1:{server.server_port}/ckpt/app:v1")
    return RegistryClient(ref, RegistryOptions(username="u", password=password, plain_http=True,
                                               retries=retries, backoff_s=0))


def test_a_token_service_that_blips_is_asked_again_and_named_when_it_stays_down(registry):
    """Tokens expire mid-push: one 503 of the token service failed the push
    (since the first failed chunk fails it all, at once); its tries are the
    registry's, and a service that stays down is named as the token service."""
    from gpusnap.oci.registry import TransientError

    handler = registry.RequestHandlerClass
    handler.realm = f"http://127.0.0.1:{registry.server_port}/token"
    handler.token, handler.token_fails = "t0k", 2
    _client(registry, retries=4).ping()
    assert handler.token_asked == 3
    handler.token_asked, handler.token_fails = 0, 99
    with pytest.raises(TransientError) as err:
        _client(registry, retries=4).ping()
    assert handler.token_asked == 4
    assert err.value.message.startswith(f"token service http://127.0.0.1:{registry.server_port}"
                                        "/token of registry 127.0.0.1:")
    assert "(after 4 tries)" in err.value.message


def test_a_token_requests_refuses_as_a_header_is_not_quoted(registry):
    """requests' InvalidHeader repeats the header value: the token."""
    handler = registry.RequestHandlerClass
    handler.realm = f"http://127.0.0.1:{registry.server_port}/token"
    handler.token = SECRET + "\n"
    with pytest.raises(GpusnapError) as err:
        _client(registry).ping()
    assert SECRET not in str(err.value) and "InvalidHeader" in err.value.message


def test_a_token_realm_with_userinfo_is_not_quoted(registry):
    handler = registry.RequestHandlerClass
    handler.realm = f"http://user:{SECRET}@127.0.0.1:{registry.server_port}/token"
    handler.token_status = 500
    with pytest.raises(GpusnapError) as err:
        _client(registry).ping()
    assert SECRET not in str(err.value)
    assert f"127.0.0.1:{registry.server_port}/token" in err.value.message


def test_a_refused_password_is_not_quoted(registry):
    handler = registry.RequestHandlerClass
    handler.realm = f"http://127.0.0.1:{registry.server_port}/token"
    handler.token_status = 401
    with pytest.raises(GpusnapError) as err:
        _client(registry, password=SECRET).ping()
    assert SECRET not in str(err.value) and "refused the credentials" in err.value.message


# --- inspect, annotations, the GPU manifest: no environment -----------------------------


def _contents_with_environment() -> archive.CheckpointContents:
    env = ["PATH=/usr/bin", f"SECRET_TOKEN={SECRET}"]
    spec = {"process": {"env": env, "args": ["sh", "-c", f"echo {SECRET}"]},
            "linux": {"devices": [{"path": "/dev/nvidia0"}]}, "annotations": {"a": "b"}}
    config = {"name": "ctr", "id": "abc", "rootfsImageName": "localhost/demo:latest",
              "createdTime": "2026-01-01T00:00:00Z", "runtime": "runc", "spec": spec,
              "env": env, "command": ["sh", "-c", f"echo {SECRET}"]}
    return archive.CheckpointContents(
        source="ctr.tar.zst",
        sizes={"config.dump": 1, "spec.dump": 1, "checkpoint/pages-1.img": 4096,
               "checkpoint/mm-1.img": 10},
        files={"config.dump": json.dumps(config).encode(), "spec.dump": json.dumps(spec).encode()})


def test_summary_annotations_and_bundle_config_carry_no_environment():
    contents = _contents_with_environment()
    summary = contents.summary()
    assert SECRET not in json.dumps(summary)
    assert summary["container"]["name"] == "ctr" and summary["devices"] == ["/dev/nvidia0"]
    b = bundle.Bundle(files=[bundle.FileEntry("config.dump", "file", size=1)], summary=summary,
                      gpu_manifest=None, chunking={}, compression={})
    assert SECRET not in b.to_json().decode()
    assert SECRET not in json.dumps(bundle.annotations(b, "4.1", "x86_64"))


def test_podman_format_annotations_carry_no_environment():
    config = json.loads(_contents_with_environment().files["config.dump"])
    info = {"host": {"arch": "amd64", "ociRuntime": {"name": "runc", "version": "1.1"}},
            "version": {"Version": "4.3.1"}}
    notes = podman_image.annotations(config, info, "4.1")
    assert SECRET not in json.dumps(notes)
    manifest = json.loads(podman_image.manifest("sha256:" + "0" * 64, 2, "sha256:" + "1" * 64, 3,
                                                notes))
    assert SECRET not in json.dumps(podman_image.summary(manifest, "reg.io/x:v1"))


def test_gpu_manifest_has_no_place_for_an_environment():
    from gpusnap.gpu.manifest import Manifest, ManifestError
    from tests.conftest import foreign_h100_manifest

    data = json.loads(foreign_h100_manifest().to_json())
    assert set(data["processes"][0]) == {"pid", "comm", "gpus", "gpu_memory"}  # no cmdline, no env
    data["processes"][0]["env"] = [f"SECRET_TOKEN={SECRET}"]
    with pytest.raises(ManifestError) as err:
        Manifest.from_dict(data)
    assert SECRET not in str(err.value)


def test_workers_that_meet_a_dead_token_service_together_do_not_each_try_it_in_turn(registry):
    """Tokens expire under several upload threads at once: the first one's
    tries failed, and each waiting thread then ran its own (minutes each on a
    service that takes connections and answers nothing); they share the one."""
    from concurrent.futures import ThreadPoolExecutor

    from gpusnap.oci.registry import TransientError

    handler = registry.RequestHandlerClass
    handler.realm = f"http://127.0.0.1:{registry.server_port}/token"
    handler.token_fails = 99
    client = _client(registry, retries=3)
    with ThreadPoolExecutor(6) as pool:
        errors = [f.exception(timeout=30) for f in [pool.submit(client.ping) for _ in range(6)]]
    assert all(isinstance(e, TransientError) for e in errors), errors
    assert handler.token_asked == 3, handler.token_asked
