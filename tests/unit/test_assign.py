"""gpusnap.gpu.assign: one target per source, by the planner's preferences in order."""

from __future__ import annotations

from dataclasses import dataclass

from gpusnap.gpu.assign import assign, max_matching, score
from gpusnap.gpu.topology import Topology


@dataclass(frozen=True)
class G:
    index: int
    uuid: str
    memory_used: int = 0


def test_an_exhaustive_search_beats_the_greedy_choice():
    # greedy would give s0 its same-index t0 and leave s1 nothing: placing both wins
    s0, s1 = G(0, "s0"), G(1, "s1")
    t0, t1 = G(0, "t0"), G(1, "t1")
    chosen = assign([s0, s1], {"s0": [t0, t1], "s1": [t0]}, Topology())
    assert chosen == {"s0": t1, "s1": t0}


def test_a_source_is_left_out_only_when_nothing_can_place_it():
    s0, s1, t0 = G(0, "s0"), G(1, "s1"), G(0, "t0")
    chosen = assign([s0, s1], {"s0": [t0], "s1": [t0]}, Topology())
    assert list(chosen.values()) == [t0] and len(chosen) == 1
    assert max_matching([s0, s1], {"s0": [t0], "s1": [t0]}) == 1


def test_score_terms_come_in_the_documented_order():
    s0, s1 = G(0, "s0"), G(1, "s1")
    a, b, c = G(0, "a"), G(1, "b", memory_used=5), G(2, "c")
    topo = Topology(links={frozenset(("a", "c")): 1})
    linked = score([s0, s1], {"s0": a, "s1": c}, topo)
    same_index = score([s0, s1], {"s0": a, "s1": b}, topo)
    assert linked > same_index  # NVLink before same index
    assert linked[:4] == (2, 0, 1, 0) and same_index[4:6] == (2, -5)
