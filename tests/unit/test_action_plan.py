"""The CRIU action script's post-resume step hands the plan's GPU UUID pairs to the driver."""

from __future__ import annotations

import json

import pytest

from gpusnap import PLAN_NAME
from gpusnap.criu import action
from gpusnap.errors import GpusnapError
from gpusnap.gpu.gpumap import parse_gpu_map
from gpusnap.gpu.plan import plan_restore
from tests.unit.fakes import UUID0, UUID1, gpu, inventory
from tests.unit.test_plan import manifest


def _write_plan(image_dir, gpu_map: str) -> None:
    g0, g1 = gpu(0, UUID0), gpu(1, UUID1)
    plan = plan_restore(manifest(g0), inventory(g0, g1), gpu_map=parse_gpu_map(gpu_map))
    (image_dir / PLAN_NAME).write_text(json.dumps(plan.to_dict()))


def test_no_plan_means_no_pairs(tmp_path):
    assert action._gpu_pairs(str(tmp_path)) is None


def test_a_moved_gpu_gives_every_gpu_a_pair(tmp_path):
    _write_plan(tmp_path, "0=1")
    # the driver wants every GPU it sees mapped: 0->1 and the freed 1->0
    assert sorted(action._gpu_pairs(str(tmp_path))) == sorted([(UUID0, UUID1), (UUID1, UUID0)])


def test_a_plan_that_keeps_the_gpus_needs_no_pairs(tmp_path):
    _write_plan(tmp_path, "0=0")
    assert action._gpu_pairs(str(tmp_path)) is None


def test_a_damaged_plan_is_one_clear_error(tmp_path):
    (tmp_path / PLAN_NAME).write_text('{"moves": 3}')
    with pytest.raises(GpusnapError, match="is not a GPU plan gpusnap can read"):
        action._gpu_pairs(str(tmp_path))
