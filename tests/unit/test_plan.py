"""gpusnap.gpu.plan: which GPUs here take a checkpoint's GPUs, why, and every refusal."""

from __future__ import annotations

import json
import time
from dataclasses import asdict

import pytest

from gpusnap.gpu.checks import HostFacts, Problem
from gpusnap.gpu.drm import DrmNodes
from gpusnap.gpu.gpumap import parse_gpu_map
from gpusnap.gpu.inventory import GpuInfo, Inventory
from gpusnap.gpu.manifest import Manifest, ManifestProcess
from gpusnap.gpu.nodes import NodeChange, PathChange
from gpusnap.gpu.plan import Plan, complete_pairs, plan_restore
from gpusnap.gpu.topology import Topology
from tests.unit.fakes import UUID0, UUID1, UUID2, gpu, inventory

H100 = "NVIDIA H100 80GB HBM3"
A100 = "NVIDIA A100-SXM4-80GB"
GIB = 1 << 30
# GPUs of another host: not on this one
SRC0 = "GPU-a0000000-0000-0000-0000-000000000000"
SRC1 = "GPU-a1111111-0000-0000-0000-000000000000"


def uuid(i: int) -> str:
    return f"GPU-{i:08x}-0000-0000-0000-00000000beef"


def manifest(*gpus: GpuInfo, used: dict[str, int] | None = None, driver: str = "580.159.04",
             host: dict | None = None, processes: bool = True) -> Manifest:
    """What gpusnap.gpu.manifest.build records for processes on ``gpus``."""
    entries = [{k: v for k, v in asdict(g).items() if k != "memory_used"} for g in gpus]
    procs = [ManifestProcess(pid=100, comm="train", gpus=[g.uuid for g in gpus],
                             gpu_memory=dict(used or {}))] if processes else []
    return Manifest(gpus=entries, processes=procs, driver_version=driver,
                    cuda_driver_version="13.0", criu_version="4.1.1", quiesced_by="gpusnap",
                    host=host or {"arch": "x86_64", "kernel": "6.8.0-49-generic"})


def plan_of(*args, **kw) -> Plan:
    result = plan_restore(*args, **kw)
    assert isinstance(result, Plan), [p.line for p in result]
    return result


def problems_of(*args, **kw) -> list[Problem]:
    result = plan_restore(*args, **kw)
    assert isinstance(result, list), result.describe()
    return result


def target_of(plan: Plan, source_uuid: str) -> int:
    return next(m.target.index for m in plan.moves if m.source.uuid == source_uuid)


# --- choosing -------------------------------------------------------------------------------

def test_the_checkpoints_own_gpus_are_chosen_and_need_no_remap():
    m = manifest(gpu(0, UUID0), gpu(1, UUID1), used={UUID0: 9 * GIB, UUID1: 9 * GIB})
    plan = plan_of(m, inventory(gpu(1, UUID1), gpu(0, UUID0), gpu(2, UUID2)))
    assert [(mv.source.uuid, mv.target.uuid) for mv in plan.moves] == [(UUID0, UUID0), (UUID1, UUID1)]
    assert not plan.needs_remap and plan.driver_pairs() is None
    assert plan.remap.empty and plan.overridden == ()
    assert "the checkpoint's own GPU" in plan.moves[0].reasons


def test_a_busy_own_gpu_moves_to_the_least_loaded_free_one():
    m = manifest(gpu(0, UUID0), used={UUID0: 20 * GIB})
    here = inventory(gpu(0, UUID0, memory_used=70 * GIB), gpu(1, UUID1, memory_used=8 * GIB),
                     gpu(2, UUID2, memory_used=2 * GIB))
    plan = plan_of(m, here)
    [move] = plan.moves
    assert move.target.uuid == UUID2
    assert "least loaded of 2 candidates (2.0 GiB in use)" in move.reasons
    assert "78.0 GiB free for the 20.0 GiB its processes used" in move.reasons
    # the driver sees three GPUs: all of them in the pairs, the displaced one closing the cycle
    assert sorted(plan.driver_pairs()) == sorted([(UUID0, UUID2), (UUID2, UUID0), (UUID1, UUID1)])
    assert plan.remap.nodes == (NodeChange("/dev/nvidia0", "/dev/nvidia2", (195, 0), (195, 2)),)
    assert plan.remap.paths == (PathChange("/proc/driver/nvidia/gpus/0000:18:00.0",
                                           "/proc/driver/nvidia/gpus/0000:1a:00.0"),)
    assert plan.remap.ids == (("0", "2"), (UUID0, UUID2))


