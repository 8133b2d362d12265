"""gpusnap.gpu.gpumap: `--gpu-map SRC=DST,...` parsed strictly, then resolved against both hosts."""

from __future__ import annotations

import pytest

from gpusnap.errors import GpusnapError
from gpusnap.gpu.gpumap import GpuMapError, GpuRef, MapEntry, parse_gpu_map, resolve_gpu_map
from tests.unit.fakes import UUID0, UUID1, UUID2, gpu

OTHER = "GPU-0a0b0c0d-1111-2222-3333-444455556666"


def test_indices_and_uuids_on_either_side():
    m = parse_gpu_map(f" 0=1 , {UUID1.upper()}=0,2={UUID2}")
    assert m.entries == (MapEntry(GpuRef(index=0), GpuRef(index=1)),
                         MapEntry(GpuRef(uuid=UUID1), GpuRef(index=0)),
                         MapEntry(GpuRef(index=2), GpuRef(uuid=UUID2)))
    assert str(m) == f"0=1,{UUID1}=0,2={UUID2}"


def test_a_uuid_matches_whatever_case_nvml_printed():
    ref = parse_gpu_map(f"{UUID0.upper().replace('GPU-', 'gpu-')}=1").entries[0].source
    assert ref.matches(7, UUID0) and not ref.matches(0, UUID1)


@pytest.mark.parametrize("text, message", [
    ("", "--gpu-map is empty"),
    ("   ", "--gpu-map is empty"),
    ("0=1,,1=0", "--gpu-map: entry 2 of '0=1,,1=0' is empty"),
    ("0=1,", "--gpu-map: entry 2 of '0=1,' is empty"),
    ("0:1", "--gpu-map: '0:1' is not SOURCE=TARGET"),
    ("0=1=2", "--gpu-map: '0=1=2' is not SOURCE=TARGET"),
    ("=1", "--gpu-map: '=1' is not SOURCE=TARGET"),
    ("0=", "--gpu-map: '0=' is not SOURCE=TARGET"),
    ("gpu0=1", "--gpu-map: source 'gpu0' in 'gpu0=1' is neither a GPU index"),
    ("0=-1", "--gpu-map: target '-1' in '0=-1' is neither a GPU index"),
    ("0=GPU-1234", "--gpu-map: target 'GPU-1234' in '0=GPU-1234' is neither"),
    ("MIG-11111111-2222-3333-4444-555555555555=0", "is a MIG instance"),
    ("0=1,0=2", "--gpu-map: source GPU 0 is mapped twice (0=1 and 0=2)"),
    ("0=1,2=1", "--gpu-map: target GPU 1 is given twice (0=1 and 2=1)"),
])
def test_malformed_maps_say_exactly_what_is_wrong(text, message):
    with pytest.raises(GpuMapError) as err:
        parse_gpu_map(text)
    assert message in err.value.message
    assert isinstance(err.value, GpusnapError) and isinstance(err.value, ValueError)
    assert "\n" not in str(err.value)


def test_a_gpu_ref_is_an_index_or_a_uuid():
    with pytest.raises(ValueError):
        GpuRef(index=0, uuid=UUID0)
    with pytest.raises(ValueError):
        GpuRef()


SOURCES = [gpu(0, UUID0), gpu(1, UUID1)]
TARGETS = [gpu(0, UUID2), gpu(1, OTHER)]


def test_resolution_pins_source_uuids_to_target_uuids():
    pins, errors = resolve_gpu_map(parse_gpu_map(f"0=1,{UUID1}={UUID2}"), SOURCES, TARGETS)
    assert errors == []
    assert pins == {UUID0: OTHER, UUID1: UUID2}


def test_a_map_naming_gpus_that_do_not_exist_is_one_line_each():
    pins, errors = resolve_gpu_map(parse_gpu_map(f"3=0,0=5,{UUID2}=1"), SOURCES, TARGETS)
    assert pins == {}
    assert errors == [
        "--gpu-map 3=0: the checkpoint has no GPU 3 (it used GPU 0, GPU 1)",
        "--gpu-map 0=5: this host has no GPU 5 (it has GPU 0, GPU 1)",
        f"--gpu-map {UUID2}=1: the checkpoint has no GPU {UUID2} (it used GPU 0, GPU 1)",
    ]


def test_one_gpu_named_by_index_and_by_uuid_is_caught_at_resolution():
    pins, errors = resolve_gpu_map(parse_gpu_map(f"0=0,{UUID0}=1"), SOURCES, TARGETS)
    assert pins == {UUID0: UUID2}
    assert errors == [f"--gpu-map: source GPU 0 ({UUID0}) is mapped twice (0=0 and {UUID0}=1)"]
    pins, errors = resolve_gpu_map(parse_gpu_map(f"0=0,1={UUID2}"), SOURCES, TARGETS)
    assert errors == [f"--gpu-map: target GPU 0 ({UUID2}) is given twice (0=0 and 1={UUID2})"]
