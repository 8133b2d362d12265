"""Whether CRIU runs gpusnap's action script under the OCI runtime Podman uses
here, measured from CRIU's own dump.log against gpusnap's probe
(criu/runtimes.py): runc always; crun from 1.26 with libcriu >= 4.2 (the
version matrix's Debian sid root), not crun 1.21 with libcriu 4.1 (trixie)."""

from __future__ import annotations

import uuid
from pathlib import Path

from gpusnap.criu.runtimes import runs_action_script
from gpusnap.runtime import podman as podman_rt
from gpusnap.runtime.storage import storage_root
from tests.conftest import (COUNTER, DEMO_IMAGE, assert_continued, assert_one_line_error, born,
                            gpusnap, gpusnap_json, journal_mark, journal_since, podman,
                            read_counter, run, wait_counter, with_gpu_manifest)


def test_criu_runs_the_action_script_exactly_where_gpusnap_says_it_does():
    name = f"gst-rtconf-{uuid.uuid4().hex[:6]}"
    podman("run", "-d", "--name", name, DEMO_IMAGE, "sh", "-c", COUNTER)
    try:
        runtime = podman("inspect", "-f", "{{.OCIRuntime}}", name).stdout.strip()
        userdata = Path(podman("inspect", "-f", "{{.StaticDir}}", name).stdout.strip())
        before = wait_counter(name, 0)
        token = born(name)
        podman("container", "checkpoint", "--keep", name)
        dump_log = (userdata / "dump.log").read_text(errors="replace")
        # CRIU logs "Running pre-dump scripts" whatever it has (crun's RPC notify
        # counts), then one "[PATH]" line per script it runs.
        ran = dump_log.count("/libexec/criu-action]") >= 2  # pre-dump and post-dump
        assert ran == runs_action_script(runtime), (runtime, podman_rt.default_runtime(),
                                                    [ln for ln in dump_log.splitlines()
                                                     if "config file" in ln])
        podman("container", "restore", "--keep", name)
        restore_log = (userdata / "restore.log").read_text(errors="replace")
        assert ("/libexec/criu-action]" in restore_log) == ran
        assert_continued(name, before, token)  # and the container counts on
        assert read_counter(name) > before
    finally:
        run(["podman", "rm", "-f", "-t", "0", name])


def test_gpu_checkpoint_is_refused_where_nothing_would_bring_the_gpu_back(tmp_path):
    """A checkpoint whose CUDA processes gpusnap quiesced, on this GPU-less host:
    `gpusnap restore` refuses it in one line whatever the runtime (no such GPU
    here, or a runtime that would not run the action script); plain `podman
    container restore` is refused by the OCI hook under runc and, since crun
    runs no hook at restore, by the action script under a crun that runs it."""
    name = f"gst-gpuref-{uuid.uuid4().hex[:6]}"
    podman("run", "-d", "--name", name, DEMO_IMAGE, "sh", "-c", COUNTER)
    restored = (f"{name}-a", f"{name}-b")
    try:
        runtime = podman("inspect", "-f", "{{.OCIRuntime}}", name).stdout.strip()
        wait_counter(name, 0)
        token = born(name)
        export = tmp_path / "ctr.tar.zst"
        gpusnap_json("checkpoint", name, "--export", str(export), "--leave-running")
        archive = with_gpu_manifest(export, tmp_path)
        res = gpusnap("restore", str(archive), "--name", restored[0])
        if runs_action_script(runtime):
            assert_one_line_error(res, "cannot restore here", "NVIDIA GPU")
        else:
            assert_one_line_error(res, "holds CUDA processes", f"under {runtime}", "nothing was changed")
        if runtime == "runc" or runs_action_script(runtime):
            seen = journal_mark()
            res = podman("container", "restore", "--import", str(archive), "--name", restored[1],
                         check=False)
            assert res.returncode != 0, res.stdout
            if runtime == "runc":  # runc prints what its hook said
                assert "gpusnap: cannot restore here" in res.stderr, res.stderr
            else:  # crun quotes CRIU's first "Error" line: on this host a harmless rlimit one
                refusals = [e for e in journal_since(seen) if e["event"] == "refused-restore"]
                assert refusals and "cannot restore here" in refusals[0]["error"], refusals
        for other in restored:
            state = podman("ps", "-a", "--filter", f"name=^{other}$", "--format", "{{.Status}}").stdout
            assert "Up" not in state, (other, state)
        before = read_counter(name)
        assert wait_counter(name, before) > before  # the source counts on, untouched
        assert born(name) == token
    finally:
        for other in (name, *restored):
            run(["podman", "rm", "-f", "-t", "0", other])


def test_the_facts_a_restore_asks_are_podmans_own_answers():
    """Version, default runtime and graph root as a restore reads them (asked of
    `podman info` once, then kept, podman.host_facts): what Podman itself says."""
    def said(field: str) -> str:
        return run(["podman", "info", "--format", field], check=True).stdout.strip()
    for _ in range(2):  # asked, then kept
        facts = podman_rt.ask_host_facts()()
        assert facts.version and facts.version == podman_rt.version() == said("{{.Version.Version}}")
        assert facts.runtime and facts.runtime == podman_rt.default_runtime() == \
            said("{{.Host.OCIRuntime.Name}}")
        assert facts.graph_root == storage_root() == Path(said("{{.Store.GraphRoot}}"))