def test_the_same_index_wins_over_a_lighter_load():
    m = manifest(gpu(1, SRC1), used={SRC1: GIB})
    here = inventory(gpu(0, UUID0, memory_used=0), gpu(1, UUID1, memory_used=5 * GIB))
    plan = plan_of(m, here)
    assert target_of(plan, SRC1) == 1
    assert "same index 1" in plan.moves[0].reasons


def test_without_room_on_the_same_index_the_least_loaded_is_next():
    m = manifest(gpu(1, SRC1), used={SRC1: 10 * GIB})
    here = inventory(gpu(0, UUID0, memory_used=30 * GIB), gpu(1, UUID1, memory_used=75 * GIB),
                     gpu(2, UUID2, memory_used=20 * GIB))
    assert target_of(plan_of(m, here), SRC1) == 2


def test_nvlink_neighbours_are_kept_together_before_matching_indices():
    m = manifest(gpu(0, SRC0), gpu(1, SRC1))
    here = inventory(*(gpu(i, uuid(i)) for i in range(4)))
    topo = Topology(links={frozenset((uuid(2), uuid(3))): 18})
    plan = plan_of(m, here, topology=topo)
    assert {target_of(plan, SRC0), target_of(plan, SRC1)} == {2, 3}
    assert any(r.startswith("NVLink x18 to GPU") for r in plan.moves[0].reasons)
    # without the topology the same indices win
    plan = plan_of(m, here)
    assert (target_of(plan, SRC0), target_of(plan, SRC1)) == (0, 1)


def test_numa_neighbours_are_preferred_when_there_is_no_nvlink():
    m = manifest(gpu(0, SRC0), gpu(1, SRC1))
    here = inventory(*(gpu(i, uuid(i)) for i in range(4)))
    topo = Topology(numa={uuid(0): 0, uuid(1): 1, uuid(2): 1, uuid(3): 0})
    plan = plan_of(m, here, topology=topo)
    assert sorted((target_of(plan, SRC0), target_of(plan, SRC1))) in ([0, 3], [1, 2])
    assert any(r.startswith("NUMA node") for r in plan.moves[0].reasons)


def test_a_gpu_map_pin_wins_over_every_preference():
    m = manifest(gpu(0, UUID0), gpu(1, UUID1))
    here = inventory(gpu(0, UUID0), gpu(1, UUID1), gpu(2, UUID2))
    plan = plan_of(m, here, gpu_map=parse_gpu_map("0=2"))
    assert (target_of(plan, UUID0), target_of(plan, UUID1)) == (2, 1)
    assert "chosen by --gpu-map 0=2" in plan.moves[0].reasons


def test_a_pinned_target_is_not_given_to_another_gpu():
    m = manifest(gpu(0, UUID0), gpu(1, UUID1))
    here = inventory(gpu(0, UUID0), gpu(1, UUID1), gpu(2, UUID2))
    plan = plan_of(m, here, gpu_map=parse_gpu_map(f"1={UUID0}"))
    # GPU 0 goes to the pinned GPU 1; GPU 1, freed, is the lowest-index fit for GPU 0
    assert (target_of(plan, UUID0), target_of(plan, UUID1)) == (1, 0)


def test_swap_by_map_gives_the_driver_a_permutation():
    m = manifest(gpu(0, UUID0), gpu(1, UUID1))
    plan = plan_of(m, inventory(gpu(0, UUID0), gpu(1, UUID1)), gpu_map=parse_gpu_map("0=1,1=0"))
    assert sorted(plan.driver_pairs()) == sorted([(UUID0, UUID1), (UUID1, UUID0)])
    assert {n.old: n.new for n in plan.remap.nodes} == {(195, 0): (195, 1), (195, 1): (195, 0)}


def test_a_big_host_is_planned_quickly():
    m = manifest(*(gpu(i, uuid(100 + i)) for i in range(8)))
    here = inventory(*(gpu(i, uuid(i), memory_used=i * GIB) for i in range(16)))
    start = time.monotonic()
    plan = plan_of(m, here)
    assert time.monotonic() - start < 5
    assert [mv.target.index for mv in plan.moves] == list(range(8))


