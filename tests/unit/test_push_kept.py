"""The words of a push that failed once its checkpoint stopped the container
(ops/push_source.KeptError): the retry is printed as the user would type it,
with the reference and flags this push had."""

from __future__ import annotations

import shlex

from gpusnap.oci.registry import RegistryOptions
from gpusnap.ops.advice import push_command
from gpusnap.ops.push_source import kept_error
from gpusnap.trust.options import TrustOptions


def test_the_retry_carries_the_reference_trust_and_registry_flags(tmp_path):
    exc = kept_error(ConnectionError("registry gone"), "web", "in /x/checkpoint.tar",
                     "/x/checkpoint.tar", "`podman rm web; gpusnap restore /x/checkpoint.tar`")
    assert "`gpusnap push /x/checkpoint.tar REF` tries again" in exc.hint  # before push() fills it
    trust = TrustOptions(sign_keys=(str(tmp_path / "me.key"),),
                         encrypt_to=(str(tmp_path / "them.pub"),))
    command = push_command(exc.push_from, "reg:5000/app:v1", RegistryOptions(plain_http=True),
                           trust, "gpusnap")
    exc.with_push(command)
    printed = exc.hint.split("`")[1]
    assert shlex.split(printed) == ["gpusnap", "push", "/x/checkpoint.tar", "reg:5000/app:v1",
                                    "--sign-key", str(tmp_path / "me.key"),
                                    "--encrypt-to", str(tmp_path / "them.pub"), "--plain-http"]
    assert exc.hint.endswith("`podman rm web; gpusnap restore /x/checkpoint.tar` brings it "
                             "back here")


def test_a_podman_format_push_is_retried_as_one():
    command = push_command("/x/checkpoint.tar", "reg/app:v1", RegistryOptions(), None, "podman")
    assert shlex.split(command)[4:6] == ["--format", "podman"]
