"""The network drops under a push: the registry runs in its own network namespace
(the "registry host"), reached from this one over a veth pair built with
pyroute2; the link goes down mid-upload.

A dead link answers nothing: a request in flight waits out the client's read
timeout (120 s in gpusnap/oci/registry.py) before the push gives up, so this
test takes about two and a half minutes.
"""

from __future__ import annotations

import time

import pytest

from tests.conftest import assert_one_line_error, born, gpusnap_json, read_counter, wait_counter
from tests.faults.conftest import (finished, say, start_cli, status, tag_exists, unique_repo,
                                   when)
from tests.faults.netreg import VethLink, make_registry, make_veth_link

GIVE_UP_S = 200  # the read timeout, plus the retries' backoff, plus slack


@pytest.fixture
def link() -> VethLink:
    veth = make_veth_link()
    yield veth
    veth.remove()


@pytest.fixture
def far_registry(tmp_path, link):
    reg = make_registry(tmp_path / "far-registry", addr=link.peer_ip, netns=link.netns)
    yield reg
    reg.stop()


def test_link_down_mid_push_fails_in_one_line_and_the_push_resumes(far_registry, link, loaded,
                                                                   capsys):
    reg = far_registry
    repo = unique_repo()
    ref = reg.ref(f"{repo}:v1")
    before, token = read_counter(loaded), born(loaded)
    cli = start_cli("push", loaded, ref, "--leave-running", *reg.flags())
    when(lambda: len(reg.linked_blobs(repo)) >= 10, cli, "10 chunks were uploaded")
    link.set_up(False)
    down = time.monotonic()
    res = finished(cli, timeout=GIVE_UP_S + 60)
    took = time.monotonic() - down
    assert_one_line_error(res, f"cannot reach registry {reg.host}",
                          hint="then push again: chunks the registry already has are not sent again")
    assert took < GIVE_UP_S, f"the push hung {took:.0f} s on a dead link"
    assert status(loaded) == "running"  # --leave-running: the source never stopped
    assert wait_counter(loaded, before) > before
    assert born(loaded) == token
    link.set_up(True)
    assert not tag_exists(reg, repo, "v1"), "a tag for a push that failed"
    sent_before = reg.linked_blobs(repo)
    again = gpusnap_json("push", loaded, ref, "--leave-running", *reg.flags())
    # A new checkpoint of the same memory: the chunks that got through are not sent again.
    assert again["chunks_sent"] < again["chunks"] - len(sent_before) // 2, (again, len(sent_before))
    assert tag_exists(reg, repo, "v1")
    say(capsys, f"link down: failed after {took:.0f} s: {res.stderr.splitlines()[0]}; "
                f"re-push sent {again['chunks_sent']} of {again['chunks']} chunks")
    pulled = gpusnap_json("inspect", ref, *reg.flags())
    assert pulled["registry"]["chunks"] == again["chunks"]
