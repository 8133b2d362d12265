"""gpusnap.hook.main and action/prestart.py, the OCI prestart/poststop hook: records GPUs, forgets them, refuses a
restore onto GPUs that cannot take the checkpoint, and never blocks a container otherwise."""

from __future__ import annotations

import io
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from gpusnap import MANIFEST_NAME, PLAN_NAME, journal
from gpusnap.gpu import inventory as inventory_module
from gpusnap.gpu.gpumap import parse_gpu_map
from gpusnap.gpu.inventory import GpuInfo, Inventory
from gpusnap.gpu.manifest import SCHEMA
from gpusnap.gpu.gpumap import GPU_MAP_ANNOTATION
from gpusnap.action import prestart as hook
from gpusnap.hook import main as hook_main
from gpusnap.runtime import kept_checkpoint
from tests.unit.fakes import UUID0, UUID1, gpu, inventory

REPO = Path(__file__).resolve().parents[2]
CTR = "4f1c0ffee"


@pytest.fixture
def state_dir(tmp_path: Path, monkeypatch) -> Path:
    path = tmp_path / "state"
    monkeypatch.setenv("GPUSNAP_STATE_DIR", str(path))
    return path


@pytest.fixture
def host(monkeypatch):
    """This host's GPUs as the hook sees them (NVML replaced)."""
    inv = inventory(gpu(0, UUID0, minor=0), gpu(1, UUID1, minor=1))
    monkeypatch.setattr(inventory_module, "read_inventory", lambda *a: inv)
    return inv


def bundle(tmp_path: Path, devices: list[dict], manifest: dict | None = None) -> Path:
    path = tmp_path / "bundle"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"ociVersion": "1.0.2",
                                                  "linux": {"devices": devices}}))
    if manifest is not None:
        (path / "checkpoint").mkdir()
        (path / "checkpoint" / MANIFEST_NAME).write_text(json.dumps(manifest))
    return path


def dev(path: str, minor: int) -> dict:
    return {"path": path, "type": "c", "major": 195, "minor": minor}


def state(bundle_dir: Path, status: str = "created") -> dict:
    return {"ociVersion": "1.0.2", "id": CTR, "status": status, "pid": 4242,
            "bundle": str(bundle_dir)}


def run_main(monkeypatch, stdin: str, stage: str | None = None) -> int:
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    monkeypatch.setattr(sys, "argv", ["gpusnap-hook"] + ([stage] if stage else []))
    return hook_main.main()


def manifest_for(*uuids: str) -> dict:
    return {"schema": SCHEMA, "quiesced_by": "gpusnap", "driver_version": "580.159.04",
            "cuda_driver_version": "13.0", "criu_version": "4.1.1", "processes": [],
            "gpus": [{"index": i, "uuid": u, "name": "NVIDIA H100 80GB HBM3"}
                     for i, u in enumerate(uuids)]}


def record_file(state_dir: Path) -> Path:
    return state_dir / "containers" / f"{CTR}.json"


def events(kind: str) -> list[dict]:
    return [e for e in journal.read() if e["event"] == kind]


# --- prestart at create -------------------------------------------------------------------

def test_prestart_records_the_gpus_the_container_was_given(tmp_path, state_dir, host, monkeypatch):
    b = bundle(tmp_path, [dev("/dev/nvidia0", 1), dev("/dev/nvidiactl", 255), dev("/dev/null", 3)])
    assert run_main(monkeypatch, json.dumps(state(b))) == 0
    record = json.loads(record_file(state_dir).read_text())
    # host GPU 1 appears as /dev/nvidia0 in the container: the minor decides
    assert record == {"id": CTR, "gpus": [{"path": "/dev/nvidia0", "minor": 1, "uuid": UUID1,
                                           "name": "NVIDIA H100 80GB HBM3"}],
                      "inventory_read_by": "hook"}  # no agent: a plain start
    assert stat.S_IMODE(record_file(state_dir).stat().st_mode) == 0o600


def test_prestart_records_a_device_this_host_does_not_know_without_uuid(tmp_path, state_dir, host,
                                                                          monkeypatch):
    b = bundle(tmp_path, [dev("/dev/nvidia7", 7)])
    assert run_main(monkeypatch, json.dumps(state(b))) == 0
    gpus = json.loads(record_file(state_dir).read_text())["gpus"]
    assert gpus == [{"path": "/dev/nvidia7", "minor": 7, "uuid": None, "name": None}]


