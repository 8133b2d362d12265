"""CRIU's pagemap images (pagemap-<vpid>.img), read and written without crit.

A pagemap image is the two magics, then u32-sized protobuf messages: one
pagemap_head (pages_id: the task's pages-<id>.img), then one pagemap_entry per
run of pages (images/pagemap.proto). A run with PE_PRESENT has its pages next
in the pages file, in order, so a page's offset there is implicit; a run with
PE_PARENT has none there: CRIU reads it from the ``parent`` images folder, at
the same address (how its own pre-dump chains restore, criu/page-read.c).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from gpusnap.criu.images import IMG_COMMON_MAGIC, ImageError, fields_of, messages
from gpusnap.proto.wire import varint

PAGEMAP_MAGIC = 0x56084025
PAGE = 4096
PE_PARENT, PE_LAZY, PE_PRESENT = 1, 2, 4


@dataclass(frozen=True)
class Run:
    vaddr: int
    pages: int
    flags: int

    @property
    def present(self) -> bool:
        return bool(self.flags & PE_PRESENT)


@dataclass(frozen=True)
class Pagemap:
    pages_id: int
    runs: tuple[Run, ...]

    @property
    def pages_file(self) -> str:
        return f"pages-{self.pages_id}.img"

    def present_bytes(self) -> int:
        return sum(r.pages for r in self.runs if r.present) * PAGE


def _fields(data: bytes) -> dict[int, int]:
    out = {}
    for number, wire, value in fields_of(data):
        if wire != 0:
            raise ImageError(f"unexpected wire type {wire} in a pagemap entry")
        out[number] = value
    return out


def parse(data: bytes) -> Pagemap:
    if len(data) < 8 or struct.unpack_from("<II", data) != (IMG_COMMON_MAGIC, PAGEMAP_MAGIC):
        raise ImageError("not a CRIU pagemap image")
    fields = [_fields(m) for m in messages(data)]
    if not fields:
        raise ImageError("a pagemap image without its head")
    runs = []
    for f in fields[1:]:
        # as criu/page-read.c reads old images: in_parent, or no flags at all (present)
        flags = f[4] if 4 in f else (PE_PARENT if f.get(3) else PE_PRESENT)
        runs.append(Run(f.get(1, 0), f.get(5, f.get(2, 0)), flags))
    return Pagemap(fields[0].get(1, 0), tuple(runs))


def _message(fields: list[tuple[int, int]]) -> bytes:
    body = b"".join(varint(n << 3) + varint(v) for n, v in fields)
    return struct.pack("<I", len(body)) + body


def serialize(pagemap: Pagemap) -> bytes:
    """As CRIU 4 writes one: compat_nr_pages 0, nr_pages and flags set."""
    out = [struct.pack("<II", IMG_COMMON_MAGIC, PAGEMAP_MAGIC),
           _message([(1, pagemap.pages_id)])]
    out += [_message([(1, r.vaddr), (2, 0), (4, r.flags), (5, r.pages)]) for r in pagemap.runs]
    return b"".join(out)


def offsets(pagemap: Pagemap) -> list[tuple[int, int, int]]:
    """(offset in the pages file, vaddr, pages) of each present run, in order."""
    out, pos = [], 0
    for r in pagemap.runs:
        if r.present:
            out.append((pos, r.vaddr, r.pages))
            pos += r.pages * PAGE
    return out
