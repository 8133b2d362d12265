"""One target GPU per source GPU: the best injective choice by the planner's preferences.

Preferences, in order: place as many GPUs as possible, keep the checkpoint's
own GPUs, NVLink-linked targets, targets on one NUMA node, the same index,
the least memory in use, then lower indices. The topology terms depend on
the whole set, so greedy choices alone can miss (8 sources on a 16-GPU host
with an NVLink island at 8-15): a greedy pass from every seed target gives a
good start, and a bounded exhaustive search improves on it.
"""

from __future__ import annotations

from typing import Protocol, Sequence

from gpusnap.gpu.topology import Topology

SEARCH_BUDGET = 120_000  # search steps: all 8! choices for 8 GPUs on 8 (109,601 steps) fit


class Gpu(Protocol):
    index: int
    uuid: str
    memory_used: int


def max_matching(order: Sequence[Gpu], cands: dict[str, list[Gpu]]) -> int:
    """How many sources can be placed at all (augmenting paths)."""
    owner: dict[str, str] = {}  # target uuid -> source uuid

    def augment(s: str, seen: set[str]) -> bool:
        for t in cands[s]:
            if t.uuid in seen:
                continue
            seen.add(t.uuid)
            if t.uuid not in owner or augment(owner[t.uuid], seen):
                owner[t.uuid] = s
                return True
        return False

    return sum(augment(s.uuid, set()) for s in order)


def score(sources: Sequence[Gpu], chosen: dict[str, Gpu], topo: Topology) -> tuple:
    targets = [chosen[s.uuid] for s in sources if s.uuid in chosen]
    ids = [t.uuid for t in targets]
    pairs = [(a, b) for i, a in enumerate(ids) for b in ids[i + 1:]]
    return (len(chosen),
            sum(1 for s in sources if s.uuid in chosen and chosen[s.uuid].uuid == s.uuid),
            sum(1 for a, b in pairs if topo.link(a, b) > 0),
            sum(1 for a, b in pairs if topo.same_numa(a, b)),
            sum(1 for s in sources if s.uuid in chosen and chosen[s.uuid].index == s.index),
            -sum(t.memory_used for t in targets),
            tuple(-t.index for t in targets))


def _seeded(order: Sequence[Gpu], cands: dict[str, list[Gpu]], topo: Topology
            ) -> list[dict[str, Gpu]]:
    """A greedy choice grown from each possible target, neighbours first."""
    union = {t.uuid: t for s in order for t in cands[s.uuid]}
    starts = []
    for seed in sorted(union.values(), key=lambda t: t.index):
        chosen: dict[str, Gpu] = {}
        for s in order:
            taken = {t.uuid for t in chosen.values()}
            options = [t for t in cands[s.uuid] if t.uuid not in taken]
            if not options:
                continue
            if seed in options and seed.uuid not in taken:
                chosen[s.uuid] = seed
                continue
            chosen[s.uuid] = max(options, key=lambda t: (
                t.uuid == s.uuid,
                sum(1 for u in chosen.values() if topo.link(t.uuid, u.uuid) > 0),
                sum(1 for u in chosen.values() if topo.same_numa(t.uuid, u.uuid)),
                t.index == s.index, -t.memory_used, -t.index))
        starts.append(chosen)
    return starts


def assign(sources: Sequence[Gpu], cands: dict[str, list[Gpu]], topo: Topology) -> dict[str, Gpu]:
    """source uuid -> target; a source is left out only where no choice places it.

    ``cands`` lists each source's possible targets, best first (that order
    makes the search's first complete choice the greedy one).
    """
    order = sorted(sources, key=lambda s: len(cands[s.uuid]))  # most constrained first
    reachable = max_matching(order, cands)
    best: dict[str, Gpu] = {}
    best_key: tuple | None = None
    if topo.links or topo.numa:
        for start in _seeded(order, cands, topo):
            key = score(sources, start, topo)
            if best_key is None or key > best_key:
                best, best_key = start, key
    chosen: dict[str, Gpu] = {}
    steps = 0
    # running sums of the score's terms, kept as the search goes down and up
    totals = {"same": 0, "links": 0, "numa": 0, "index": 0, "load": 0}

    def dfs(i: int) -> None:
        nonlocal best, best_key, steps
        steps += 1
        if steps > SEARCH_BUDGET and best_key is not None:
            return
        if i == len(order):
            key = (len(chosen), totals["same"], totals["links"], totals["numa"], totals["index"],
                   -totals["load"], tuple(-chosen[s.uuid].index for s in sources if s.uuid in chosen))
            if best_key is None or key > best_key:
                best, best_key = dict(chosen), key
            return
        s = order[i]
        taken = {t.uuid for t in chosen.values()}
        for t in cands[s.uuid]:
            if t.uuid in taken:
                continue
            delta = {"same": int(t.uuid == s.uuid), "index": int(t.index == s.index),
                     "load": t.memory_used,
                     "links": sum(1 for u in chosen.values() if topo.link(t.uuid, u.uuid) > 0),
                     "numa": sum(1 for u in chosen.values() if topo.same_numa(t.uuid, u.uuid))}
            for k, v in delta.items():
                totals[k] += v
            chosen[s.uuid] = t
            dfs(i + 1)
            del chosen[s.uuid]
            for k, v in delta.items():
                totals[k] -= v
        if len(chosen) + (len(order) - i - 1) >= reachable:  # leaving s out can still be best
            dfs(i + 1)

    dfs(0)
    return best
