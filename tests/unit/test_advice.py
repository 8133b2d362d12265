"""ops/advice.py: what a push, migrate or pull tells the user, as printed
(the commands themselves run as printed in tests/integration/test_hints.py)."""

from __future__ import annotations

import pytest

from gpusnap.errors import GpusnapError
from gpusnap.oci.registry import RegistryOptions
from gpusnap.ops import advice, restore

PINNED = "reg.example.com/jobs/train@sha256:" + "ab" * 32


def test_the_restore_line_carries_the_registry_flags_and_never_the_password():
    opts = RegistryOptions(username="me", password="secret", plain_http=True)
    r = {"pinned": PINNED, "annotations": {}}
    line, renamed = advice.restore_command(r, opts, None, here=False)
    assert line == f"gpusnap restore {PINNED} --plain-http --username me --password-stdin"
    assert renamed is None and "secret" not in line


def test_an_encrypted_checkpoint_asks_for_the_key_and_containerd_says_where():
    r = {"pinned": PINNED, "trust": {"encrypted": True}, "source": "containerd://ml/job",
         "annotations": {"io.gpusnap.engine": "containerd", "io.gpusnap.container.name": "job"}}
    line, _ = advice.restore_command(r, RegistryOptions(), None, here=False)  # another host
    assert line.endswith("--decrypt-key KEY --to containerd://ml/job")
    line, _ = advice.restore_command(r, RegistryOptions(), None, here=True)  # job is still here
    assert line.endswith("--to containerd://ml/job-2")
    # pushed from k3s's containerd: restored into it, not the default socket's
    line, _ = advice.restore_command(r, RegistryOptions(), None, here=True,
                                     containerd_address="/run/k3s/containerd/containerd.sock")
    assert line.endswith("--to containerd://ml/job-2 "
                         "--containerd-address /run/k3s/containerd/containerd.sock")


def test_the_container_state_says_what_the_verb_did():
    r = {"container": "job", "reference": "reg/x:v1"}
    assert advice.container_state(r, leave_running=False)["says"] == \
        "checkpointed and stopped (exited); its state now lives in reg/x:v1"
    assert advice.container_state(r, False, uploading=True)["says"].endswith("being uploaded")
    assert advice.container_state(r, True, migrate=True)["says"].endswith("(--leave-running)")
    assert advice.container_state(r, True, pre_checkpoint=True)["says"].startswith(
        "checkpointed and still running: a pre-copy round")
    assert advice.container_state({**r, "source_kind": "containerd-container"}, False)["status"] \
        == "stopped"
    assert advice.container_state({}, False) is None


def test_a_prefetch_line_quotes_what_a_shell_would_split():
    opts = RegistryOptions(authfile="/tmp/my auth.json")
    line = advice.gpusnap_command(["pull", "--prefetch", PINNED], opts)
    assert line.endswith("--authfile '/tmp/my auth.json'")


def test_a_printed_podman_pull_trusts_the_ca_file_the_way_podman_takes_one(tmp_path):
    # Podman has no --ca-file: --cert-dir names a folder whose *.crt are CAs
    ca = tmp_path / "certs" / "ca.crt"
    assert RegistryOptions(ca_file=str(ca)).podman_flags() == f" --cert-dir {ca.parent}"
    assert RegistryOptions(ca_file=str(ca), plain_http=True).podman_flags() == \
        " --tls-verify=false"


# ops.restore.free_name: the --name a printed restore line adds, asked of Podman
# after a push or pull is done.


@pytest.fixture
def podman_here(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUSNAP_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setattr(restore.shutil, "which", lambda name: f"/usr/bin/{name}")


def test_a_taken_name_gets_the_first_free_number(podman_here, monkeypatch):
    taken = {"web", "web-2"}
    monkeypatch.setattr(restore.podman, "exists", lambda name: name in taken)
    assert restore.free_name("web") == "web-3"
    assert restore.free_name("api") is None


def test_a_podman_that_does_not_answer_costs_the_line_its_name_not_the_push(podman_here,
                                                                             monkeypatch):
    def held(name):  # another container's dump holds Podman past the query's bound
        raise GpusnapError("podman container exists: no answer within 120 s")
    monkeypatch.setattr(restore.podman, "exists", held)
    assert restore.free_name("web") is None
