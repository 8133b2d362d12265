"""criu/runtimes.py: which runtimes hand CRIU gpusnap's action script."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from gpusnap.criu import runtimes
from gpusnap.errors import GpusnapError
from gpusnap.ops import restore_ref
from gpusnap.runtime import podman


def test_runc_does_other_runtimes_do_not(monkeypatch):
    monkeypatch.delenv(runtimes.TRUST_ENV, raising=False)
    assert runtimes.runs_action_script("runc")
    assert runtimes.runs_action_script("/usr/sbin/runc")
    assert runtimes.runs_action_script("")  # Podman's default where none is told
    assert not runtimes.runs_action_script("/usr/bin/youki")


def _fake_crun(tmp_path, version: str) -> str:
    crun = tmp_path / "crun"
    crun.write_text(f"#!/bin/sh\necho 'crun version {version}'\necho 'commit: x'\n")
    crun.chmod(0o755)
    return str(crun)


def test_crun_does_from_1_26_with_a_libcriu_that_sets_config_files(monkeypatch, tmp_path):
    monkeypatch.delenv(runtimes.TRUST_ENV, raising=False)
    monkeypatch.setattr(runtimes, "libcriu_sets_config_file", lambda: True)
    assert not runtimes.runs_action_script(_fake_crun(tmp_path, "1.21"))
    assert "crun 1.21 hands CRIU no configuration file" in runtimes.why_not(str(tmp_path / "crun"))
    assert runtimes.runs_action_script(_fake_crun(tmp_path, "1.28"))
    monkeypatch.setattr(runtimes, "libcriu_sets_config_file", lambda: False)
    assert not runtimes.runs_action_script(str(tmp_path / "crun"))
    assert "crun 1.28 with a libcriu older than 4.2" in runtimes.why_not(str(tmp_path / "crun"))
    assert not runtimes.runs_action_script(str(tmp_path / "no-such-crun"))
    monkeypatch.setenv(runtimes.TRUST_ENV, "1")
    assert runtimes.runs_action_script("crun")
    monkeypatch.setenv(runtimes.TRUST_ENV, "0")
    monkeypatch.setattr(runtimes, "libcriu_sets_config_file", lambda: True)
    assert not runtimes.runs_action_script(str(tmp_path / "crun"))


def test_the_libcriu_probe_reads_this_hosts_library():
    # Debian 12 here: libcriu2 3.17 (no criu_set_config_file) or none at all.
    assert runtimes.libcriu_sets_config_file() is False


def test_a_restore_uses_the_runtime_config_dump_names():
    assert restore_ref._restoring_runtime({"config.dump": b'{"runtime": "runc"}'}, "crun") == "runc"
    assert restore_ref._restoring_runtime({"config.dump": b'{"name": "x"}'}, "crun") == "crun"
    assert restore_ref._restoring_runtime({"config.dump": b"not json"}, "crun") == "crun"



def test_a_cuda_container_under_crun_is_refused_before_anything(monkeypatch, tmp_path):
    import pytest

    from gpusnap.errors import GpusnapError
    from gpusnap.ops import checkpoint
    from gpusnap.runtime.podman import Container

    monkeypatch.setenv(runtimes.TRUST_ENV, "0")
    ctr = Container("abc", "llm", "running", 4242, "img", False, tmp_path, [], runtime="crun")
    monkeypatch.setattr(checkpoint, "require_supported", lambda verb: None)
    monkeypatch.setattr(checkpoint, "cuda_processes", lambda pid: ["a CUDA process"])
    monkeypatch.setattr(checkpoint, "cuda_plugin_path", lambda: None)
    monkeypatch.setattr(checkpoint, "read_inventory", lambda *a: pytest.fail("the GPU was asked"))
    with pytest.raises(GpusnapError) as err:
        checkpoint.plan("llm", None, False, False, 10_000, container=ctr)
    assert "runs under crun" in err.value.message and "keeps running" in err.value.message
    assert "--runtime runc" in err.value.hint


def test_a_static_address_of_another_network_is_explained(monkeypatch):
    import subprocess

    import pytest

    from gpusnap.errors import GpusnapError
    from gpusnap.runtime import podman

    err = "Error: requested static ip 10.89.0.2 not in any subnet on network podman\n"
    monkeypatch.setattr(podman, "_run", lambda args, bound=None, watch=None, progress=None:
                        subprocess.CompletedProcess(args, 125, "", err))
    with pytest.raises(GpusnapError) as e:
        podman.restore("/x.tar.zst", archive=True, name=None, keep=False, tcp_established=False)
    assert "requested static ip 10.89.0.2" in e.value.message
    assert "new --name" in e.value.hint


def test_a_gpu_checkpoint_is_refused_where_the_runtime_would_not_bring_it_back(monkeypatch):
    import pytest

    from gpusnap.errors import GpusnapError
    from tests.conftest import foreign_h100_manifest

    monkeypatch.setenv(runtimes.TRUST_ENV, "0")
    manifest = foreign_h100_manifest()
    runtimes.require_gpu_restore("runc", manifest, "a.tar", "nothing was changed")
    runtimes.require_gpu_restore("crun", None, "a.tar", "nothing was changed")  # no GPU in it
    as_dict = {"quiesced_by": "criu-cuda-plugin", "processes": [{"pid": 7}]}
    runtimes.require_gpu_restore("crun", as_dict, "a.tar", "x")  # CRIU's plugin brings it back
    for given in (manifest, {"quiesced_by": "gpusnap", "processes": [{"pid": 7}]}):
        with pytest.raises(GpusnapError) as err:
            runtimes.require_gpu_restore("/usr/bin/crun", given, "ref", "nothing was downloaded")
        assert err.value.message.startswith("ref holds CUDA processes")
        assert "under crun" in err.value.message and err.value.message.endswith("nothing was downloaded")
        assert "runc" in err.value.hint


def test_crun_restores_are_checked_in_pre_restore_runc_ones_by_the_hook(monkeypatch, tmp_path):
    import pytest

    from gpusnap import MANIFEST_NAME, PLAN_NAME
    from gpusnap.action import action
    from gpusnap.errors import GpusnapError
    from tests.conftest import foreign_h100_manifest

    images = tmp_path / "userdata" / "checkpoint"
    images.mkdir(parents=True)
    action.check_without_hook(str(images), 1)  # no manifest: nothing to check
    (images / MANIFEST_NAME).write_text(foreign_h100_manifest().to_json())
    (tmp_path / "userdata" / "config.json").write_text("{}")
    monkeypatch.setattr(action, "_runtime_of", lambda pid: "runc")
    action.check_without_hook(str(images), 1)  # runc: its hook checks
    monkeypatch.setattr(action, "_runtime_of", lambda pid: "crun")
    monkeypatch.setattr("gpusnap.gpu.bundle_plan.plan_restore_here",
                        lambda path, spec: (["no NVIDIA GPU on this host"], None))
    with pytest.raises(GpusnapError, match="cannot restore here: no NVIDIA GPU"):
        action.check_without_hook(str(images), 1)
    # `gpusnap restore`'s plan is re-checked here too, as runc's hook re-checks it:
    # its GPU may have filled up while the restore downloaded
    (images / PLAN_NAME).write_text("{}")
    with pytest.raises(GpusnapError, match="cannot restore here: no NVIDIA GPU"):
        action.check_without_hook(str(images), 1)
    monkeypatch.setattr("gpusnap.gpu.bundle_plan.plan_restore_here",
                        lambda path, spec: ([], None))  # the pinned plan holds
    action.check_without_hook(str(images), 1)


def test_the_runtime_that_started_criu_is_its_parent():
    import os
    import subprocess
    from pathlib import Path

    from gpusnap.action import action
    child = subprocess.Popen(["sleep", "5"])
    try:
        assert action._runtime_of(child.pid) == Path(f"/proc/{os.getpid()}/comm").read_text().strip()
    finally:
        child.kill()
        child.wait()
    assert action._runtime_of(0) == ""


def test_the_old_hostname_is_replaced_only_where_it_stands_as_a_word(tmp_path):
    from gpusnap.runtime import identity

    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1\tlocalhost\n10.88.0.4\t4147f24bde4a web\n"
                     "10.88.0.5\t4147f24bde4a0 x.4147f24bde4a\n")
    identity._rewrite(str(hosts), "4147f24bde4a", "fc3e7329036c")
    assert hosts.read_text() == ("127.0.0.1\tlocalhost\n10.88.0.4\tfc3e7329036c web\n"
                                 "10.88.0.5\t4147f24bde4a0 x.4147f24bde4a\n")
    identity._rewrite(str(tmp_path / "missing"), "a", "b")  # nothing to rewrite: no error


def test_doctor_judges_the_runtime_podman_uses(monkeypatch, tmp_path):
    from gpusnap.ops import doctor
    from gpusnap.runtime import podman

    crun = _fake_crun(tmp_path, "1.21")
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    monkeypatch.setattr(doctor.shutil, "which", lambda n, path=None: crun if n == "crun" else
                        ("/usr/bin/podman" if n == "podman" else None))
    monkeypatch.setattr(podman, "default_runtime", lambda: "crun")
    monkeypatch.delenv(runtimes.TRUST_ENV, raising=False)
    monkeypatch.setattr(runtimes, "libcriu_sets_config_file", lambda: True)
    old = doctor._runtime_check()
    assert old.level == "warning" and "crun 1.21 hands CRIU no configuration file" in old.detail
    assert "crun >= 1.26" in old.fix
    _fake_crun(tmp_path, "1.28")
    assert doctor._runtime_check().level == "ok"
    monkeypatch.setattr(podman, "default_runtime", lambda: "runc")  # runc, not installed
    missing = doctor._runtime_check()
    assert missing.level == "error" and missing.detail == "runc: not found"


def test_podman_info_read_field_by_field(monkeypatch, tmp_path):
    """One blank field leaves the other two; a Podman that fails answers blanks;
    none installed is said where the answer is wanted, in one line."""
    monkeypatch.setenv("GPUSNAP_STATE_DIR", str(tmp_path / "state"))

    def info(out: str, rc: int = 0):
        return lambda args, timeout=None: subprocess.CompletedProcess(args, rc, out, "")
    monkeypatch.setattr(podman, "_run", info("4.3.1\tcrun\t\n"))
    assert podman.ask_host_facts()() == podman.HostFacts("4.3.1", "crun", None)
    monkeypatch.setattr(podman, "_run", info("\trunc\t/var/lib/containers/storage\n"))
    assert podman.host_facts() == podman.HostFacts("", "runc",
                                                   Path("/var/lib/containers/storage"))
    monkeypatch.setattr(podman, "_run", info("", rc=125))
    assert podman.host_facts() == podman.HostFacts("", "", None)
    monkeypatch.undo()
    monkeypatch.setattr(podman.shutil, "which", lambda name: None)
    with pytest.raises(GpusnapError, match="podman is not installed"):
        podman.ask_host_facts()()


def test_podman_info_is_asked_once_while_podman_and_its_configuration_stay(monkeypatch, tmp_path):
    """`podman info` takes every container's lock (it counts them by state), so a
    restore beside another container's restore or checkpoint waited for its end:
    its answer is kept until Podman's version or a file that sets its runtime or
    storage changes."""
    monkeypatch.setenv("GPUSNAP_STATE_DIR", str(tmp_path / "state"))
    conf = tmp_path / "containers.conf"
    conf.write_text('[engine]\nruntime = "crun"\n')
    monkeypatch.setenv("CONTAINERS_CONF", str(conf))
    asked: list[str] = []
    version = ["4.3.1"]

    def run(args, timeout=None):
        asked.append(args[0])
        out = version[0] if args[0] == "version" else \
            f"{version[0]}\tcrun\t/var/lib/containers/storage\n"
        return subprocess.CompletedProcess(args, 0, out, "")
    monkeypatch.setattr(podman, "_run", run)
    monkeypatch.setattr(podman.shutil, "which", lambda name: "/bin/sh")  # a stable binary
    want = podman.HostFacts("4.3.1", "crun", Path("/var/lib/containers/storage"))
    assert podman.host_facts() == want and asked.count("info") == 1
    assert podman.host_facts() == want and podman.default_runtime() == "crun"
    assert asked.count("info") == 1 and asked.count("version") == 3  # no lock taken again
    conf.write_text('[engine]\nruntime = "runc"\n# longer\n')
    podman.host_facts()
    assert asked.count("info") == 2  # the configuration changed
    version[0] = "5.8.0"
    assert podman.host_facts().version == "5.8.0" and asked.count("info") == 3
    (tmp_path / "state" / "podman-facts.json").write_text("{not json")
    assert podman.host_facts() == podman.HostFacts("5.8.0", "crun",
                                                   Path("/var/lib/containers/storage"))
    assert asked.count("info") == 4  # a damaged file: asked again