def test_prestart_of_a_container_without_gpus_records_nothing(tmp_path, state_dir, host, monkeypatch):
    b = bundle(tmp_path, [dev("/dev/nvidiactl", 255), dev("/dev/nvidia-uvm", 0)])
    assert run_main(monkeypatch, json.dumps(state(b))) == 0
    assert not record_file(state_dir).exists()


def test_a_create_gives_up_a_checkpoint_a_failed_restore_kept_and_a_restore_does_not(
        tmp_path, state_dir, host, monkeypatch):
    """runtime/kept_checkpoint.py: a fresh start gives the kept state up."""
    b = bundle(tmp_path, [dev("/dev/nvidia0", 1)])
    (b / kept_checkpoint.KEPT_NAME / "checkpoint").mkdir(parents=True)
    (b / kept_checkpoint.KEPT_NAME / "checkpoint/inventory.img").write_bytes(b"inv")
    (b / "checkpoint").mkdir(exist_ok=True)
    (b / "checkpoint/inventory.img").write_bytes(b"inv")  # a restore's
    assert run_main(monkeypatch, json.dumps(state(b))) == 0
    assert kept_checkpoint.why_kept(b) is not None
    (b / "checkpoint/inventory.img").unlink()  # Podman dropped it: a start afresh
    assert run_main(monkeypatch, json.dumps(state(b))) == 0
    assert kept_checkpoint.why_kept(b) is None
    assert events("kept-checkpoint-dropped")[0]["why"] == "the container was started afresh"


def test_gpu_devices_keeps_only_numbered_gpu_nodes():
    spec = {"linux": {"devices": [dev("/dev/nvidia0", 0), dev("/dev/nvidia12", 12),
                                  dev("/dev/nvidiactl", 255), dev("/dev/nvidia-uvm", 0),
                                  dev("/dev/nvidia0x", 0), {"type": "c"}]}}
    assert [d["path"] for d in hook.gpu_devices(spec)] == ["/dev/nvidia0", "/dev/nvidia12"]
    assert hook.gpu_devices({}) == [] and hook.gpu_devices({"linux": {"devices": None}}) == []


# --- poststop -----------------------------------------------------------------------------

def test_poststop_forgets_the_container(tmp_path, state_dir, host, monkeypatch):
    b = bundle(tmp_path, [dev("/dev/nvidia0", 0)])
    assert run_main(monkeypatch, json.dumps(state(b))) == 0
    assert record_file(state_dir).exists()
    assert run_main(monkeypatch, json.dumps(state(b, "stopped"))) == 0
    assert not record_file(state_dir).exists()


def test_the_stage_argument_wins_over_the_status(tmp_path, state_dir, host, monkeypatch, capsys):
    # runc reports a container it is restoring as "stopped": with the stage
    # given, that prestart still validates the checkpoint's GPUs.
    b = bundle(tmp_path, [dev("/dev/nvidia0", 0)], manifest_for("GPU-not-here"))
    assert run_main(monkeypatch, json.dumps(state(b, "stopped")), "prestart") == 1
    assert "cannot restore here" in capsys.readouterr().err
    assert run_main(monkeypatch, json.dumps(state(b, "stopped")), "poststop") == 0


def test_poststop_of_an_unknown_container_is_fine(tmp_path, state_dir, monkeypatch):
    # poststop needs no bundle and no GPU: the bundle may already be gone
    assert run_main(monkeypatch, json.dumps(state(tmp_path / "gone", "stopped"))) == 0
    assert events("hook-error") == []


# --- prestart at restore ------------------------------------------------------------------

def test_restore_onto_the_checkpoints_gpus_is_allowed(tmp_path, state_dir, host, monkeypatch,
                                                      capsys):
    b = bundle(tmp_path, [dev("/dev/nvidia0", 0)], manifest_for(UUID0))
    assert run_main(monkeypatch, json.dumps(state(b))) == 0
    assert capsys.readouterr().err == ""
    assert json.loads(record_file(state_dir).read_text())["gpus"][0]["uuid"] == UUID0


