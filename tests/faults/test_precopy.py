"""Pre-copy migration through a loopback registry: a first round pushed while the
container runs (`gpusnap migrate -P`), prefetched into the target's chunk cache
(`gpusnap pull --prefetch`, killed halfway and resumed), then the final round
(`gpusnap migrate`) and `gpusnap restore` of it on the target.

Source and target keep separate chunk caches (GPUSNAP_CACHE_DIR per command),
as two hosts would: the source's remembers which blob each chunk became, the
target's holds the blobs it fetched.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from tests.conftest import GPUSNAP, assert_continued, assert_one_line_error, born, podman, \
    read_counter
from tests.faults.conftest import cached_blobs, say, sigkill, status, unique_repo, when


def _on(cache: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([GPUSNAP, *args], capture_output=True, text=True,
                          env={**os.environ, "GPUSNAP_CACHE_DIR": str(cache)})


def _json(cache: Path, *args: str) -> dict:
    res = _on(cache, *args, "--json")
    assert res.returncode == 0, (args, res.stdout, res.stderr)
    return json.loads(res.stdout)


def test_precopy_final_round_sends_what_changed_and_restores_from_the_prefetch(
        registry, loaded, tmp_path, capsys):
    source, target = tmp_path / "source-cache", tmp_path / "target-cache"
    repo = unique_repo()
    pre, final = registry.ref(f"{repo}:pre"), registry.ref(f"{repo}:final")

    # Round 1 while the container runs on.
    first = _json(source, "migrate", "-P", loaded, pre, *registry.flags())
    assert first["pre_checkpoint"] is True
    assert first["annotations"]["io.gpusnap.pre-checkpoint"] == "true"
    assert status(loaded) == "running"
    assert "gpusnap pull --prefetch" in first["prefetch_command"]

    # The target warms its cache; killed halfway, run again, it fetches only the rest.
    cli = subprocess.Popen([GPUSNAP, "pull", "--prefetch", pre, *registry.flags()],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env={**os.environ, "GPUSNAP_CACHE_DIR": str(target)})
    when(lambda: cached_blobs(target) >= 10, cli, "10 chunks were prefetched")
    sigkill(cli)
    had = cached_blobs(target)
    warm = _json(target, "pull", "--prefetch", pre, *registry.flags())
    assert warm["pre_checkpoint"] is True
    assert 0 < warm["chunks_fetched"] < warm["chunks"], warm
    assert warm["chunks_fetched"] <= warm["chunks"] - had + 2  # entries in flight at the kill
    assert warm["bytes_already_cached"] > 0
    assert cached_blobs(target) >= warm["chunks"] - 1  # repeated chunks share a blob
    # A pre-checkpoint is not restored by mistake: the source ran on after it.
    refused = _on(target, "restore", pre, *registry.flags())
    assert_one_line_error(refused, "pre-checkpoint", hint="--name")

    # The container changes ~1% of its memory (1.6 of 160 MiB), then the final round.
    podman("exec", loaded, "dd", "if=/dev/urandom", "of=/dev/shm/fill", "bs=64k", "count=26",
           "seek=700", "conv=notrunc")
    before, token = read_counter(loaded), born(loaded)
    last = _json(source, "migrate", loaded, final, *registry.flags())
    assert status(loaded) == "exited"
    ratio = last["bytes_sent"] / first["bytes_sent"]
    podman("rm", loaded)
    restored = _json(target, "restore", final, *registry.flags())
    pulled = restored["pull"]
    fetched = pulled["bytes_fetched"] / (pulled["bytes_fetched"] + pulled["bytes_from_cache"])
    say(capsys, f"pre-copy: round 1 sent {first['bytes_sent'] >> 20} MiB, the final round "
                f"{last['bytes_sent'] >> 10} KiB ({100 * ratio:.2f}%); the target fetched "
                f"{100 * fetched:.2f}% of the final round, the rest from its prefetched cache")
    assert ratio < 0.10, (first["bytes_sent"], last["bytes_sent"])
    assert fetched < 0.10, pulled
    assert_continued(loaded, before, token, timeout=30)  # it counts on from the final round
