"""gpusnap.gpu.checks: named checks, one-line problems, GPUSNAP_SKIP_CHECKS parsed strictly."""

from __future__ import annotations

import pytest

from gpusnap.gpu.checks import (CHECKS, Problem, SkipChecksError, parse_skip, skip_from_env,
                                split_skipped, version_key)


def test_skip_list_is_parsed_with_spaces_allowed():
    assert parse_skip("chip, memory") == frozenset({"chip", "memory"})
    assert parse_skip(None) == frozenset() and parse_skip("  ") == frozenset()
    assert skip_from_env({"GPUSNAP_SKIP_CHECKS": "amd-fw"}) == frozenset({"amd-fw"})
    assert skip_from_env({}) == frozenset()


@pytest.mark.parametrize("value, message", [
    ("chips", "GPUSNAP_SKIP_CHECKS: unknown check 'chips' (did you mean 'chip'?)"),
    ("bogus", "GPUSNAP_SKIP_CHECKS: unknown check 'bogus'"),
    ("count", "GPUSNAP_SKIP_CHECKS: check 'count' (enough suitable GPUs for every GPU of the "
              "checkpoint) cannot be skipped"),
    ("chip,,memory", "GPUSNAP_SKIP_CHECKS: item 2 of 'chip,,memory' is empty"),
    ("Chip", "GPUSNAP_SKIP_CHECKS: unknown check 'Chip' (did you mean 'chip'?)"),
])
def test_bad_skip_lists_fail_with_the_reason(value, message):
    with pytest.raises(SkipChecksError) as err:
        parse_skip(value)
    assert err.value.message.startswith(message)
    assert "chip" in err.value.hint and "count" not in err.value.hint


def test_only_skippable_problems_name_their_override():
    assert Problem("chip", "GPU 1 here is an A100").line == \
        "GPU 1 here is an A100 (override: GPUSNAP_SKIP_CHECKS=chip)"
    assert Problem("count", "only 1 GPU").line == "only 1 GPU"
    assert Problem("chip", "the same GPU changed chip", skippable=False).line == \
        "the same GPU changed chip"


def test_problems_are_one_line_about_a_known_check():
    with pytest.raises(ValueError):
        Problem("chipz", "x")
    with pytest.raises(ValueError):
        Problem("chip", "two\nlines")


def test_split_keeps_unskippable_problems_even_when_named():
    problems = [Problem("chip", "a"), Problem("count", "b"),
                Problem("chip", "c", skippable=False)]
    kept, skipped = split_skipped(problems, frozenset({"chip", "count"}))
    assert [p.message for p in kept] == ["b", "c"] and [p.message for p in skipped] == ["a"]


def test_every_amd_knob_is_a_plugin_variable():
    knobs = {c.kfd_env for c in CHECKS.values() if c.kfd_env}
    assert knobs == {"KFD_FW_VER_CHECK", "KFD_SDMA_FW_VER_CHECK", "KFD_CACHES_COUNT_CHECK",
                     "KFD_NUM_GWS_CHECK", "KFD_VRAM_SIZE_CHECK", "KFD_NUMA_CHECK",
                     "KFD_CAPABILITY_CHECK"}
    assert all(c.skippable for c in CHECKS.values() if c.kfd_env)


@pytest.mark.parametrize("text, parts, key", [("6.18.0-1-amd64", 2, (6, 18)),
                                              ("580.159.04", 3, (580, 159, 4)),
                                              ("13.0", 2, (13, 0)), ("r570", 3, None),
                                              (None, 2, None), ("4.1", 3, (4, 1))])
def test_version_key(text, parts, key):
    assert version_key(text, parts) == key
