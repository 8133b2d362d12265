"""pages/parent_pages.py + criu/pagemap.py: the final round's pagemap rewritten
against round 1's, checked by reading every page back the way CRIU does."""

from __future__ import annotations

import hashlib
import random
from pathlib import Path

import pytest

from gpusnap.criu import pagemap as pm
from gpusnap.oci.bundle import Chunk
from gpusnap.pages import parent_pages
PAGE = pm.PAGE


def _image(pages_id: int, runs: list[tuple[int, int]]) -> bytes:
    return pm.serialize(pm.Pagemap(pages_id, tuple(pm.Run(v, n, pm.PE_PRESENT) for v, n in runs)))


def _memory(runs: list[tuple[int, int]], data: bytes) -> dict[int, bytes]:
    out, pos = {}, 0
    for vaddr, n in runs:
        for i in range(n):
            out[vaddr + i * PAGE] = data[pos:pos + PAGE]
            pos += PAGE
    return out


def _chunks(data: bytes, cuts: list[int]) -> list[Chunk]:
    bounds = [0, *cuts, len(data)]
    return [Chunk("sha256:" + hashlib.sha256(data[a:b]).hexdigest(), b - a, "z", 0)
            for a, b in zip(bounds, bounds[1:]) if b > a]


def _cdc(data: bytes) -> list[int]:
    """Content-defined cuts (as the real chunker's, they follow the bytes when they shift)."""
    return [i for i in range(2, len(data)) if data[i - 1] == 0 and data[i - 2] < 64]


def _restored(image: bytes, pages: bytes, parent: dict[int, bytes]) -> dict[int, bytes]:
    """What CRIU puts in memory: present runs read in order from the pages
    file, parent runs looked up by address in the parent."""
    out, pos = {}, 0
    for r in pm.parse(image).runs:
        for i in range(r.pages):
            vaddr = r.vaddr + i * PAGE
            if r.flags & pm.PE_PARENT:
                out[vaddr] = parent[vaddr]
            else:
                out[vaddr] = pages[pos:pos + PAGE]
                pos += PAGE
    assert pos == len(pages)
    return out


def _case(tmp_path: Path, old_runs, old_data, new_runs, new_data, old_cuts, new_cuts):
    plan = parent_pages.plan(_chunks(new_data, new_cuts), [(c.digest, c.size) for c in
                                                           _chunks(old_data, old_cuts)],
                             pm.parse(_image(7, new_runs)), pm.parse(_image(3, old_runs)))
    scratch, out = tmp_path / "scratch", tmp_path / "pages-7.img"
    scratch.write_bytes(new_data)  # all of it here: the runs say which chunks a pull writes
    assert parent_pages.compact(scratch, out, plan.own) == plan.own_bytes
    got = _restored(plan.pagemap, out.read_bytes(), _memory(old_runs, old_data))
    assert got == _memory(new_runs, new_data)
    assert pm.parse(plan.pagemap).pages_id == 7
    covered = [(off, off + sum(c.size for c in run)) for off, run in plan.runs]
    for a, b in plan.own:  # every own byte lies in a chunk the pull writes
        assert any(s <= a and b <= e for s, e in covered) or \
            sum(min(b, e) - max(a, s) for s, e in covered if s < b and a < e) == b - a
    return plan


def test_a_grown_mapping_shifts_the_rest_which_is_still_the_parents(tmp_path):
    rnd = random.Random(1)
    old = rnd.randbytes(40 * PAGE)
    old_runs = [(0x10000, 4), (0x7f0000000000, 36)]
    # the first mapping grew by 2 pages; one page of the big one changed
    new = old[:4 * PAGE] + rnd.randbytes(2 * PAGE) + old[4 * PAGE:20 * PAGE] + \
        rnd.randbytes(PAGE) + old[21 * PAGE:]
    new_runs = [(0x10000, 6), (0x7f0000000000, 36)]
    plan = _case(tmp_path, old_runs, old, new_runs, new, _cdc(old), _cdc(new))
    assert plan.parent_bytes >= 30 * PAGE
    assert plan.own_bytes <= 12 * PAGE  # the new pages, and those chunks' ragged edges