def test_drm_nodes_known_on_both_sides_move_with_the_gpu():
    src = gpu(0, SRC0)
    m = manifest(src)
    m.gpus[0]["drm"] = {"card": 1, "render": 128}
    plan = plan_of(m, inventory(gpu(3, UUID0)), drm={"0000:1b:00.0": DrmNodes(4, 131)})
    assert NodeChange("/dev/dri/card1", "/dev/dri/card4", (226, 1), (226, 4)) in plan.remap.nodes
    assert NodeChange("/dev/dri/renderD128", "/dev/dri/renderD131", (226, 128), (226, 131)) \
        in plan.remap.nodes
    assert PathChange("/dev/dri/by-path/pci-0000:18:00.0-render",
                      "/dev/dri/by-path/pci-0000:1b:00.0-render") in plan.remap.paths
    assert plan.remap.unknown_drm == ()
    # the checkpoint did not record them: the spec step must refuse DRM nodes
    assert plan_of(manifest(src), inventory(gpu(3, UUID0))).remap.unknown_drm == (SRC0,)


def test_only_the_containers_gpus_are_candidates():
    m = manifest(gpu(0, SRC0))
    here = inventory(gpu(0, UUID0), gpu(1, UUID1))
    assert target_of(plan_of(m, here, only_minors={1}), SRC0) == 1
    [p] = problems_of(m, here, only_minors={7})
    assert p.check == "count" and "has no GPU among the container's GPUs to go to" in p.message


def test_the_plan_survives_a_round_trip_through_json():
    m = manifest(gpu(0, UUID0), used={UUID0: GIB})
    plan = plan_of(m, inventory(gpu(0, UUID0, memory_used=80 * GIB), gpu(1, UUID1)),
                   skip=frozenset(), container_paths="host")
    again = Plan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert again.driver_pairs() == plan.driver_pairs()
    assert again.remap == plan.remap and again.remap.container_paths == "host"
    assert [mv.target.uuid for mv in again.moves] == [UUID1]


# --- refusals -------------------------------------------------------------------------------

def test_wrong_chip_is_refused_with_its_override():
    m = manifest(gpu(0, SRC0))
    [p] = problems_of(m, inventory(gpu(0, UUID0, A100), gpu(1, UUID1, A100)))
    assert p.check == "chip"
    assert p.line == (f"GPU 0 of the checkpoint ({SRC0}) was a {H100}, compute capability 9.0 "
                      f"and no GPU here is the same chip: GPU 0 is a {A100}, compute capability "
                      f"9.0, GPU 1 is a {A100}, compute capability 9.0 "
                      "(override: GPUSNAP_SKIP_CHECKS=chip)")


def test_another_compute_capability_is_another_chip():
    m = manifest(gpu(0, SRC0))
    here = GpuInfo(0, UUID0, H100, 0, "00000000:18:00.0", 80 * GIB, 0, "9.1")
    [p] = problems_of(m, Inventory("580.159.04", "13.0", [here]))
    assert p.check == "chip" and "compute capability 9.1" in p.message


def test_skipping_the_chip_check_plans_and_says_so():
    plan = plan_of(manifest(gpu(0, SRC0)), inventory(gpu(0, UUID0, A100)), skip=frozenset({"chip"}))
    assert plan.moves[0].target.uuid == UUID0
    assert [p.check for p in plan.overridden] == ["chip"]
    assert f"other chip ({A100}, compute capability 9.0), check skipped" in plan.moves[0].reasons


def test_not_enough_free_memory_is_refused_with_the_figures():
    m = manifest(gpu(0, SRC0), used={SRC0: 30 * GIB})
    here = inventory(gpu(0, UUID0, memory_used=60 * GIB), gpu(1, UUID1, memory_used=55 * GIB),
                     gpu(2, UUID2, A100))
    [p] = problems_of(m, here)
    assert p.check == "memory"
    assert p.message == (f"GPU 0 of the checkpoint ({SRC0}) needs 30.0 GiB free on a {H100} and no "
                         "such GPU here has it: GPU 0 has 20.0 GiB, GPU 1 has 25.0 GiB")
    plan = plan_of(m, here, skip=frozenset({"memory"}))
    assert plan.moves[0].target.index == 0 and plan.overridden[0].check == "memory"


def test_fewer_gpus_than_needed_names_the_one_left_over():
    m = manifest(gpu(0, UUID0), gpu(1, UUID1))
    [p] = problems_of(m, inventory(gpu(0, UUID0)))
    assert p.check == "count" and p.line == p.message  # no override can add a GPU
    assert p.message == (f"GPU 1 of the checkpoint ({H100}, {UUID1}) is not on this host, and the 1 "
                         "GPU(s) here that could take it go to the checkpoint's other GPUs "
                         "(GPU 0->GPU 0)")


