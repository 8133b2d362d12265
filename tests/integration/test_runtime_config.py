"""Whether CRIU runs gpusnap's action script under the OCI runtime Podman uses
here, measured from CRIU's own dump.log against gpusnap's probe
(criu/runtimes.py): runc always; crun from 1.26 with libcriu >= 4.2 (the
version matrix's Debian sid root), not crun 1.21 with libcriu 4.1 (trixie)."""

from __future__ import annotations

import uuid
from pathlib import Path

from gpusnap.criu.runtimes import runs_action_script
from gpusnap.runtime import podman as podman_rt
from tests.conftest import COUNTER, DEMO_IMAGE, podman, read_counter, run, wait_counter


def test_criu_runs_the_action_script_exactly_where_gpusnap_says_it_does():
    name = f"gst-rtconf-{uuid.uuid4().hex[:6]}"
    podman("run", "-d", "--name", name, DEMO_IMAGE, "sh", "-c", COUNTER)
    try:
        runtime = podman("inspect", "-f", "{{.OCIRuntime}}", name).stdout.strip()
        userdata = Path(podman("inspect", "-f", "{{.StaticDir}}", name).stdout.strip())
        before = wait_counter(name, 0)
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
        assert wait_counter(name, before) > before  # and the container counts on
        assert read_counter(name) > before
    finally:
        run(["podman", "rm", "-f", "-t", "0", name])
