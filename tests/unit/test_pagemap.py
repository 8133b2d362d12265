"""pagemap.parse reads an image in one pass with its own varint reader: it must
read what the generic protobuf reader reads, old layouts and unknown fields
included, and refuse what that refuses."""

from __future__ import annotations

import random
import struct

import pytest

from gpusnap.criu import pagemap
from gpusnap.criu.images import IMG_COMMON_MAGIC, ImageError, fields_of, messages
from gpusnap.proto.wire import varint

MAGICS = struct.pack("<II", IMG_COMMON_MAGIC, pagemap.PAGEMAP_MAGIC)


def _entry(fields: list[tuple[int, int]]) -> bytes:
    body = b"".join(varint(n << 3) + varint(v) for n, v in fields)
    return struct.pack("<I", len(body)) + body


def _generic(data: bytes) -> pagemap.Pagemap:
    """What the image says, read by the generic reader (the old parse)."""
    found = [{n: v for n, _, v in fields_of(m)} for m in messages(data)]
    old = pagemap.PE_PARENT, pagemap.PE_PRESENT
    runs = tuple(pagemap.Run(f.get(1, 0), f.get(5, f.get(2, 0)),
                             f[4] if 4 in f else old[0] if f.get(3) else old[1])
                 for f in found[1:])
    return pagemap.Pagemap(found[0].get(1, 0), runs)


def _random_entry(rng: random.Random) -> list[tuple[int, int]]:
    vaddr = rng.choice([0, 1, 0x7F0000000000 + rng.randrange(1 << 30) * 4096])
    kind = rng.randrange(4)
    if kind == 0:  # CRIU 4: compat 0, flags, nr_pages
        fields = [(1, vaddr), (2, 0), (4, rng.choice([1, 2, 4, 5, 6, 300])),
                  (5, rng.randrange(1, 1 << 20))]
    elif kind == 1:  # old: compat_nr_pages, in_parent
        fields = [(1, vaddr), (2, rng.randrange(1, 500)), (3, rng.randrange(2))]
    elif kind == 2:  # old: compat_nr_pages only (present)
        fields = [(1, vaddr), (2, rng.randrange(1, 1 << 15))]
    else:  # a field this reader does not know, with a two-byte tag
        fields = [(1, vaddr), (20, rng.randrange(1 << 40)), (4, 4), (5, 7)]
    rng.shuffle(fields)
    return fields


@pytest.mark.parametrize("seed", range(20))
def test_it_reads_what_the_generic_reader_reads(seed):
    rng = random.Random(seed)
    data = MAGICS + _entry([(1, rng.randrange(1, 200))]) + b"".join(
        _entry(_random_entry(rng)) for _ in range(rng.randrange(0, 300)))
    assert pagemap.parse(data) == _generic(data)


def test_what_it_writes_it_reads_back():
    rng = random.Random(7)
    runs = tuple(pagemap.Run(rng.randrange(1 << 47) & ~0xFFF, rng.randrange(1, 1 << 21),
                             rng.choice([pagemap.PE_PRESENT, pagemap.PE_PARENT, 300]))
                 for _ in range(500))
    written = pagemap.serialize(pagemap.Pagemap(9, runs))
    assert pagemap.parse(written) == pagemap.Pagemap(9, runs) == _generic(written)


HEAD = _entry([(1, 1)])


@pytest.mark.parametrize("data,message", [
    (b"\x00" * 8, "not a CRIU pagemap image"),
    (MAGICS, "without its head"),
    (MAGICS + HEAD + b"\x05\x00", "truncated entry size"),
    (MAGICS + HEAD + struct.pack("<I", 9) + b"\x08\x01", "truncated entry"),
    (MAGICS + HEAD + struct.pack("<I", 2) + b"\x08\x80", "truncated varint"),
    (MAGICS + HEAD + struct.pack("<I", 1) + b"\x88", "truncated varint"),
    (MAGICS + HEAD + struct.pack("<I", 3) + b"\x0a\x01\x00", "unexpected wire type 2"),
    (MAGICS + HEAD + struct.pack("<I", 12) + b"\x08" + b"\xff" * 11, "varint too long"),
])
def test_a_broken_image_is_refused_in_words(data, message):
    with pytest.raises(ImageError, match=message):
        pagemap.parse(data)
