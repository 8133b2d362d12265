"""gpusnap.gpu.manifest: built from /proc and NVML facts, written, read back, malformed ones refused."""

from __future__ import annotations

import copy
import json
import stat
from pathlib import Path

import pytest

from gpusnap import MANIFEST_NAME
from gpusnap.errors import GpusnapError
from gpusnap.gpu import manifest as gm
from gpusnap.gpu.manifest import SCHEMA, Manifest, ManifestError, ManifestProcess
from gpusnap.procs import ProcessGpuUse
from tests.unit.fakes import UUID0, UUID1, UUID2, gpu, inventory


def two_gpu_inventory():
    return inventory(gpu(0, UUID0, minor=0, memory_used=5), gpu(1, UUID1, minor=1),
                     gpu(2, UUID2, minor=2),
                     process_memory={100: {UUID1: 2 << 30}, 200: {UUID0: 1 << 30, UUID1: 512}})


def built() -> Manifest:
    procs = [ProcessGpuUse(pid=100, comm="trainer", gpu_minors=[1], opens_nvidia=True),
             ProcessGpuUse(pid=200, comm="helper", gpu_minors=[], maps_libcuda=True)]
    return gm.build(procs, two_gpu_inventory(), "4.1.1", "gpusnap")


# --- build --------------------------------------------------------------------------------

def test_build_lists_only_the_gpus_the_processes_use_in_index_order():
    m = built()
    assert [g["uuid"] for g in m.gpus] == [UUID0, UUID1]  # GPU 2 is unused


def test_build_leaves_out_memory_used_but_keeps_the_gpu_facts():
    g = built().gpus[0]
    assert "memory_used" not in g
    assert g == {"index": 0, "uuid": UUID0, "name": "NVIDIA H100 80GB HBM3", "minor": 0,
                 "pci_bus_id": "00000000:18:00.0", "memory_total": 80 << 30,
                 "compute_capability": "9.0", "mig_enabled": False}


def test_build_maps_device_minors_and_nvml_memory_to_uuids():
    p100, p200 = built().processes
    assert (p100.pid, p100.comm, p100.gpus, p100.gpu_memory) == (100, "trainer", [UUID1],
                                                                 {UUID1: 2 << 30})
    # no /dev/nvidiaN fd (checkpointed already, or NVML-only): NVML's view names its GPUs
    assert p200.gpus == [UUID0, UUID1]


def test_build_ignores_a_minor_this_host_has_no_gpu_for():
    procs = [ProcessGpuUse(pid=7, comm="x", gpu_minors=[9])]
    m = gm.build(procs, two_gpu_inventory(), None, "gpusnap")
    assert m.gpus == [] and m.processes[0].gpus == []


def test_build_records_versions_host_and_time():
    m = built()
    assert (m.driver_version, m.cuda_driver_version, m.criu_version, m.quiesced_by) == (
        "580.159.04", "13.0", "4.1.1", "gpusnap")
    assert set(m.host) == {"hostname", "kernel", "arch"}
    assert m.created.endswith("Z") and len(m.created) == len("2024-01-01T00:00:00Z")
    assert m.schema == SCHEMA


def test_gpu_memory_total_adds_every_process_on_every_gpu():
    assert built().gpu_memory_total == (2 << 30) + (1 << 30) + 512


# --- serialise and parse ------------------------------------------------------------------

def test_json_round_trip_gives_the_same_manifest():
    m = built()
    m.timing = {"lock": 0.02, "checkpoint": 3.5}
    again = Manifest.from_dict(json.loads(m.to_json()))
    assert again == m
    assert isinstance(again.processes[0], ManifestProcess)


def test_write_then_read_round_trip(tmp_path: Path):
    m = built()
    path = gm.write(m, tmp_path)
    assert path == tmp_path / MANIFEST_NAME
    assert gm.read(tmp_path) == m