def test_three_sources_that_fit_only_two_targets():
    m = manifest(gpu(0, uuid(10)), gpu(1, uuid(11)), gpu(2, uuid(12)))
    problems = problems_of(m, inventory(gpu(0, UUID0), gpu(1, UUID1), gpu(2, UUID2, A100)))
    assert [p.check for p in problems] == ["count"]
    assert problems[0].message.startswith(f"GPU 2 of the checkpoint ({H100}, {uuid(12)}) is not on")


def test_a_driver_too_old_to_remap_is_refused_but_fine_for_the_same_gpus():
    m = manifest(gpu(0, UUID0), driver="570.86.10", used={UUID0: 10 * GIB})
    busy = inventory(gpu(0, UUID0, memory_used=80 * GIB), gpu(1, UUID1), driver="570.86.10")
    [p] = problems_of(m, busy)
    assert p.check == "remap-driver"
    assert p.line == ("restoring onto other GPUs (0->1) needs NVIDIA driver r580 or newer, this "
                      "host has 570.86.10 (override: GPUSNAP_SKIP_CHECKS=remap-driver)")
    assert plan_of(m, inventory(gpu(0, UUID0), gpu(1, UUID1), driver="570.86.10")).moves


def test_a_driver_older_than_the_checkpoint_api_is_one_line():
    problems = problems_of(manifest(gpu(0, UUID0)), inventory(gpu(0, UUID0), driver="550.54.15"))
    assert [p.line for p in problems] == [
        "NVIDIA driver 550.54.15 cannot restore CUDA checkpoints: r570 or newer is needed"]


def test_another_driver_version_than_the_processes_loaded_is_refused():
    [p] = problems_of(manifest(gpu(0, UUID0)), inventory(gpu(0, UUID0), driver="580.95.05"))
    assert p.check == "driver-version" and "driver 580.159.04's libcuda" in p.message
    # nothing mapped libcuda: nothing to mismatch
    assert plan_of(manifest(gpu(0, UUID0), processes=False),
                   inventory(gpu(0, UUID0), driver="580.95.05"))


def test_an_older_cuda_driver_api_is_refused():
    here = Inventory("580.159.04", "12.8", [gpu(0, UUID0)])
    [p] = problems_of(manifest(gpu(0, UUID0)), here)
    assert p.line == ("CUDA driver API here is 12.8, older than the checkpoint's 13.0 "
                      "(override: GPUSNAP_SKIP_CHECKS=cuda)")


def test_a_gpu_map_naming_a_gpu_that_does_not_exist():
    m = manifest(gpu(0, UUID0), gpu(1, UUID1))
    problems = problems_of(m, inventory(gpu(0, UUID0), gpu(1, UUID1)),
                           gpu_map=parse_gpu_map("0=5,3=1"))
    assert [(p.check, p.line) for p in problems] == [
        ("gpu-map", "--gpu-map 0=5: this host has no GPU 5 (it has GPU 0, GPU 1)"),
        ("gpu-map", "--gpu-map 3=1: the checkpoint has no GPU 3 (it used GPU 0, GPU 1)")]


def test_a_pin_onto_the_wrong_chip_names_the_map_entry():
    m = manifest(gpu(0, UUID0))
    [p] = problems_of(m, inventory(gpu(0, UUID0), gpu(1, UUID1, A100)),
                      gpu_map=parse_gpu_map("0=1"))
    assert p.check == "chip" and p.message.startswith(f"--gpu-map 0=1: GPU 1 here is a {A100}")


def test_a_target_in_mig_mode_is_refused():
    mig = GpuInfo(0, UUID0, H100, 0, "00000000:18:00.0", 80 * GIB, 0, "9.0", mig_enabled=True)
    [p] = problems_of(manifest(gpu(0, SRC0)), Inventory("580.159.04", "13.0", [mig]))
    assert p.check == "mig" and "MIG mode" in p.message and p.line == p.message


def test_no_driver_here_is_one_line():
    problems = problems_of(manifest(gpu(0, UUID0)), Inventory(error="no NVIDIA driver: X"))
    assert [p.line for p in problems] == ["the checkpoint used 1 NVIDIA GPU(s) but this host has "
                                          "none usable (no NVIDIA driver: X)"]