def test_same_bytes_at_another_address_are_not_the_parents(tmp_path):
    rnd = random.Random(2)
    old = rnd.randbytes(16 * PAGE)
    # the same contents, mapped 1 MiB higher: CRIU would look them up at the new address
    plan = _case(tmp_path, [(0x100000, 16)], old, [(0x200000, 16)], old,
                 [PAGE * i for i in range(1, 16)], [PAGE * i for i in range(1, 16)])
    assert plan.parent_bytes == 0 and plan.own == [(0, 16 * PAGE)]


def test_a_shift_by_part_of_a_page_is_written_whole(tmp_path):
    rnd = random.Random(3)
    old = rnd.randbytes(8 * PAGE)
    new = rnd.randbytes(100) + old[:-100]
    plan = _case(tmp_path, [(0x100000, 8)], old, [(0x100000, 8)], new,
                 [], [100])
    assert plan.parent_bytes == 0


def test_a_parent_range_across_two_runs_and_holes_between(tmp_path):
    rnd = random.Random(4)
    old = rnd.randbytes(12 * PAGE)
    runs = [(0x100000, 3), (0x105000, 5), (0x200000, 4)]  # address holes between runs
    new = old[:5 * PAGE] + rnd.randbytes(PAGE) + old[6 * PAGE:]
    plan = _case(tmp_path, runs, old, runs, new, [PAGE * i for i in range(1, 12)],
                 [PAGE * i for i in range(1, 12)])
    assert plan.own == [(5 * PAGE, 6 * PAGE)]
    kinds = [(r.vaddr, r.pages, r.flags) for r in pm.parse(plan.pagemap).runs]
    assert kinds == [(0x100000, 3, pm.PE_PARENT), (0x105000, 2, pm.PE_PARENT),
                     (0x107000, 1, pm.PE_PRESENT), (0x108000, 2, pm.PE_PARENT),
                     (0x200000, 4, pm.PE_PARENT)]


def test_pagemap_images_round_trip_and_bad_ones_are_refused():
    m = pm.Pagemap(5, (pm.Run(0x7fff00000000, 3, pm.PE_PRESENT), pm.Run(0x1000, 1, pm.PE_PARENT)))
    assert pm.parse(pm.serialize(m)) == m
    with pytest.raises(pm.ImageError):
        pm.parse(b"\x19\x43\x56\x54" + b"\0" * 4)
    with pytest.raises(pm.ImageError):
        pm.parse(pm.serialize(m)[:-1])
    with pytest.raises(pm.ImageError):  # a pagemap that does not describe the pages file
        parent_pages.plan([Chunk("sha256:a", PAGE, "z", 0)], [], pm.parse(_image(1, [(0, 2)])),
                          pm.parse(_image(1, [(0, 1)])))


def test_repeated_chunks_follow_the_shift_of_their_neighbours(tmp_path):
    """Zeroed memory makes one chunk many times over: each copy is the parent's
    where the shift around it says, not where the first copy lay."""
    rnd = random.Random(5)
    zero = bytes(PAGE)
    old = rnd.randbytes(PAGE) + zero * 4 + rnd.randbytes(PAGE) + zero * 4 + rnd.randbytes(PAGE)
    new = rnd.randbytes(PAGE) + old  # a grown mapping before: everything one page on
    cuts = lambda data: [PAGE * i for i in range(1, len(data) // PAGE)]  # noqa: E731
    plan = _case(tmp_path, [(0x10000, 1), (0x7f0000000000, 10)], old,
                 [(0x10000, 2), (0x7f0000000000, 10)], new, cuts(old), cuts(new))
    assert plan.own == [(0, 2 * PAGE)]  # the grown mapping's pages; all ten others the parent's