def test_write_leaves_no_temporary_file_and_is_private(tmp_path: Path):
    gm.write(built(), tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == [MANIFEST_NAME]
    assert stat.S_IMODE((tmp_path / MANIFEST_NAME).stat().st_mode) == 0o600


def test_read_without_a_manifest_is_none(tmp_path: Path):
    assert gm.read(tmp_path) is None


def test_read_of_a_manifest_that_is_not_json_names_the_file(tmp_path: Path):
    (tmp_path / MANIFEST_NAME).write_text('{"schema": "gpusnap.manifest/v1",')
    with pytest.raises(ManifestError) as info:
        gm.read(tmp_path)
    assert info.value.message.startswith(f"{tmp_path / MANIFEST_NAME} is not valid JSON")


@pytest.mark.parametrize("text", ["[]", '"manifest"', "3", "null"])
def test_a_manifest_that_is_json_but_not_an_object_is_refused_in_words(text):
    with pytest.raises(ManifestError, match="the top level"):
        gm.parse(text, "the checkpoint's GPU manifest")


# --- malformed manifests ------------------------------------------------------------------

def good() -> dict:
    return json.loads(built().to_json())


def broken(change) -> dict:
    data = copy.deepcopy(good())
    change(data)
    return data


@pytest.mark.parametrize("data, message", [
    ([1, 2], "GPU manifest: the top level is an array, expected an object"),
    (broken(lambda d: d.pop("schema")), "unknown GPU manifest schema None"),
    (broken(lambda d: d.update(schema="gpusnap.manifest/v9")),
     "unknown GPU manifest schema 'gpusnap.manifest/v9'"),
    (broken(lambda d: d.update(colour="blue", age=3)), "GPU manifest: unknown field(s) age, colour"),
    (broken(lambda d: (d.pop("gpus"), d.pop("quiesced_by"))),
     "GPU manifest: missing field(s) gpus, quiesced_by"),
    (broken(lambda d: d.update(gpus={"0": "x"})), "GPU manifest: gpus is an object, expected an array"),
    (broken(lambda d: d["gpus"][0].pop("uuid")), "GPU manifest: gpus[0] lacks uuid"),
    (broken(lambda d: d["gpus"][1].update(index="1")),
     "GPU manifest: gpus[1].index is a string, expected an integer"),
    (broken(lambda d: d["processes"].append("pid 3")),
     "GPU manifest: processes[2] is a string, expected an object"),
    (broken(lambda d: d["processes"][0].pop("comm")), "GPU manifest: processes[0] lacks comm"),
    (broken(lambda d: d["processes"][1].update(pid=True)),
     "GPU manifest: processes[1].pid is a boolean, expected an integer"),
    (broken(lambda d: d["processes"][0].update(gpu_memory=[1])),
     "GPU manifest: processes[0].gpu_memory is an array, expected an object"),
    (broken(lambda d: d["processes"][0].update(cgroup="/x")),
     "GPU manifest: processes[0] has unknown field(s) cgroup"),
    (broken(lambda d: d.update(driver_version=580)),
     "GPU manifest: driver_version is an integer, expected a string or null"),
    (broken(lambda d: d.update(quiesced_by=None)),
     "GPU manifest: quiesced_by is null, expected a string"),
    (broken(lambda d: d.update(timing=[])), "GPU manifest: timing is an array, expected an object"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_malformed_manifest_is_refused_with_a_precise_message(data, message):
    with pytest.raises(ManifestError) as info:
        Manifest.from_dict(data)
    assert info.value.message == message


def test_manifest_error_is_a_gpusnap_error_and_a_value_error():
    with pytest.raises(GpusnapError) as info:
        Manifest.from_dict({"schema": "other"})
    assert isinstance(info.value, ValueError)  # callers that caught ValueError still do
    assert info.value.hint


def test_null_versions_are_allowed():
    data = broken(lambda d: d.update(driver_version=None, cuda_driver_version=None, criu_version=None))
    m = Manifest.from_dict(data)
    assert (m.driver_version, m.cuda_driver_version, m.criu_version) == (None, None, None)


def test_optional_fields_may_be_left_out():
    data = broken(lambda d: [d.pop(k) for k in ("timing", "host", "created")])
    m = Manifest.from_dict(data)
    assert (m.timing, m.host, m.created) == ({}, {}, "")