@pytest.mark.parametrize("facts, check, text", [
    (HostFacts("aarch64", "6.8.0", "4.1.1"), "arch", "taken on x86_64 and this host is aarch64"),
    (HostFacts("x86_64", "6.1.0-26-amd64", "4.1.1"), "kernel", "kernel 6.1.0-26-amd64 here is older"),
    (HostFacts("x86_64", "6.8.0", None), "criu", "restore needs CRIU 4.0 or newer, found no criu"),
    (HostFacts("x86_64", "6.8.0", "3.17.1"), "criu", "found 3.17.1"),
    (HostFacts("x86_64", "6.8.0", "4.0"), "criu-version", "CRIU 4.0 here is older than CRIU 4.1.1"),
    (HostFacts("x86_64", "6.8.0", "4.1.1", mps_active=True), "mps", "MPS control daemon"),
])
def test_host_checks(facts, check, text):
    [p] = problems_of(manifest(gpu(0, UUID0)), inventory(gpu(0, UUID0)), host=facts)
    assert p.check == check and text in p.message


def test_host_checks_pass_on_a_matching_host_and_apply_without_gpus():
    facts = HostFacts("x86_64", "6.18.0-1-amd64", "4.1.1")
    assert plan_of(manifest(gpu(0, UUID0)), inventory(gpu(0, UUID0)), host=facts)
    cpu_only = manifest(processes=False)
    assert plan_of(cpu_only, Inventory(error="no driver"), host=facts).moves == ()
    [p] = problems_of(cpu_only, Inventory(error="no driver"), host=HostFacts("aarch64", None, "4.1.1"))
    assert p.check == "arch"


def test_strict_mode_refuses_a_missing_gpu_that_another_could_replace():
    m = manifest(gpu(0, SRC0))
    [p] = problems_of(m, inventory(gpu(0, UUID0)), remap=False)
    assert p.line == f"GPU 0 of the checkpoint ({H100}, {SRC0}) is not on this host"
    assert plan_of(m, inventory(gpu(0, UUID0)), remap=True).moves[0].target.uuid == UUID0


def test_a_gpu_that_changed_chip_cannot_be_overridden():
    [p] = problems_of(manifest(gpu(0, UUID0)), inventory(gpu(0, UUID0, A100)), remap=False)
    assert p.line == f"GPU {UUID0} is a {A100} here but was a {H100}"


# --- UUID pairs -----------------------------------------------------------------------------

@pytest.mark.parametrize("moves, visible, pairs", [
    ({"a": "b"}, ["a", "b"], {("a", "b"), ("b", "a")}),                     # swap on one host
    ({"x": "b"}, ["a", "b", "c"], {("x", "b"), ("a", "a"), ("c", "c")}),      # from another host
    ({"a": "b", "b": "c"}, ["a", "b", "c"], {("a", "b"), ("b", "c"), ("c", "a")}),  # a chain
    ({"a": "a"}, ["a", "b"], {("a", "a"), ("b", "b")}),
    ({"a": "b", "x": "a"}, ["a", "b"], {("a", "b"), ("x", "a")}),
])
def test_pairs_cover_every_gpu_the_driver_sees_once(moves, visible, pairs):
    result = complete_pairs(moves, visible)
    assert set(result) == pairs
    assert sorted(new for _, new in result) == sorted(visible)
    assert len({old for old, _ in result}) == len(result)


def test_a_gpu_map_without_remapping_is_a_programming_error():
    with pytest.raises(ValueError, match="needs remap=True"):
        plan_restore(manifest(gpu(0, UUID0)), inventory(gpu(0, UUID0)), remap=False,
                     gpu_map=parse_gpu_map("0=0"))


def test_an_nvlink_island_on_a_big_host_is_found():
    # 8 GPUs of the checkpoint, 16 here, NVLink only among 8-15: the island beats indices 0-7
    m = manifest(*(gpu(i, uuid(100 + i)) for i in range(8)))
    here = inventory(*(gpu(i, uuid(i), memory_used=i * GIB) for i in range(16)))
    island = Topology(links={frozenset((uuid(a), uuid(b))): 2
                             for a in range(8, 16) for b in range(a + 1, 16)})
    start = time.monotonic()
    plan = plan_of(m, here, topology=island)
    assert time.monotonic() - start < 5
    assert sorted(mv.target.index for mv in plan.moves) == list(range(8, 16))


def test_a_busy_own_gpu_whose_replacements_are_taken_says_so():
    m = manifest(gpu(0, UUID0), gpu(1, SRC1), used={UUID0: 10 * GIB, SRC1: 10 * GIB})
    [p] = problems_of(m, inventory(gpu(0, UUID0, memory_used=75 * GIB), gpu(1, UUID1)))
    assert p.message.startswith(f"GPU 0 of the checkpoint ({H100}, {UUID0}) cannot stay on its GPU, "
                                "and the 1 GPU(s) here that could take it go to")