def test_restore_onto_an_incompatible_host_is_refused_in_one_line(tmp_path, state_dir, host,
                                                                  monkeypatch, capsys):
    missing = "GPU-deadbeef-0000-0000-0000-000000000000"
    # three GPUs in the checkpoint, two here: no plan can place them all
    b = bundle(tmp_path, [dev("/dev/nvidia0", 0)], manifest_for(UUID0, UUID1, missing))
    assert run_main(monkeypatch, json.dumps(state(b, "stopped")), "prestart") == 1
    err = capsys.readouterr().err
    assert err.startswith("gpusnap: cannot restore here: ") and err.count("\n") == 1, err
    assert f"GPU 2 of the checkpoint (NVIDIA H100 80GB HBM3, {missing})" in err, err
    refused = events("hook-refused-restore")
    assert len(refused) == 1 and refused[0]["container"] == CTR
    assert not record_file(state_dir).exists()


def test_restore_refusal_joins_several_problems(tmp_path, state_dir, monkeypatch, capsys):
    old = inventory(gpu(0, UUID0), driver="550.54.15")
    monkeypatch.setattr(inventory_module, "read_inventory", lambda *a: old)
    b = bundle(tmp_path, [], manifest_for(UUID0, UUID1))
    assert run_main(monkeypatch, json.dumps(state(b, "stopped")), "prestart") == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "NVIDIA driver 550.54.15 cannot restore" in err and f"{UUID1}) is not on this host" in err
    assert len(events("hook-refused-restore")[0]["problems"]) == 2


def test_restore_on_a_host_without_nvidia_driver_is_refused(tmp_path, state_dir, monkeypatch, capsys):
    monkeypatch.setattr(inventory_module, "read_inventory",
                        lambda *a: Inventory(error="no NVIDIA driver: Driver Not Loaded"))
    b = bundle(tmp_path, [dev("/dev/nvidia0", 0)], manifest_for(UUID0))
    assert run_main(monkeypatch, json.dumps(state(b, "stopped")), "prestart") == 1
    assert "this host has none usable (no NVIDIA driver: Driver Not Loaded)" in capsys.readouterr().err


def test_restore_of_a_cpu_only_checkpoint_is_not_judged(tmp_path, state_dir, monkeypatch):
    monkeypatch.setattr(inventory_module, "read_inventory",
                        lambda *a: Inventory(error="no NVIDIA driver"))
    b = bundle(tmp_path, [], manifest_for())
    assert run_main(monkeypatch, json.dumps(state(b))) == 0


# --- never blocks on the unexpected -------------------------------------------------------

@pytest.mark.parametrize("stdin", ["", "{not json", "[1, 2]"], ids=["empty", "garbage", "array"])
def test_unreadable_state_lets_the_container_start(state_dir, monkeypatch, stdin):
    assert run_main(monkeypatch, stdin) == 0
    assert len(events("hook-error")) == 1


def test_missing_bundle_config_lets_the_container_start(tmp_path, state_dir, monkeypatch):
    assert run_main(monkeypatch, json.dumps(state(tmp_path / "no-bundle"))) == 0
    [event] = events("hook-error")
    assert event["error"].startswith("FileNotFoundError: ")
    assert str(tmp_path / "no-bundle" / "config.json") in event["error"]


def test_failing_gpu_inventory_lets_the_container_start(tmp_path, state_dir, monkeypatch):
    def broken(*a):
        raise RuntimeError("NVML exploded")

    monkeypatch.setattr(inventory_module, "read_inventory", broken)
    b = bundle(tmp_path, [dev("/dev/nvidia0", 0)])
    assert run_main(monkeypatch, json.dumps(state(b))) == 0
    assert "NVML exploded" in events("hook-error")[0]["error"]


def test_a_malformed_manifest_refuses_the_restore_in_words(tmp_path, state_dir, host, monkeypatch,
                                                           capsys):
    # A GPU checkpoint whose GPUs cannot be checked is refused before CRIU
    # restores anything; let by, its post-resume would fail on the same manifest
    # with the processes left off the GPU.
    b = bundle(tmp_path, [dev("/dev/nvidia0", 0)], {"schema": SCHEMA, "gpus": "all"})
    assert run_main(monkeypatch, json.dumps(state(b, "stopped")), "prestart") == 1
    assert "cannot restore here: GPU manifest: missing field(s)" in capsys.readouterr().err
    assert "GPU manifest" in events("hook-refused-restore")[0]["problems"][0]


