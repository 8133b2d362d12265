"""The network drops under a push and under a restore: the registry runs in its
own network namespace (the "registry host"), reached from this one over a veth
pair built with pyroute2; the link goes down mid-upload, or mid-download, or
loses some of its packets all along.

A dead link answers nothing (no reset: a down veth drops what is sent to it,
as a blackholed route does): a request in flight waits out the client's read
timeout (120 s in gpusnap/oci/registry.py), and every new connection its
connect timeout, before the push gives up, so the push's test takes about
three minutes. The restore's test shortens
that bound (GPUSNAP_WAIT_REGISTRY) to keep the suite short; the path is the same.
"""

from __future__ import annotations

import re
import time

import pytest

from gpusnap.oci.registry_options import RegistryOptions
from gpusnap.waits import Bound
from tests.conftest import (assert_continued, assert_one_line_error, born, gpusnap_json, podman,
                            read_counter, wait_counter)
from tests.faults.conftest import (FILL_MIB, cached_blobs, finished, say, start_cli, status,
                                   tag_exists, unique_repo, when)
from tests.faults.netreg import VethLink, make_registry, make_veth_link


def _one_request_s(first_read: bool) -> float:
    """How long one registry request tries on a dead link, by gpusnap's own
    bounds: a request in flight waits out the read bound, then every try
    waits out the connect bound (the down link drops the SYNs), with backoff."""
    opts = RegistryOptions()
    read = Bound.of("REGISTRY").seconds
    connect = min(10.0, read)  # oci/registry.py's _timeout
    tries = opts.retries - 1 if first_read else opts.retries
    backoff = sum(opts.backoff_s * 2 ** i for i in range(opts.retries - 1))
    return (read if first_read else 0) + tries * connect + backoff


# The requests in flight when the link goes down wait out their bounds; the
# chunks queued behind them are not sent once one has failed for good
# (oci/transfer.py): ~155 s at the default bounds, where each queued chunk
# trying in its turn made it ~200.
GIVE_UP_S = _one_request_s(True) + 30  # + slack for a loaded host
# what the line says the socket met (oci/unreachable.py), never an exception's class
SAID = re.compile(r"cannot reach registry \S+: (no connection within \d+ s|no answer within "
                  r"\d+ s|network unreachable|no route to host|connection (reset|cut))")


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
    assert SAID.search(res.stderr), res.stderr
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


def test_link_down_mid_restore_restores_nothing_and_the_restore_resumes(
        far_registry, link, loaded, cache_dir, monkeypatch, capsys):
    reg = far_registry
    ref = reg.ref(f"{unique_repo()}:v1")
    before, token = read_counter(loaded), born(loaded)
    gpusnap_json("migrate", loaded, ref, *reg.flags())
    podman("rm", loaded)
    monkeypatch.setenv("GPUSNAP_WAIT_REGISTRY", "20")  # read bound 20 s, connect 10 s, a try
    cli = start_cli("restore", ref, *reg.flags())
    when(lambda: cached_blobs(cache_dir) >= 10, cli, "10 chunks were fetched")
    link.set_up(False)
    down = time.monotonic()
    res = finished(cli, timeout=240)
    took = time.monotonic() - down
    assert_one_line_error(res, f"cannot reach registry {reg.host}")
    assert took < 150, f"the restore hung {took:.0f} s on a dead link"
    assert SAID.search(res.stderr), res.stderr
    assert status(loaded) == "gone", "restored from a partial download"
    link.set_up(True)
    again = gpusnap_json("restore", ref, *reg.flags())
    assert again["pull"]["bytes_from_cache"] > 0  # what got through is not fetched again
    say(capsys, f"link down mid-restore: failed after {took:.0f} s: "
                f"{res.stderr.splitlines()[0]}; re-run: {again['pull']['bytes_from_cache']} "
                f"bytes from the cache, {again['pull']['bytes_fetched']} fetched")
    assert_continued(loaded, before, token)


LOSS_PERCENT = 10  # each way; TCP resends what is lost, at a fraction of the speed


def test_a_lossy_link_slows_migrate_and_restore_but_both_complete(far_registry, link, loaded,
                                                                   cache_dir, capsys):
    """A link that drops LOSS_PERCENT of its packets each way, all along: no bound
    of gpusnap's takes the slow link for a dead one. The checkpoint goes
    through, every chunk of the restore comes over that link, and the
    container counts on from the checkpoint."""
    reg, repo = far_registry, unique_repo()
    ref = reg.ref(f"{repo}:v1")
    before, token = read_counter(loaded), born(loaded)
    link.lose(LOSS_PERCENT)
    started = time.monotonic()
    pushed = gpusnap_json("migrate", loaded, ref, *reg.flags())
    push_s = time.monotonic() - started
    assert tag_exists(reg, repo, "v1")
    podman("rm", loaded)
    started = time.monotonic()
    restored = gpusnap_json("restore", ref, *reg.flags())
    restore_s = time.monotonic() - started
    assert restored["pull"]["bytes_fetched"] > FILL_MIB << 20, restored["pull"]  # all over the link
    say(capsys, f"{LOSS_PERCENT}% lost each way: migrate {push_s:.0f} s "
                f"({pushed.get('chunks_sent')} chunks sent), restore {restore_s:.0f} s "
                f"({restored['pull']['bytes_fetched']} bytes fetched)")
    assert_continued(loaded, before, token)
