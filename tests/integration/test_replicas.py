"""Several replicas restored from one checkpoint in a registry, on one host,
sharing its chunk cache: each its own container counting on independently
under a hostname of its own, the second one downloading nothing, a damaged
cache entry fetched again, two restores at once on one cache."""

from __future__ import annotations

import subprocess
import uuid
from pathlib import Path

import pytest

from tests.conftest import (COUNTER, DEMO_IMAGE, GPUSNAP, assert_continued, born, gpusnap_json,
                            podman, read_counter, run, wait_counter)
from tests.integration.oci_registry import PASSWORD
from tests.integration.test_registry import gs_json, unique_ref

pytestmark = pytest.mark.usefixtures("cache_dir")


def _replicas(*names: str) -> None:
    for n in names:
        run(["podman", "rm", "-f", "-t", "0", n])


def test_replicas_from_one_ref_count_on_independently_and_share_the_cache(
        registry, counter, cache_dir):
    ref = unique_ref(registry)
    before, token = read_counter(counter), born(counter)
    pushed = gs_json("push", counter, ref, *registry.flags())  # a copy: it keeps running
    names = [f"{counter}-r{i}" for i in range(1, 4)]
    try:
        pulls = [gs_json("restore", pushed["pinned"], "--name", n, *registry.flags())["pull"]
                 for n in names]
        assert pulls[0]["bytes_fetched"] > 0
        for p in pulls[1:]:  # the host's cache holds every chunk: nothing downloaded
            assert p["bytes_fetched"] == 0 and p["bytes_from_cache"] > 0, p
        for n in names:
            assert_continued(n, before, token)  # on from the checkpoint's count
        # each a hostname of its own: Podman's, from its own ID, not the source's
        hostnames = {n: _hostnames(n) for n in [counter, *names]}
        for n in names:
            ctr_id = podman("inspect", "-f", "{{.Id}}", n).stdout.strip()
            assert hostnames[n] == (ctr_id[:12],) * 3, (n, hostnames[n])
        assert len({h[0] for h in hostnames.values()}) == len(hostnames), hostnames
        # independent: one stopped, the others and the original count on
        podman("stop", "-t", "0", names[0])
        for n in [counter, *names[1:]]:
            now = read_counter(n)
            assert wait_counter(n, now) > now

        # Damaged cache entries are noticed (their digests) and fetched again. All
        # of them: with one, the first file found may be one this restore never
        # reads (a CI run of 2026-11-26 saw bytes_fetched 0 and passed on retry).
        for blob in [p for p in (cache_dir / "blobs").rglob("*") if p.is_file()]:
            blob.write_bytes(b"damaged" + blob.read_bytes()[7:])
        again = gs_json("restore", pushed["pinned"], "--name", f"{counter}-r4",
                        *registry.flags())["pull"]
        names.append(f"{counter}-r4")
        assert again["bytes_fetched"] > 0, again
        assert_continued(names[-1], before, token)
    finally:
        _replicas(*names)


def test_two_restores_at_once_on_one_empty_cache_both_succeed(registry, counter, cache_dir):
    ref = unique_ref(registry)
    token = born(counter)
    pushed = gs_json("push", counter, ref, *registry.flags())
    names = [f"{counter}-a", f"{counter}-b"]
    procs = [subprocess.Popen([GPUSNAP, "restore", pushed["pinned"], "--name", n,
                               *registry.flags(), "--json"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for n in names]
    try:
        for p in procs:
            out, err = p.communicate(PASSWORD + "\n", timeout=300)
            assert p.returncode == 0, (out, err)
        for n in names:
            assert_continued(n, 0, token)
        assert not list(Path(cache_dir / "tmp").iterdir())  # no half-written entry left
    finally:
        _replicas(*names)


def _hostnames(name: str) -> tuple[str, str, str]:
    """The container's hostname: its UTS namespace's, /etc/hostname, and the one
    /etc/hosts gives its own address."""
    uts = podman("exec", name, "cat", "/proc/sys/kernel/hostname").stdout.strip()
    etc = podman("exec", name, "cat", "/etc/hostname").stdout.strip()
    hosts = podman("exec", name, "cat", "/etc/hosts").stdout.split()
    own = next((w for w in hosts if w in (uts, etc)), "")
    return uts, etc, own


def test_a_copy_gets_its_own_hostname_unless_the_user_chose_one(tmp_path):
    """From an archive: the derived hostname follows the copy's ID; one set with
    `podman run --hostname` stays on every copy (as for containers of one spec)."""
    tag = uuid.uuid4().hex[:6]
    derived, chosen = f"gst-host-{tag}", f"gst-chosen-{tag}"
    copies = [f"{derived}-copy", f"{chosen}-copy"]
    podman("run", "-d", "--name", derived, DEMO_IMAGE, "sh", "-c", COUNTER)
    podman("run", "-d", "--name", chosen, "--hostname", "web1", DEMO_IMAGE, "sh", "-c", COUNTER)
    try:
        for src, copy in zip((derived, chosen), copies):
            wait_counter(src, 0)
            token = born(src)
            archive = tmp_path / f"{src}.tar.zst"
            gpusnap_json("checkpoint", src, "--export", str(archive), "--leave-running")
            restored = gpusnap_json("restore", str(archive), "--name", copy)["container"]
            if src == derived:
                # (reported where gpusnap changed it: Podman 4.3 keeps the checkpoint's)
                assert restored.get("hostname", restored["id"][:12]) == restored["id"][:12]
                assert _hostnames(copy) == (restored["id"][:12],) * 3
                assert _hostnames(src) != _hostnames(copy)
            else:
                assert "hostname" not in restored, restored
                assert _hostnames(copy) == ("web1",) * 3 == _hostnames(src)
            assert_continued(copy, read_counter(copy), token)
    finally:
        _replicas(derived, chosen, *copies)


def test_a_pinned_ref_this_host_holds_restores_with_the_registry_down(counter, cache_dir, tmp_path):
    """--pull missing (the default), as Podman's for images: a REF pinned by
    digest that this host restored before is opened from its cache (manifest,
    config and chunks, each checked against its digest), the registry not
    asked; --pull always asks it, and a tag is always asked (tags move)."""
    from tests.faults.netreg import make_registry

    before, token = read_counter(counter), born(counter)
    reg = make_registry(tmp_path / "registry")
    names = [f"{counter}-p1", f"{counter}-p2", f"{counter}-p3"]
    try:
        tagged = reg.ref(f"ckpt/pinned-{uuid.uuid4().hex[:8]}:v1")
        pinned = gs_json("push", counter, tagged, *reg.flags())["pinned"]
        first = gs_json("restore", pinned, "--name", names[0], *reg.flags())["pull"]
        assert first["registry_asked"] is True and first["bytes_fetched"] > 0, first
    finally:
        reg.stop()
    try:
        second = gs_json("restore", pinned, "--name", names[1], *reg.flags())["pull"]
        assert second["registry_asked"] is False and second["bytes_fetched"] == 0, second
        assert_continued(names[1], before, token)
        for ref, extra in ((pinned, ["--pull", "always"]), (tagged, [])):
            res = run([GPUSNAP, "restore", ref, "--name", names[2], *reg.flags(), *extra])
            assert res.returncode != 0, res.stdout
            assert "cannot reach registry" in res.stderr and "Traceback" not in res.stderr, \
                res.stderr
            assert podman("container", "exists", names[2], check=False).returncode == 1
    finally:
        _replicas(*names)