def test_a_create_never_judges_a_checkpoint_podman_kept_in_the_folder(tmp_path, state_dir, host,
                                                                     monkeypatch):
    # `podman start` of a container whose checkpoint folder stayed (--keep,
    # --leave-running): runc runs the hook as "creating"; only a restore
    # ("stopped", at CRIU's setup-namespaces) is judged.
    b = bundle(tmp_path, [dev("/dev/nvidia0", 0)], {"schema": SCHEMA, "gpus": "all"})
    for create in ("creating", "created"):  # runc's word, crun's
        assert run_main(monkeypatch, json.dumps(state(b, create)), "prestart") == 0
    assert events("hook-refused-restore") == []


def test_a_manifest_that_is_not_json_refuses_the_restore_in_words(tmp_path, state_dir, host,
                                                                  monkeypatch, capsys):
    b = bundle(tmp_path, [dev("/dev/nvidia0", 0)], {})
    (b / "checkpoint" / MANIFEST_NAME).write_text('{"gpus": [')  # cut short
    assert run_main(monkeypatch, json.dumps(state(b, "stopped")), "prestart") == 1
    assert "cannot restore here: the checkpoint's GPU manifest is not valid JSON" in \
        capsys.readouterr().err


def test_unwritable_state_dir_does_not_block(tmp_path, monkeypatch, host):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("GPUSNAP_STATE_DIR", str(blocker / "state"))
    b = bundle(tmp_path, [dev("/dev/nvidia0", 0)])
    assert run_main(monkeypatch, json.dumps(state(b))) == 0


# --- as runc runs it ----------------------------------------------------------------------

def run_hook_process(stdin: str, state_dir: Path, *stage: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, GPUSNAP_STATE_DIR=str(state_dir), PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "gpusnap.hook.main", *stage], input=stdin,
                          text=True, capture_output=True, env=env, cwd=REPO, timeout=60)


def test_hook_process_exits_0_on_garbage(tmp_path):
    res = run_hook_process("this is no OCI state", tmp_path / "state")
    assert (res.returncode, res.stdout, res.stderr) == (0, "", "")
    lines = (tmp_path / "state" / "journal.jsonl").read_text().splitlines()
    assert json.loads(lines[-1])["event"] == "hook-error"


def test_hook_process_exits_1_when_it_refuses_a_restore(tmp_path):
    # No host has this GPU (and this one may have no NVIDIA driver at all): refused either way.
    absent = "GPU-00000000-0000-0000-0000-000000000000"
    b = bundle(tmp_path, [], manifest_for(absent))
    res = run_hook_process(json.dumps(state(b, "stopped")), tmp_path / "state", "prestart")
    assert res.returncode == 1
    assert res.stderr.startswith("gpusnap: cannot restore here: ")
    assert "Traceback" not in res.stderr


# --- restore with a GPU plan (gpusnap restore onto other GPUs) ------------------------------

def _plan_to(target: GpuInfo, source: GpuInfo) -> dict:
    from gpusnap.gpu.plan import plan_restore
    from tests.unit.test_plan import manifest as plan_manifest

    plan = plan_restore(plan_manifest(source), inventory(source, target),
                        gpu_map=parse_gpu_map(f"{source.index}={target.index}"))
    assert not isinstance(plan, list), plan
    return plan.to_dict()


