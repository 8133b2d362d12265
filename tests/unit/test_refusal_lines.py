"""The planner's refusal: one clear line per reason this host cannot take a
checkpoint's GPUs, where only its own GPUs count (a plain `podman container
restore`: its spec still names them)."""

from __future__ import annotations

import pytest

from gpusnap.gpu.checks import MIN_CHECKPOINT_DRIVER, driver_major
from gpusnap.gpu.inventory import Inventory
from gpusnap.gpu.manifest import Manifest
from gpusnap.gpu.plan import plan_restore
from tests.unit.fakes import UUID0, UUID1, gpu, inventory

H100 = "NVIDIA H100 80GB HBM3"
A100 = "NVIDIA A100-SXM4-80GB"


def manifest(*gpus: tuple[int, str, str]) -> Manifest:
    return Manifest(gpus=[{"index": i, "uuid": u, "name": n} for i, u, n in gpus], processes=[],
                    driver_version="580.159.04", cuda_driver_version="13.0",
                    criu_version="4.1.1", quiesced_by="gpusnap")


def restore_problems(manifest: Manifest | None, inventory: Inventory) -> list[str]:
    result = plan_restore(manifest, inventory, remap=False)
    return [p.line for p in result] if isinstance(result, list) else []


def test_same_gpus_on_a_new_enough_driver_is_fine():
    m = manifest((0, UUID0, H100), (1, UUID1, H100))
    assert restore_problems(m, inventory(gpu(0, UUID0, H100), gpu(1, UUID1, H100))) == []


def test_checkpoint_without_gpus_restores_anywhere():
    no_gpus_here = Inventory(error="no NVIDIA driver: NVML Shared Library Not Found")
    assert restore_problems(None, no_gpus_here) == []
    assert restore_problems(manifest(), no_gpus_here) == []


def test_no_gpus_on_the_target_is_one_line_with_the_reason():
    m = manifest((0, UUID0, H100), (1, UUID1, H100))
    problems = restore_problems(m, Inventory(error="no NVIDIA driver: Driver Not Loaded"))
    assert problems == ["the checkpoint used 2 NVIDIA GPU(s) but this host has none usable "
                        "(no NVIDIA driver: Driver Not Loaded)"]


def test_fewer_gpus_names_each_missing_one():
    m = manifest((0, UUID0, H100), (1, UUID1, H100))
    problems = restore_problems(m, inventory(gpu(0, UUID0, H100)))
    assert problems == [f"GPU 1 of the checkpoint ({H100}, {UUID1}) is not on this host"]


def test_a_different_chip_elsewhere_is_named_in_the_problem():
    # Another host: other UUIDs, other chip. The line says which GPU the checkpoint wants.
    m = manifest((0, UUID0, H100))
    problems = restore_problems(m, inventory(gpu(0, UUID1, A100)))
    assert problems == [f"GPU 0 of the checkpoint ({H100}, {UUID0}) is not on this host"]


def test_a_gpu_whose_chip_changed_is_reported_as_such():
    m = manifest((0, UUID0, H100))
    problems = restore_problems(m, inventory(gpu(0, UUID0, A100)))
    assert problems == [f"GPU {UUID0} is a {A100} here but was a {H100}"]


@pytest.mark.parametrize("version", ["550.54.15", "535.183.01", None, "garbage"])
def test_driver_too_old_is_one_line(version):
    m = manifest((0, UUID0, H100))
    problems = restore_problems(m, inventory(gpu(0, UUID0, H100), driver=version))
    assert problems == [f"NVIDIA driver {version} cannot restore CUDA checkpoints: "
                        f"r{MIN_CHECKPOINT_DRIVER} or newer is needed"]


def test_the_oldest_driver_that_can_restore_is_accepted():
    m = manifest((0, UUID0, H100))
    assert restore_problems(m, inventory(gpu(0, UUID0, H100), driver="570.86.10")) == []


def test_every_problem_gets_its_own_line():
    m = manifest((0, UUID0, H100), (1, UUID1, H100))
    problems = restore_problems(m, inventory(gpu(0, UUID0, A100), driver="550.1"))
    assert problems == [
        f"NVIDIA driver 550.1 cannot restore CUDA checkpoints: r{MIN_CHECKPOINT_DRIVER} or newer is needed",
        f"GPU {UUID0} is a {A100} here but was a {H100}",
        f"GPU 1 of the checkpoint ({H100}, {UUID1}) is not on this host",
    ]
    assert all("\n" not in p for p in problems)


@pytest.mark.parametrize("version, major", [("580.159.04", 580), ("570", 570), (None, 0),
                                            ("", 0), ("r570", 0)])
def test_driver_major(version, major):
    assert driver_major(version) == major


def test_a_working_driver_that_shows_no_gpu_reports_each_gpu_missing():
    m = manifest((0, UUID0, H100), (1, UUID1, H100))
    assert restore_problems(m, inventory()) == [
        f"GPU 0 of the checkpoint ({H100}, {UUID0}) is not on this host",
        f"GPU 1 of the checkpoint ({H100}, {UUID1}) is not on this host",
    ]