def test_restore_with_a_plan_checks_the_plans_targets(tmp_path, state_dir, monkeypatch):
    g0, g1 = gpu(0, UUID0, minor=0), gpu(1, UUID1, minor=1)
    plan = _plan_to(g1, g0)
    # GPU 0 is full now: without the plan the restore would be refused, with it GPU 1 takes it.
    inv = inventory(gpu(0, UUID0, minor=0, memory_used=80 << 30), g1)
    monkeypatch.setattr(inventory_module, "read_inventory", lambda *a: inv)
    man = manifest_for(UUID0)
    man["gpus"][0].update(minor=0, memory_total=80 << 30, compute_capability="9.0",
                          pci_bus_id=g0.pci_bus_id)
    man["processes"] = [{"pid": 7, "comm": "train", "gpus": [UUID0], "gpu_memory": {UUID0: 8 << 30}}]
    b = bundle(tmp_path, [dev("/dev/nvidia1", 1)], man)
    (b / "checkpoint" / PLAN_NAME).write_text(json.dumps(plan))
    assert run_main(monkeypatch, json.dumps(state(b, "stopped")), "prestart") == 0
    assert not (state_dir / "restores" / "4242.json").exists()  # gpusnap restore moved it already
    # A plain `podman container restore` of the same: the hook plans GPU 1 itself and
    # leaves the move for the CRIU action script, keyed by the restored init pid.
    (b / "checkpoint" / PLAN_NAME).unlink()
    assert run_main(monkeypatch, json.dumps(state(b, "stopped")), "prestart") == 0
    stash = json.loads((state_dir / "restores" / "4242.json").read_text())
    assert stash["plan"]["moves"][0]["target"]["uuid"] == UUID1
    assert stash["spec"]["linux"]["devices"][0]["path"] == "/dev/nvidia1"


def test_a_plan_that_moves_nothing_is_held_to_not_made_again(tmp_path, state_dir, monkeypatch,
                                                             capsys):
    # `gpusnap restore` planned GPU 0 to stay; GPU 0 filled up during its download.
    # The hook re-checks that plan and refuses (the checkpoint is untouched, and
    # the next `gpusnap restore` plans again): it does not move the container to
    # GPU 1 behind the back of a restore that reported GPU 0.
    from gpusnap.gpu.plan import plan_restore
    from tests.unit.test_plan import manifest as plan_manifest

    g0, g1 = gpu(0, UUID0, minor=0), gpu(1, UUID1, minor=1)
    stay = plan_restore(plan_manifest(g0), inventory(g0, g1))
    assert not isinstance(stay, list) and not stay.needs_remap and stay.moves
    monkeypatch.setattr(inventory_module, "read_inventory",
                        lambda *a: inventory(gpu(0, UUID0, minor=0, memory_used=80 << 30), g1))
    man = manifest_for(UUID0)
    man["gpus"][0].update(minor=0, memory_total=80 << 30, compute_capability="9.0",
                          pci_bus_id=g0.pci_bus_id)
    man["processes"] = [{"pid": 7, "comm": "train", "gpus": [UUID0], "gpu_memory": {UUID0: 8 << 30}}]
    b = bundle(tmp_path, [dev("/dev/nvidia0", 0)], man)
    (b / "checkpoint" / PLAN_NAME).write_text(json.dumps(stay.to_dict()))
    assert run_main(monkeypatch, json.dumps(state(b, "stopped")), "prestart") == 1
    said = capsys.readouterr().err
    assert "GPU 0 of the checkpoint stays on its GPU, but GPU 0 here has" in said, said
    assert "--gpu-map" not in said.split("(override")[0]  # the user gave none
    assert not (state_dir / "restores" / "4242.json").exists()  # no move stashed


def test_a_live_move_the_containers_devices_cannot_take_is_refused_by_the_hook(
        tmp_path, state_dir, monkeypatch, capsys):
    # A container given both GPUs (--gpus all) whose GPU 0 is full: the hook plans
    # 0->1, but its spec has /dev/nvidia1 already. Found at post-resume, the move
    # failed there with the processes off the GPU and nobody told.
    g1 = gpu(1, UUID1, minor=1)
    monkeypatch.setattr(inventory_module, "read_inventory",
                        lambda *a: inventory(gpu(0, UUID0, minor=0, memory_used=80 << 30), g1))
    man = manifest_for(UUID0)
    man["gpus"][0].update(minor=0, memory_total=80 << 30, compute_capability="9.0",
                          pci_bus_id=gpu(0, UUID0, minor=0).pci_bus_id)
    man["processes"] = [{"pid": 7, "comm": "train", "gpus": [UUID0], "gpu_memory": {UUID0: 8 << 30}}]
    b = bundle(tmp_path, [dev("/dev/nvidia0", 0), dev("/dev/nvidia1", 1)], man)
    assert run_main(monkeypatch, json.dumps(state(b, "stopped")), "prestart") == 1
    said = capsys.readouterr().err
    assert "cannot restore here: its GPUs would move (GPU 0" in said, said
    assert "but the container's devices cannot:" in said
    assert not (state_dir / "restores" / "4242.json").exists()


def test_an_unreadable_gpu_map_annotation_refuses_the_restore(tmp_path, state_dir, monkeypatch,
                                                              capsys):
    g0, g1 = gpu(0, UUID0, minor=0), gpu(1, UUID1, minor=1)
    monkeypatch.setattr(inventory_module, "read_inventory", lambda *a: inventory(g0, g1))
    b = bundle(tmp_path, [dev("/dev/nvidia0", 0)], manifest_for(UUID0))
    spec = json.loads((b / "config.json").read_text())
    spec["annotations"] = {GPU_MAP_ANNOTATION: "garbage"}
    (b / "config.json").write_text(json.dumps(spec))
    # let by, the restore would go ahead with none of its GPU checks made
    assert run_main(monkeypatch, json.dumps(state(b, "stopped")), "prestart") == 1
    assert "cannot restore here:" in capsys.readouterr().err


def test_the_gpu_map_annotation_pins_a_plain_restore(tmp_path, state_dir, monkeypatch, capsys):
    g0, g1 = gpu(0, UUID0, minor=0), gpu(1, UUID1, minor=1)
    monkeypatch.setattr(inventory_module, "read_inventory", lambda *a: inventory(g0, g1))
    man = manifest_for(UUID0)
    man["gpus"][0].update(minor=0, memory_total=80 << 30, compute_capability="9.0",
                          pci_bus_id=g0.pci_bus_id)
    b = bundle(tmp_path, [dev("/dev/nvidia0", 0)], man)
    spec = json.loads((b / "config.json").read_text())
    spec["annotations"] = {GPU_MAP_ANNOTATION: "0=1"}
    (b / "config.json").write_text(json.dumps(spec))
    assert run_main(monkeypatch, json.dumps(state(b, "stopped")), "prestart") == 0
    stash = json.loads((state_dir / "restores" / "4242.json").read_text())
    assert "chosen by --gpu-map 0=1" in stash["plan"]["moves"][0]["reasons"]
    spec["annotations"] = {GPU_MAP_ANNOTATION: "0=5"}
    (b / "config.json").write_text(json.dumps(spec))
    assert run_main(monkeypatch, json.dumps(state(b, "stopped")), "prestart") == 1
    assert "no GPU 5" in capsys.readouterr().err


def test_restore_with_a_plan_whose_target_is_gone_is_refused(tmp_path, state_dir, monkeypatch,
                                                             capsys):
    g0, g1 = gpu(0, UUID0, minor=0), gpu(1, UUID1, minor=1)
    plan = _plan_to(g1, g0)
    monkeypatch.setattr(inventory_module, "read_inventory", lambda *a: inventory(g0))
    b = bundle(tmp_path, [dev("/dev/nvidia1", 1)], manifest_for(UUID0))
    (b / "checkpoint" / PLAN_NAME).write_text(json.dumps(plan))
    assert run_main(monkeypatch, json.dumps(state(b, "stopped")), "prestart") == 1
    assert UUID1 in capsys.readouterr().err


def test_the_hooks_nvml_read_ends_before_runc_kills_the_hook(tmp_path, state_dir, monkeypatch):
    # runc kills a prestart hook at hooks.d's timeout, in runc's words; the
    # shell front may spend 10 s on a starting agent and 7 on its answer first.
    import re

    root = Path(__file__).parents[2]
    timeout = json.loads((root / "packaging/hooks.d/gpusnap-prestart.json").read_text())[
        "hook"]["timeout"]
    front = (root / "packaging/bin/gpusnap-hook").read_text()
    answer = int(re.search(r'agent_ask "\$here" prestart 0 "\$file" "" (\d+)', front).group(1))
    bounds = []
    monkeypatch.setattr(inventory_module, "read_inventory",
                        lambda bound=None: bounds.append(bound) or inventory(gpu(0, UUID0)))
    b = bundle(tmp_path, [dev("/dev/nvidia0", 0)])
    assert run_main(monkeypatch, json.dumps(state(b, "creating")), "prestart") == 0
    assert bounds and bounds[0] is not None
    # the agent's start (10 s), its answer, NVML, and a margin for Python's start
    assert 10 + answer + bounds[0].seconds + 4 < timeout, (answer, bounds[0], timeout)
